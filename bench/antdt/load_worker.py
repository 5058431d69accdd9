"""Simulated workers of the shard-service load generator: an asyncio HTTP client and the worker loop, run by the
hundreds in one process (`run_process`), plus the exactly-once audit of what they consumed against the state file.

One simulated worker is one rank of a data-parallel job, doing what `antdt_callbacks`' Agent and dataset do on the
wire, at the job's pace:

- ``register`` once at start;
- every step: take ``batch`` samples from its leased shards, "compute" until the step's end, then one ``ack`` with
  the step's absolute offsets and metrics; when fewer than ``prefetch_batches`` batches (plus one of slack) are held,
  the ack carries a piggybacked ``lease`` for one batch more (the Agent's refill), at most ``prefetch_shards`` shards;
- a heartbeat ``renew`` every third of the lease TTL, sent only when no ack was accepted since the last beat (an
  accepted ack renews every lease of the worker), so it fires during stalls: with probability ``stall_prob`` per
  step a worker stalls for ``stall_s`` (evaluation, checkpoint, a GC pause);
- a plain ``lease`` when it holds nothing (start, or after a fence), polling while the service says ``wait``.

Pace: ``async`` gives each worker its own phase and +-``jitter`` per step (asynchronous / parameter-server
training, or ranks of several jobs): requests arrive spread over the step. ``lockstep`` aligns every step to one
clock (synchronous data parallelism) and spreads the acks only over the Agent's send beat (``ack_spread_s``): each
step sends a burst of ``workers`` requests.

The client retries refused connections, resets and timeouts (a service that is restarting) with jittered backoff for
``retry_timeout_s``, like `antdt_callbacks.ShardingClient`; retrying is safe because every op is idempotent. Every
wait is bounded: one attempt by ``request_timeout_s``, the retries by ``retry_timeout_s``, the run by its deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import random
import socket
import sqlite3
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from antdt_callbacks._state import shard_sample_ids
from antdt_callbacks.config import JobConfig
from antdt_callbacks.errors import FencedError, ServiceError, ServiceUnavailableError, error_from_payload

OPS = ("register", "lease", "ack", "renew", "release")


@dataclass
class ProcessSpec:
    """What one load process runs: its ranks, the service address, the pace and the shared start clock."""

    host: str
    port: int
    ranks: list[int]
    t0: float  # wall clock (time.time()) of step 0, shared by every process
    stop_at: float  # wall clock after which no new step starts
    deadline: float  # wall clock at which the process gives up (every worker is cancelled)
    out: str  # pickle file of the results
    step_s: float = 1.0
    pace: str = "async"
    jitter: float = 0.1
    ack_spread_s: float = 0.05
    batch: int = 8
    prefetch_batches: int = 2
    prefetch_shards: int = 8
    lease_ttl_s: float = 10.0
    stall_prob: float = 0.01
    stall_s: float = 4.0
    wait_poll_s: float = 0.2
    until_end: bool = False
    request_timeout_s: float = 10.0
    retry_timeout_s: float = 60.0
    seed: int = 0
    token: str | None = None


@dataclass
class Recorder:
    """Per-process measurements: one row per request (wall-clock start, latency, op, outcome) and the accepted acks."""

    rows: list[tuple[float, float, int, int]] = field(default_factory=list)  # (t_start, latency_s, op, ok)
    acked: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)  # (epoch, sid, start, end, lo, hi)
    errors: Counter = field(default_factory=Counter)  # "<op>:<error code>" -> refusals and unreachable requests
    failed: Counter = field(default_factory=Counter)  # workers that stopped on an exception, by type
    retries: int = 0
    fenced_leases: int = 0
    finished: int = 0
    last_reply: float = 0.0


class AsyncServiceClient:
    """One worker's keep-alive connection: ``POST /v1/<op>`` with a JSON body, typed errors, bounded retries."""

    def __init__(self, host: str, port: int, rank: int, rec: Recorder, request_timeout_s: float,
                 retry_timeout_s: float, token: str | None = None):
        self.host, self.port, self.rank, self.rec = host, port, rank, rec
        self.request_timeout_s, self.retry_timeout_s = request_timeout_s, retry_timeout_s
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()  # the step loop and the heartbeat share the connection

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def _roundtrip(self, op: str, data: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self._writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._reader is not None
        head = (f"POST /v1/{op} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{self.auth}"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        self._writer.write(head + data)
        line = await self._reader.readline()
        parts = line.split(None, 2)
        if len(parts) < 2:
            raise ConnectionResetError(f"bad status line {line[:60]!r}")
        status, length, close = int(parts[1]), -1, False
        while True:
            h = await self._reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        if length < 0:
            raise ConnectionResetError("reply without Content-Length")
        body = await self._reader.readexactly(length)
        if close:
            self.close()
        return status, body

    async def call(self, op: str, body: dict) -> dict:
        """One request as this worker; connection failures are retried, refusals raised as `ServiceError`s."""
        data = json.dumps({"rank": self.rank, "incarnation": 0, **body}).encode()
        t_wall, t0 = time.time(), time.perf_counter()
        ok = 0
        try:
            async with self._lock:
                loop = asyncio.get_running_loop()
                give_up = loop.time() + self.retry_timeout_s
                delay = 0.05
                while True:
                    try:
                        status, raw = await asyncio.wait_for(self._roundtrip(op, data), self.request_timeout_s)
                        break
                    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
                        self.close()
                        self.rec.retries += 1
                        if loop.time() + delay > give_up:
                            self.rec.errors[f"{op}:unavailable"] += 1
                            raise ServiceUnavailableError(f"{op}: service unreachable for {self.retry_timeout_s} s "
                                                          f"(last error {e!r})") from e
                        await asyncio.sleep(delay * (0.5 + random.random()))
                        delay = min(delay * 2, 1.0)
            reply = json.loads(raw)
            if status != 200:
                err = error_from_payload(reply)
                self.rec.errors[f"{op}:{err.code}"] += 1
                raise err
            ok = 1
            self.rec.last_reply = time.time()
            return reply
        finally:
            self.rec.rows.append((t_wall, time.perf_counter() - t0, OPS.index(op), ok))


@dataclass
class _Lease:
    epoch: int
    shard_id: int
    token: int
    start: int
    end: int
    acked: int  # offset the service has accepted
    taken: int  # offset consumed locally (>= acked)

    def item(self, offset: int | None = None) -> dict:
        return {"epoch": self.epoch, "shard_id": self.shard_id, "token": self.token,
                "offset": self.taken if offset is None else offset}


class SimWorker:
    """One simulated rank (see the module docstring for what it sends and when)."""

    def __init__(self, spec: ProcessSpec, rank: int, rec: Recorder):
        self.spec, self.rank, self.rec = spec, rank, rec
        self.client = AsyncServiceClient(spec.host, spec.port, rank, rec, spec.request_timeout_s,
                                         spec.retry_timeout_s, spec.token)
        self.leases: list[_Lease] = []
        self.status = "open"
        self.last_ack = time.monotonic()
        self.rng = random.Random(spec.seed * 1_000_003 + rank)
        self.phase = 0.0 if spec.pace == "lockstep" else self.rng.random() * spec.step_s

    # ------------------------------------------------------------------------------------------- leases
    def _avail(self) -> int:
        return sum(le.end - le.start - le.taken for le in self.leases)

    def _lease_body(self, force: bool = False) -> dict | None:
        """The refill request when fewer than ``prefetch_batches`` batches plus one of slack are held (``force``:
        always), asking for one batch more than the threshold so a rank leases about every other step."""
        b, avail = self.spec.batch, self._avail()
        need = self.spec.prefetch_batches * b
        ahead = sum(1 for le in self.leases if le.end - le.start > le.taken)
        if not force and (self.status == "end" or avail >= need + b
                          or (ahead >= self.spec.prefetch_shards and avail >= b)):
            return None
        return {"request_id": uuid.uuid4().hex, "min_samples": max(1, need + b - avail),
                "max_shards": max(1, self.spec.prefetch_shards - ahead)}

    def _take_reply(self, reply: dict) -> None:
        if reply["status"] == "shard":
            for s in reply["shards"]:
                self.leases.append(_Lease(s["epoch"], s["shard_id"], s["token"], s["start"], s["end"], s["offset"],
                                          s["offset"]))
            self.status = "open"
        else:
            self.status = reply["status"]  # "wait" (others still hold leases) or "end"

    def _take(self, n: int) -> list[_Lease]:
        """Consume up to ``n`` samples locally; return the leases touched (their ``taken`` moved)."""
        touched = []
        for le in self.leases:
            if n <= 0:
                break
            k = min(n, le.end - le.start - le.taken)
            if k > 0:
                le.taken += k
                n -= k
                touched.append(le)
        return touched

    def _accepted(self, touched: list[_Lease]) -> None:
        for le in touched:
            if le.taken > le.acked:
                self.rec.acked.append((le.epoch, le.shard_id, le.start, le.end, le.acked, le.taken))
                le.acked = le.taken
        self.leases = [le for le in self.leases if le.acked < le.end - le.start]
        self.last_ack = time.monotonic()

    async def _drop_fenced(self) -> None:
        """An ack was fenced: ask which leases are gone (renew says), drop them, keep consuming the rest. What was
        consumed from a fenced lease after its last accepted ack is not recorded (the service re-leases it)."""
        reply = await self.client.call("renew", {"items": [le.item(le.acked) for le in self.leases]})
        gone = {(e, s, t) for e, s, t in reply["fenced"]}
        self.rec.fenced_leases += len(gone)
        self.leases = [le for le in self.leases if (le.epoch, le.shard_id, le.token) not in gone]
        for le in self.leases:
            le.taken = le.acked  # the refused ack changed nothing: resend these positions with the next step

    # ------------------------------------------------------------------------------------------- loops
    async def heartbeat(self) -> None:
        period = self.spec.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period)
            if time.monotonic() - self.last_ack < period or not self.leases:
                continue
            try:
                reply = await self.client.call("renew", {"items": [le.item(le.acked) for le in self.leases]})
            except ServiceError as e:
                self.rec.errors[f"renew:{type(e).__name__}"] += 1
                continue
            if reply["fenced"]:
                gone = {(e, s, t) for e, s, t in reply["fenced"]}
                self.rec.fenced_leases += len(gone)
                self.leases = [le for le in self.leases if (le.epoch, le.shard_id, le.token) not in gone]

    async def _sleep_until(self, wall: float) -> None:
        dt = wall - time.time()
        if dt > 0:
            await asyncio.sleep(dt)

    async def run(self) -> None:
        spec = self.spec
        await self._sleep_until(spec.t0 - spec.step_s + self.rng.random() * min(1.0, spec.step_s))
        await self.client.call("register", {"pid": os.getpid()})
        hb = asyncio.ensure_future(self.heartbeat())
        try:
            await self._steps()
            self.rec.finished += 1
        finally:
            hb.cancel()
            self.client.close()

    async def _steps(self) -> None:
        spec = self.spec
        step, t_next = 0, spec.t0 + self.phase
        while time.time() < spec.stop_at or spec.until_end:
            if not self._avail():
                if self.status == "end":
                    return
                self._take_reply(await self.client.call("lease", self._lease_body(force=True)))
                if not self._avail():
                    if self.status == "end":
                        return
                    await asyncio.sleep(spec.wait_poll_s)  # "wait": leases held by others may still come back
                    continue
            await self._sleep_until(t_next)
            start, before = time.time(), self._avail()
            touched = self._take(spec.batch)
            samples = before - self._avail()
            if spec.pace == "lockstep":
                t_next = spec.t0 + (step + 1) * spec.step_s
                send_at = t_next + self.rng.random() * spec.ack_spread_s
            else:
                t_next = start + spec.step_s * (1 + spec.jitter * (2 * self.rng.random() - 1))
                send_at = t_next
            if self.rng.random() < spec.stall_prob:
                send_at += spec.stall_s
                t_next += spec.stall_s
            await self._sleep_until(send_at)
            step += 1
            body: dict = {"items": [le.item() for le in touched],
                          "metrics": {"step": step, "samples": samples, "compute_s": max(1e-3, send_at - start)}}
            lease = self._lease_body()
            if lease is not None:
                body["lease"] = lease
            try:
                reply = await self.client.call("ack", body)
            except FencedError:
                await self._drop_fenced()
                continue
            self._accepted(touched)
            if lease is not None:
                self._take_reply(reply["lease"])


async def _run_workers(spec: ProcessSpec, rec: Recorder) -> None:
    workers = [SimWorker(spec, r, rec) for r in spec.ranks]
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    done, pending = await asyncio.wait(tasks, timeout=max(1.0, spec.deadline - time.time()))
    for t in pending:
        t.cancel()
    if pending:
        rec.failed["deadline"] += len(pending)
    for t in done:
        exc = t.exception()
        if exc is not None:
            rec.failed[type(exc).__name__] += 1
    if pending:
        await asyncio.wait(pending, timeout=5)


def run_process(spec: ProcessSpec) -> None:
    """Entry point of one load process (spawned): run its workers, pickle the `Recorder` to ``spec.out``."""
    random.seed(spec.seed)
    rec = Recorder()
    asyncio.run(_run_workers(spec, rec))
    tmp = Path(spec.out + ".tmp")
    tmp.write_bytes(pickle.dumps(rec))
    tmp.replace(spec.out)


# ------------------------------------------------------------------------------------------------- audit
def audit(db: str, job: JobConfig, acked: list[tuple[int, int, int, int, int, int]]) -> dict:
    """Compare what clients were told was accepted with the committed state file (by sample id).

    - ``duplicated``: sample ids whose acks were accepted more than once (by any workers) in one epoch;
    - ``lost``: sample ids an accepted ack covered that the committed state does not count as acked;
    - ``phantom``: sample ids the committed state counts as acked that no accepted ack covered;
    - ``done_shards`` / ``shards``: shards of the committed table that are DONE, of all.
    """
    n = job.dataset_size
    client: dict[int, np.ndarray] = {}
    for e, sid, start, end, lo, hi in acked:
        ids = shard_sample_ids(job, e, sid, start, end)[lo:hi]
        np.add.at(client.setdefault(e, np.zeros(n, np.int32)), ids, 1)
    state: dict[int, np.ndarray] = {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute('SELECT epoch, shard_id, start, "end", state, acked FROM shards').fetchall()
    finally:
        conn.close()
    done = 0
    for e, sid, start, end, st, a in rows:
        done += st == "DONE"
        ids = shard_sample_ids(job, e, sid, start, end)[:a]
        state.setdefault(e, np.zeros(n, np.int32))[ids] += 1
    lost = phantom = dup = 0
    for e in set(client) | set(state):
        c, s = client.get(e, np.zeros(n, np.int32)), state.get(e, np.zeros(n, np.int32))
        dup += int(np.count_nonzero(c > 1))
        lost += int(np.count_nonzero((c > 0) & (s == 0)))
        phantom += int(np.count_nonzero((s > 0) & (c == 0)))
    return {"duplicated": dup, "lost": lost, "phantom": phantom, "acked_by_clients": int(sum(int((c > 0).sum())
            for c in client.values())), "acked_in_state": int(sum(int(s.sum()) for s in state.values())),
            "done_shards": done, "shards": len(rows)}
