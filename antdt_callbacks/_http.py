"""The little HTTP/1.1 the service speaks, over asyncio streams: keep-alive requests with a ``Content-Length`` body
in, JSON replies out.

Why not the standard library's threaded server: it serves each connection on its own thread, and with a thousand
workers holding a keep-alive connection each, a thousand threads contend for the GIL and the service lock; the
hand-overs, not the work, then bound the request rate (bench/antdt/README.md). One event loop parses and answers
every connection; only the fsync runs on another thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

__all__ = ["MAX_HEADERS", "MalformedRequest", "Request", "read_request", "write_reply"]

MAX_HEADERS = 100
"""Most header lines accepted in one request."""

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            409: "Conflict", 413: "Payload Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class MalformedRequest(ValueError):
    """The bytes on the connection are not an HTTP request we can answer; the connection is closed after the 400."""


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    keep_alive: bool


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """Read a request line and its headers (not the body); None at a clean end of the connection."""
    try:
        line = await reader.readline()
    except (ValueError, asyncio.LimitOverrunError) as e:
        raise MalformedRequest(f"request line too long: {e}") from None
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise MalformedRequest(f"malformed request line {line[:80]!r}")
    method, path, version = parts
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        try:
            h = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError) as e:
            raise MalformedRequest(f"header line too long: {e}") from None
        if h in (b"\r\n", b"\n"):
            break
        if not h:
            raise asyncio.IncompleteReadError(h, None)
        name, sep, value = h.decode("latin-1").partition(":")
        if not sep:
            raise MalformedRequest(f"malformed header line {h[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    else:
        raise MalformedRequest(f"more than {MAX_HEADERS} header lines")
    conn = headers.get("connection", "").lower()
    keep_alive = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return Request(method, path, headers, keep_alive)


def write_reply(writer: asyncio.StreamWriter, status: int, body: bytes, close: bool) -> None:
    """Queue one JSON reply (status line, headers and body in one write: no Nagle wait between them)."""
    extra = "Connection: close\r\n" if close else ""
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n")
    writer.write(head.encode("latin-1") + body)
