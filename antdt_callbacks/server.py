"""The thin HTTP layer of the sharding service: ``POST /v1/<op>`` with a JSON body, JSON replies.

Requests are serialised under one lock: ``decide`` (pure) -> ``store.commit`` (fsync) -> ``apply`` -> reply. The
lock costs nothing at our scale (a few ranks, one request per step each) and makes the state machine trivially
linearisable. Security: a body over ``max_request_bytes`` is refused unread, a missing/wrong token is refused
before parsing, and every refusal carries ``{"error": code, "message": reason}`` and changes nothing.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ._state import JobState, apply, decide
from .config import ControllerConfig, JobConfig, MonitorConfig, ServeConfig
from .errors import BadRequestError, NotFoundError, PayloadTooLargeError, ServiceError, UnauthorizedError
from .store import SQLiteStore

__all__ = ["ShardingService"]

# The stdlib logger (not transformers'): the service process must start without importing transformers/torch.
logger = logging.getLogger(__name__)


class ShardingService:
    """State + store + HTTP server. ``serve_forever`` blocks; ``start``/``stop`` run it on a thread (tests)."""

    def __init__(self, serve: ServeConfig, job: JobConfig, monitor: MonitorConfig | None = None,
                 controller: ControllerConfig | None = None):
        self.serve_cfg = serve
        self.store = SQLiteStore(serve.db)
        self.state: JobState
        self.state, created = self.store.load_or_create(job, monitor or MonitorConfig(), controller or
                                                        ControllerConfig(), job.lease_ttl_s, time.time())
        logger.info("antdt service: %s job in %s (%d shards)", "new" if created else "resumed", serve.db,
                    len(self.state.shards))
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.busy_s = 0.0
        self.started = time.time()
        self.httpd = ThreadingHTTPServer((serve.host, serve.port), _make_handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def handle(self, req: dict) -> dict:
        """Run one request through decide -> commit -> apply. Raises `ServiceError` subclasses."""
        t0 = time.perf_counter()
        with self.lock:
            d = decide(self.state, req, time.time())
            self.store.commit(d)
            apply(self.state, d)
            self.counts[str(req.get("op"))] += 1
            self.busy_s += time.perf_counter() - t0
        return d.reply

    def stats(self) -> dict:
        up = time.time() - self.started
        return {"requests": dict(self.counts), "uptime_s": up, "busy_s": self.busy_s,
                "request_rate": sum(self.counts.values()) / max(up, 1e-9)}

    def serve_forever(self) -> None:
        if self.serve_cfg.port_file:
            tmp = Path(self.serve_cfg.port_file + ".tmp")
            tmp.write_text(self.address)
            tmp.replace(self.serve_cfg.port_file)
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> ShardingService:
        self._thread = threading.Thread(target=self.serve_forever, name="antdt-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.store.close()


def _make_handler(service: ShardingService) -> type[BaseHTTPRequestHandler]:
    token = service.serve_cfg.token
    limit = service.serve_cfg.max_request_bytes

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Header and body go out as two writes; Nagle would hold the body back until the client's delayed ACK
        # (bench/antdt/README.md).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
            logger.debug("antdt service: " + format, *args)

        def _reply(self, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self) -> None:
            if token is None:
                return
            got = self.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                raise UnauthorizedError("missing or wrong token: send 'Authorization: Bearer <token>' with the "
                                        "service's shared token (ANTDT_TOKEN).")

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            try:
                self._authorised()
                if self.path == "/v1/stats":
                    return self._reply(200, service.stats())
                if self.path == "/v1/status":
                    return self._reply(200, service.handle({"op": "status"}))
                raise NotFoundError(f"no route GET {self.path}; use POST /v1/<op> or GET /v1/status.")
            except ServiceError as e:
                self._reply(e.status, e.to_payload())

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            close = False
            try:
                self._authorised()
                try:
                    length = int(self.headers.get("Content-Length", "-1"))
                except ValueError:
                    length = -1
                if length < 0:
                    close = True
                    raise BadRequestError("a Content-Length header is required.")
                if length > limit:
                    close = True  # the body stays unread: the connection cannot be reused
                    raise PayloadTooLargeError(f"request body of {length} bytes exceeds the limit of {limit}.")
                raw = self.rfile.read(length)
                if not self.path.startswith("/v1/"):
                    raise NotFoundError(f"no route POST {self.path}; use POST /v1/<op>.")
                try:
                    req = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequestError(f"body is not valid JSON: {e}.") from None
                if not isinstance(req, dict):
                    raise BadRequestError("the request body must be a JSON object.")
                req["op"] = self.path[len("/v1/"):]
                self._reply(200, service.handle(req))
            except ServiceError as e:
                if close:
                    self.close_connection = True
                self._reply(e.status, e.to_payload())
            except Exception as e:  # noqa: BLE001 - a bug must answer 500, not kill the connection thread
                logger.error("antdt service: internal error on %s: %r", self.path, e)
                self._reply(500, {"error": "internal", "message": repr(e)})

    return Handler
