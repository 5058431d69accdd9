"""Client of the sharding service: one keep-alive HTTP connection per thread, typed errors, bounded retries.

Connection failures (the service restarting) are retried with jittered exponential backoff for at most
``retry_timeout_s``; refusals from a running service are raised at once as their typed `ServiceError`. Retrying is
safe because every mutating op is idempotent (absolute ack offsets, lease request ids)."""

from __future__ import annotations

import collections
import http.client
import json
import os
import random
import threading
import time
import uuid
from urllib.parse import urlparse

from .config import AgentConfig
from .errors import BadRequestError, ServiceError, ServiceUnavailableError, error_from_payload

__all__ = ["ShardingClient"]


class ShardingClient:
    """Talks to one service as one worker (``rank``, ``incarnation``).

    Example:

    ```python
    client = ShardingClient("http://127.0.0.1:8765", rank=0)
    job = client.register()["job"]
    reply = client.lease()  # {"status": "shard", "shard": {...}} | {"status": "wait"} | {"status": "end"}
    ```
    """

    def __init__(self, url: str | None = None, rank: int = 0, incarnation: int | None = None,
                 config: AgentConfig | None = None):
        self.config = config or AgentConfig(url=url)
        url = url or self.config.url
        if not url:
            raise ValueError("No service URL: pass url= or set AgentConfig.url / ANTDT_SERVICE_URL "
                             "(e.g. http://127.0.0.1:8765).")
        parsed = urlparse(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"service url {url!r} must look like http://host:port.")
        self.host, self.port = parsed.hostname, parsed.port
        self.url = f"http://{self.host}:{self.port}"
        self.rank = int(rank)
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if incarnation is None
                               else incarnation)
        self._local = threading.local()
        self.calls = 0
        self.call_s = 0.0
        self.latencies: collections.deque[float] = collections.deque(maxlen=100_000)
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------- transport
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.config.request_timeout_s)
            self._local.conn = conn
        return conn

    def _drop_conn(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def call(self, op: str, body: dict | None = None, worker: bool = True) -> dict:
        """POST ``/v1/<op>``; ``worker`` adds this client's rank and incarnation."""
        payload = dict(body or {})
        if worker:
            payload.setdefault("rank", self.rank)
            payload.setdefault("incarnation", self.incarnation)
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if self.config.token:
            headers["Authorization"] = f"Bearer {self.config.token}"
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.retry_timeout_s
        delay = 0.05
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = self._conn()
                conn.request("POST", f"/v1/{op}", body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                status = resp.status
            except (OSError, http.client.HTTPException) as e:
                self._drop_conn()
                if time.monotonic() + delay > deadline:
                    raise ServiceUnavailableError(
                        f"service {self.url} unreachable for {self.config.retry_timeout_s:.0f} s ({attempt} attempts, "
                        f"last error {e!r}) on op {op!r}. Check that `python -m antdt_callbacks serve` runs there."
                    ) from e
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
                continue
            try:
                reply = json.loads(raw)
            except json.JSONDecodeError:
                raise ServiceError(f"service answered HTTP {status} with a non-JSON body on op {op!r}.") from None
            with self._stats_lock:
                took = time.perf_counter() - t0
                self.calls += 1
                self.call_s += took
                self.latencies.append(took)
            if status != 200:
                raise error_from_payload(reply)
            return reply

    def close(self) -> None:
        self._drop_conn()

    # ------------------------------------------------------------------------------------------- ops
    def register(self, pid: int | None = None, max_micro_batch: int | None = None, node: str | None = None) -> dict:
        body = {"pid": os.getpid() if pid is None else pid}
        if max_micro_batch is not None:
            body["max_micro_batch"] = int(max_micro_batch)
        if node is not None:
            body["node"] = str(node)
        return self.call("register", body)

    def reform(self, world_size: int, nodes: list[str], checkpoint_id: int) -> dict:
        """Rank 0 of a new rendezvous round: start the job's next generation with these members (the node of every
        rank) from the snapshot of ``checkpoint_id``. Returns ``{"generation", "plan", ...}``; adopt the generation
        as this client's incarnation (every rank registers with it)."""
        return self.call("reform", {"rank": 0, "world_size": int(world_size), "nodes": [str(n) for n in nodes],
                                    "checkpoint_id": int(checkpoint_id)}, worker=False)

    def evict(self, node: str, reason: str = "evicted by request") -> dict:
        """Evict ``node`` (an operator's request; the Controller evicts on its own under the ND policy)."""
        return self.call("evict", {"node": str(node), "reason": str(reason)}, worker=False)

    def lease(self, min_samples: int = 1, max_shards: int = 1) -> dict:
        """Lease shards until ``min_samples`` unconsumed samples are held (at most ``max_shards`` shards)."""
        return self.call("lease", self.lease_body(min_samples, max_shards))

    @staticmethod
    def lease_body(min_samples: int = 1, max_shards: int = 1) -> dict:
        return {"request_id": uuid.uuid4().hex, "min_samples": int(max(1, min_samples)),
                "max_shards": int(min(64, max(1, max_shards)))}

    def ack(self, items: list[dict], metrics: dict | None = None, lease: dict | None = None) -> dict:
        """Acknowledge consumed positions (absolute offsets), report metrics, and optionally lease in the same round
        trip (``lease`` = `lease_body`; the reply then has a ``"lease"`` entry shaped like `lease`'s reply). An
        accepted ack also renews every other lease this worker holds."""
        body: dict = {"items": items}
        if metrics is not None:
            body["metrics"] = metrics
        if lease is not None:
            body["lease"] = lease
        return self.call("ack", body)

    def renew(self, items: list[dict]) -> dict:
        return self.call("renew", {"items": items})

    def release(self, items: list[dict]) -> dict:
        return self.call("release", {"items": items})

    def commit(self, checkpoint_id: int, leaving: bool = False) -> dict:
        """Snapshot the acked progress under ``checkpoint_id``. ``leaving``: the ranks exit after this checkpoint
        (restart, eviction, SIGTERM); the service times the re-formation from here."""
        if checkpoint_id < 1:
            raise BadRequestError(f"checkpoint_id={checkpoint_id}: snapshot 0 is the job's start; use >= 1.")
        body: dict = {"checkpoint_id": int(checkpoint_id)}
        if leaving:
            body["leaving"] = True
        return self.call("commit", body)

    def restore(self, checkpoint_id: int) -> dict:
        return self.call("restore", {"checkpoint_id": int(checkpoint_id)})

    def plan(self) -> dict:
        return self.call("plan", worker=False)

    def status(self) -> dict:
        return self.call("status", worker=False)

    def metrics(self) -> dict:
        return self.call("metrics", worker=False)
