"""The thin HTTP layer of the sharding service: ``POST /v1/<op>`` with a JSON body, JSON replies.

One asyncio event loop serves every connection (`_http`), and requests are decided one at a time on it, which makes
the state machine trivially linearisable. With ``commit_mode="group"`` (the default) a request is ``decide`` (pure)
-> hand-over to the writer thread -> ``apply``, and its reply waits until the writer has committed the transaction
that holds the decision (`_commit`). With ``"request"`` each request is ``decide`` -> ``store.commit`` (fsync, on a
writer thread) -> ``apply`` under one lock, so requests queue behind each other's fsync. Either way no reply leaves
before its decision is durable. The listen backlog is sized for a thousand workers that reconnect at once after a
restart (a full backlog drops their connection attempts, and each dropped one waits for TCP's retransmission timeout,
a second or more).

Security: a body over ``max_request_bytes`` is refused unread, a missing/wrong token is refused before the body is
read, and every refusal carries ``{"error": code, "message": reason}`` and changes nothing. A connection whose body
was left unread is closed after the reply.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import hmac
import json
import logging
import socket
import threading
import time
from collections import Counter
from pathlib import Path

from ._commit import WAIT_LIMIT_S, Batch, GroupCommitter, raise_if_failed
from ._http import MalformedRequest, Request, read_request, write_reply
from ._state import JobState, apply, decide
from .config import ControllerConfig, JobConfig, MonitorConfig, ServeConfig
from .errors import BadRequestError, NotFoundError, PayloadTooLargeError, ServiceError, UnauthorizedError
from .store import SQLiteStore

__all__ = ["ShardingService"]

# The stdlib logger (not transformers'): the service process must start without importing transformers/torch.
logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024


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
        self.counts: Counter[str] = Counter()
        self.busy_s = 0.0  # time spent deciding and applying (the event loop's share of the state machine)
        self.wait_s = 0.0  # request mode: time requests waited for the lock
        self.commit_s = 0.0  # request mode: time in commits
        self.started = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock: asyncio.Lock | None = None  # request mode: decide -> commit -> apply, one request at a time
        self._plan: tuple[object, str] = (None, "")  # the plan last encoded, and its JSON
        self._gc = _GcClock()
        self._writer = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="antdt-commit")
                        if serve.commit_mode == "request" else None)
        self.committer = (GroupCommitter(self.store, self._commit_failed) if serve.commit_mode == "group" else None)
        # Bound now, like the stdlib server: the port is known (and connections queue) before serving starts.
        self._sock = socket.create_server((serve.host, serve.port), backlog=LISTEN_BACKLOG)

    @property
    def address(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    # ------------------------------------------------------------------------------------------- requests
    async def handle(self, req: dict) -> dict:
        """Run one request through decide -> commit -> apply and return its reply once it is durable. Raises
        `ServiceError` subclasses."""
        if self.committer is None:
            assert self._lock is not None and self._writer is not None
            t0 = time.perf_counter()
            async with self._lock:
                t1 = time.perf_counter()
                d = decide(self.state, req, time.time())
                if d.mutates:
                    await asyncio.get_running_loop().run_in_executor(self._writer, self.store.commit, d)
                t2 = time.perf_counter()
                apply(self.state, d)
                self.counts[str(req.get("op"))] += 1
                self.wait_s += t1 - t0
                self.commit_s += t2 - t1
                self.busy_s += time.perf_counter() - t2
            return d.reply
        t0 = time.perf_counter()
        d = decide(self.state, req, time.time())
        batch = self.committer.submit(d)
        apply(self.state, d)
        self.counts[str(req.get("op"))] += 1
        self.busy_s += time.perf_counter() - t0
        if batch is not None:
            await self._durable(batch)
        return d.reply

    async def _durable(self, batch: Batch) -> None:
        loop = asyncio.get_running_loop()
        if batch.future is None:  # one future per batch, resolved from the writer thread
            fut = batch.future = loop.create_future()

            def settle() -> None:
                if not fut.done():
                    fut.set_result(None)

            batch.on_done(lambda: loop.call_soon_threadsafe(settle))
        try:
            await asyncio.wait_for(asyncio.shield(batch.future), WAIT_LIMIT_S)
        except asyncio.TimeoutError:
            raise ServiceError(f"the state writer did not commit this request within {WAIT_LIMIT_S:.0f} s; it was "
                               "not applied. Retry it.") from None
        raise_if_failed(batch)

    def _commit_failed(self, error: BaseException) -> None:
        """Writer thread, after a failed group commit: reload the state on the loop, then accept requests again."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._reload)

    def _reload(self) -> None:
        assert self.committer is not None
        st = self.state
        try:
            self.state, _ = self.store.load_or_create(st.job, st.monitor_cfg, st.controller_cfg, st.job.lease_ttl_s,
                                                      time.time())
        except Exception as e:  # noqa: BLE001 - the file cannot be read back: keep refusing every request
            logger.error("antdt service: reloading the state after a failed commit failed: %r", e)
            return
        logger.warning("antdt service: state reloaded from %s after a failed commit", self.serve_cfg.db)
        self.committer.recovered()

    def stats(self) -> dict:
        up = time.time() - self.started
        out = {"requests": dict(self.counts), "uptime_s": up, "busy_s": self.busy_s, "cpu_s": time.process_time(),
               "request_rate": sum(self.counts.values()) / max(up, 1e-9), "commit_mode": self.serve_cfg.commit_mode}
        if self.committer is not None:
            out.update(self.committer.stats())
        else:
            out.update(commit_s=self.commit_s, lock_wait_s=self.wait_s)
        out["gc"] = self._gc.stats()
        return out

    # ------------------------------------------------------------------------------------------- HTTP
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    req = await read_request(reader)
                except MalformedRequest as e:
                    write_reply(writer, 400, self._encode(BadRequestError(f"{e}.").to_payload()), close=True)
                    await writer.drain()
                    return
                if req is None:
                    return
                status, payload, close = await self._dispatch(req, reader)
                close = close or not req.keep_alive
                write_reply(writer, status, self._encode(payload), close)
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            # Shutdown: end quietly (a cancelled connection task makes asyncio's stream callback log a traceback).
            return
        finally:
            writer.close()

    def _encode(self, payload: dict) -> bytes:
        """JSON of a reply. Every ack reply carries the plan, whose per-rank lists grow with the world size: its JSON
        is kept until the plan changes (plans are replaced, never modified in place, so identity tells)."""
        plan = payload.get("plan")
        if not isinstance(plan, dict):
            return json.dumps(payload).encode()
        if self._plan[0] is not plan:
            self._plan = (plan, json.dumps(plan))
        rest = json.dumps({k: v for k, v in payload.items() if k != "plan"})
        return (rest[:-1] + (", " if len(rest) > 2 else "") + '"plan": ' + self._plan[1] + "}").encode()

    def _authorise(self, req: Request) -> None:
        token = self.serve_cfg.token
        if token is None:
            return
        got = req.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise UnauthorizedError("missing or wrong token: send 'Authorization: Bearer <token>' with the "
                                    "service's shared token (ANTDT_TOKEN).")

    async def _dispatch(self, req: Request, reader: asyncio.StreamReader) -> tuple[int, dict, bool]:
        """(status, payload, close the connection)."""
        length = -1
        try:
            length = int(req.headers.get("content-length", "0" if req.method == "GET" else "-1"))
        except ValueError:
            pass
        body_unread = length != 0
        try:
            self._authorise(req)
            if req.method == "GET":
                if body_unread:
                    raise BadRequestError("a GET request must not have a body.")
                if req.path == "/v1/stats":
                    return 200, self.stats(), False
                if req.path == "/v1/status":
                    return 200, await self.handle({"op": "status"}), False
                raise NotFoundError(f"no route GET {req.path}; use POST /v1/<op> or GET /v1/status.")
            if req.method != "POST":
                raise BadRequestError(f"method {req.method} is not supported; use POST /v1/<op> or GET /v1/status.")
            if length < 0:
                raise BadRequestError("a Content-Length header is required.")
            limit = self.serve_cfg.max_request_bytes
            if length > limit:
                raise PayloadTooLargeError(f"request body of {length} bytes exceeds the limit of {limit}.")
            raw = await reader.readexactly(length)
            body_unread = False
            if not req.path.startswith("/v1/"):
                raise NotFoundError(f"no route POST {req.path}; use POST /v1/<op>.")
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequestError(f"body is not valid JSON: {e}.") from None
            if not isinstance(body, dict):
                raise BadRequestError("the request body must be a JSON object.")
            body["op"] = req.path[len("/v1/"):]
            return 200, await self.handle(body), False
        except ServiceError as e:
            return e.status, e.to_payload(), body_unread
        except (asyncio.IncompleteReadError, ConnectionError):
            raise
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not kill the connection
            logger.error("antdt service: internal error on %s: %r", req.path, e)
            return 500, {"error": "internal", "message": repr(e)}, body_unread

    # ------------------------------------------------------------------------------------------- lifecycle
    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closing = asyncio.Event()
        self._lock = asyncio.Lock()
        # limit: the longest request or header line; `backlog` must be passed again (asyncio listens anew).
        server = await asyncio.start_server(self._connection, sock=self._sock, backlog=LISTEN_BACKLOG,
                                            limit=self.serve_cfg.max_request_bytes + 4096)
        if self.serve_cfg.port_file:
            tmp = Path(self.serve_cfg.port_file + ".tmp")
            tmp.write_text(self.address)
            tmp.replace(self.serve_cfg.port_file)
        self._ready.set()
        gc.callbacks.append(self._gc)
        try:
            await self._closing.wait()
        finally:
            gc.callbacks.remove(self._gc)
            server.close()

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def start(self) -> ShardingService:
        self._thread = threading.Thread(target=self.serve_forever, name="antdt-service", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("the antdt service thread did not start serving within 30 s.")
        return self

    def stop(self) -> None:
        loop, closing = self._loop, self._closing
        if loop is not None and closing is not None and not loop.is_closed():
            loop.call_soon_threadsafe(closing.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()
        if self.committer is not None:
            self.committer.stop()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.store.close()


class _GcClock:
    """Pauses of the cyclic garbage collector while serving, per generation (``gc.callbacks``): a full collection
    walks every live object of the process, the whole shard table and reply cache included, and stops the loop."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            return
        g, dt = info["generation"], time.perf_counter() - self.t0
        self.count[g] += 1
        self.total_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)

    def stats(self) -> dict:
        return {"collections": list(self.count), "total_s": list(self.total_s), "max_s": list(self.max_s)}
