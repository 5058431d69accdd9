"""`ServiceIterableDataset`: an iterable over batches cut from shards leased from the sharding service.

Design points (each one avoids a trap of Trainer/Accelerate dataloading):

- **Batches, not samples.** The iterable yields whole per-rank batches of the *current* planned size, so a new batch
  size applies from the next fetch, in the middle of a shard if need be. Use it with ``DataLoader(batch_size=None,
  num_workers=0)`` and never through ``accelerator.prepare`` (which would re-shard it and silently drop samples).
- **Prefetch in a thread, not in DataLoader workers.** A background thread keeps ``prefetch_shards`` leases ahead
  and a heartbeat thread renews them; both are safe with ``num_workers=0`` (worker processes cannot share leases).
- **Stop together.** Under DDP every rank all-reduces ``[samples, at_end, restart]`` before each batch: the sum of
  samples is the step's global batch (gradient weights ``b_i / sum b``), ranks out of data contribute a zero-weight
  dummy sample, and all ranks see the same "no data left anywhere" at the same step. A one-batch lookahead marks the
  last batch, so the Agent stops Trainer there instead of letting it spin through ``max_steps``. The lookahead's
  all-reduce is started asynchronously and finished at the step's end (`settle`), so it overlaps the step's compute
  instead of adding a second barrier per step (under CPU oversubscription each collective costs milliseconds).
- **Ack after the step.** Positions taken for a batch are acknowledged by the Agent at ``on_step_end`` (from
  `BatchMeta.ack_items`), never at fetch time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, default_collate

from ._state import shard_sample_ids
from .client import ShardingClient
from .config import AgentConfig, JobConfig
from .controller import Plan
from .errors import AntDTError

__all__ = ["BatchMeta", "ServiceIterableDataset"]


@dataclass
class BatchMeta:
    """What the Agent and the Trainer mixin need to know about one yielded batch."""

    sample_ids: np.ndarray
    ack_items: list[dict]
    global_samples: int
    micro_sizes: list[int]
    last: bool = False
    restart: bool = False
    compute_s: float = 0.0
    sync_wait_s: float = 0.0
    fetch_s: float = 0.0
    wait_s: float = 0.0
    collective_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def local_samples(self) -> int:
        return int(len(self.sample_ids))

    @property
    def weight(self) -> float:
        """This rank's share of the step's gradient: ``b_i / sum_j b_j`` (0 for a dummy batch)."""
        return self.local_samples / self.global_samples if self.global_samples else 0.0


@dataclass
class _Lease:
    epoch: int
    shard_id: int
    token: int
    offset: int  # acked offset when leased: ids[0] is position `offset` of the shard
    size: int
    ids: np.ndarray
    taken: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.shard_id)

    @property
    def left(self) -> int:
        return len(self.ids) - self.taken


@dataclass
class _Pending:
    """A batch cut from the leases whose stop-together all-reduce may still be in flight."""

    ids: np.ndarray
    items: list[dict]
    at_end: bool
    restart: bool
    tensor: torch.Tensor | None = None
    work: Any = None
    wait_s: float = 0.0
    fetch_s: float = 0.0
    done: bool = False
    result: tuple[Any, BatchMeta] | None = None


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _control_device() -> torch.device:
    """Where the stop-together counts travel: the CPU when the default group's backend has a CPU transport (gloo, or
    ``cpu:gloo,cuda:nccl``), else the current CUDA device (NCCL alone, as `transformers.Trainer` sets it up on GPUs)."""
    config = str(dist.get_backend_config())
    if "cpu:" in config or ":" not in config:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class ServiceIterableDataset(IterableDataset):
    """Yields per-rank batches of ``dataset`` samples whose ids come from the sharding service.

    Args:
        dataset (`Sequence`): map-style dataset indexed by sample id (``dataset[i]``).
        config (`AgentConfig`, *optional*): service URL, token, prefetch depth, timeouts.
        rank (`int`, *optional*): defaults to the process group rank, else ``$RANK``, else 0.
        world_size (`int`, *optional*): defaults likewise.
        collate_fn (`Callable`, *optional*, defaults to `torch.utils.data.default_collate`): list of samples -> batch.
        sync (`bool`, *optional*): stop-together all-reduce per batch; defaults to "a process group of > 1 rank
            exists". ``False`` gives independent consumers (evaluation, async training).

    Example:

    ```python
    ds = ServiceIterableDataset(my_dataset, AgentConfig(url="http://127.0.0.1:8765"))
    for batch in ds:  # a dict of tensors plus batch["antdt_meta"]
        ...
        ds.ack(batch["antdt_meta"])
    ```
    """

    def __init__(self, dataset: Any, config: AgentConfig | None = None, rank: int | None = None,
                 world_size: int | None = None, collate_fn: Callable[[list], Any] | None = None,
                 sync: bool | None = None, client: ShardingClient | None = None):
        self.dataset = dataset
        self.config = config or AgentConfig()
        if rank is None:
            rank = dist.get_rank() if _dist_ready() else int(os.environ.get("RANK", 0))
        if world_size is None:
            world_size = dist.get_world_size() if _dist_ready() else int(os.environ.get("WORLD_SIZE", 1))
        self.rank, self.world_size = int(rank), int(world_size)
        self.collate_fn = collate_fn or default_collate
        self._sync = sync
        self.client = client or ShardingClient(self.config.url, rank=self.rank, config=self.config)
        self.job: JobConfig | None = None
        self.batch_size = 0
        self.micro_cap: int | None = self.config.max_micro_batch
        self.restart_requested = False
        self.preempted = False  # set by the Agent's SIGTERM handler; unlike a plan's request, no plan clears it
        self.node: str | None = None  # this worker's node (set by the Agent; sent with register)
        self.plan_version = -1
        self.current_meta: BatchMeta | None = None
        self.wait_s = 0.0
        self.collective_s = 0.0
        self._cond = threading.Condition()
        self._leases: list[_Lease] = []
        self._open: dict[tuple[int, int], _Lease] = {}
        self._status = "open"
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lease_inflight = False
        self._last_renew = 0.0

    # ------------------------------------------------------------------------------------------- service
    def connect(self) -> dict:
        """Register this worker; returns the register reply (job, plan)."""
        reply = self.client.register(max_micro_batch=self.config.max_micro_batch, node=self.node)
        job = JobConfig.from_dict(reply["job"])
        planned = len(reply["plan"]["batch_sizes"])
        if planned != self.world_size:
            hint = (f"Start the service with --world-size {self.world_size}." if job.world_size < self.world_size
                    else "Rank 0 re-forms the job for an elastic round (AntDTAgent does it at on_train_begin).")
            raise AntDTError(f"the service plans for {planned} ranks (job world_size={job.world_size}) but this run "
                             f"has {self.world_size} ranks. {hint}")
        if len(self.dataset) < job.dataset_size:
            raise AntDTError(f"the service serves {job.dataset_size} sample ids but the dataset has only "
                             f"{len(self.dataset)} samples. Start the service with --dataset-size {len(self.dataset)}.")
        self.job = job
        self.apply_plan(Plan.from_dict(reply["plan"]), force=True)
        return reply

    def apply_plan(self, plan: Plan, force: bool = False) -> bool:
        """Adopt a Controller plan (from the next fetch on). Returns whether it was new."""
        if not force and plan.version <= self.plan_version:
            return False
        self.plan_version = plan.version
        self.batch_size = int(plan.batch_sizes[self.rank])
        cap = plan.micro_batch[self.rank]
        self.micro_cap = cap if cap is not None else self.config.max_micro_batch
        # Any action (a rank's kill-and-restart, a node's eviction) makes every rank checkpoint at the same step:
        # the flag is all-reduced with the next batch.
        self.restart_requested = bool(plan.actions)
        return True

    @property
    def sync(self) -> bool:
        return _dist_ready() if self._sync is None else bool(self._sync)

    # ------------------------------------------------------------------------------------------- threads
    def _start(self) -> None:
        if self._threads:
            return
        if self.job is None:
            self.connect()
        self._stop.clear()
        hb = self.config.heartbeat_s or max(0.05, self.job.lease_ttl_s / 3)
        self._threads = [threading.Thread(target=self._prefetch_loop, name=f"antdt-prefetch-{self.rank}",
                                          daemon=True),
                         threading.Thread(target=self._heartbeat_loop, args=(hb,), name=f"antdt-heartbeat-{self.rank}",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _lease_demand(self, slack: int) -> dict | None:
        """A lease request body when this rank holds fewer than ``prefetch_batches`` of its current batches plus
        ``slack`` samples, else None. Call with ``self._cond`` held; marks a lease in flight (one at a time).

        Lease ahead by *samples*, at most `prefetch_shards` shards: a slow rank with a small batch must not hoard
        data, or the fast ranks run dry at the end of the data while it drains its hoard alone. A refill asks for
        one batch more than the threshold, so a rank leases about every other step, not every step."""
        if self._lease_inflight or self._status == "end":
            return None
        b = max(1, self.batch_size)
        ahead = sum(1 for lease in self._leases if lease.left > 0)
        avail = sum(lease.left for lease in self._leases)
        need = self.config.prefetch_batches * b
        if avail >= need + slack or (ahead >= self.config.prefetch_shards and avail >= b):
            return None
        self._lease_inflight = True
        return ShardingClient.lease_body(need + b - avail, max(1, self.config.prefetch_shards - ahead))

    def lease_request(self) -> dict | None:
        """Lease body to piggyback on the next ack (the Agent's sender thread), if the buffer will need a refill
        within a batch; the prefetch thread then has nothing to do. Pair with `accept_lease`."""
        with self._cond:
            return self._lease_demand(slack=max(1, self.batch_size))

    def accept_lease(self, reply: dict | None) -> None:
        """Take the shards of a lease reply (or, with ``None``, give up the in-flight mark after a failure)."""
        with self._cond:
            self._lease_inflight = False
            if reply is not None:
                self._take_reply(reply)
            self._cond.notify_all()

    def _take_reply(self, reply: dict) -> None:
        assert self.job is not None
        if reply["status"] == "shard":
            for s in reply.get("shards") or [reply["shard"]]:
                ids = shard_sample_ids(self.job, s["epoch"], s["shard_id"], s["start"], s["end"])
                lease = _Lease(s["epoch"], s["shard_id"], s["token"], s["offset"], s["end"] - s["start"],
                               ids[s["offset"]:])
                self._leases.append(lease)
                self._open[lease.key] = lease
            self._status = "open"
        elif reply["status"] == "wait" and (self.sync or not reply.get("others")):
            # Drained: the leases left are this rank's own (or, in synchronous training, are already cut into some
            # rank's pending batch): nothing more will come, so this rank is at its end.
            self._status = "end"
        else:
            self._status = reply["status"]

    def _prefetch_loop(self) -> None:
        assert self.job is not None
        try:
            while not self._stop.is_set():
                with self._cond:
                    body = self._lease_demand(slack=0)
                    if body is None:
                        self._cond.wait(timeout=0.2)
                        continue
                try:
                    reply = self.client.call("lease", body)
                except BaseException:
                    self.accept_lease(None)
                    raise
                self.accept_lease(reply)
                if reply["status"] == "wait":
                    self._stop.wait(self.config.wait_poll_s)
        except BaseException as e:  # noqa: BLE001 - surfaced in the consuming thread
            self._fail(e)

    def _heartbeat_loop(self, period: float) -> None:
        try:
            while not self._stop.wait(period):
                if time.monotonic() - self._last_renew < period:
                    continue  # an accepted ack renewed every lease of this worker since the last beat
                with self._cond:
                    items = [{"epoch": lease.epoch, "shard_id": lease.shard_id, "token": lease.token}
                             for lease in self._open.values()]
                if not items:
                    continue
                reply = self.client.renew(items)
                if reply["fenced"]:
                    from .errors import FencedError

                    raise FencedError(f"rank {self.rank}: leases {reply['fenced']} were fenced off (expired while "
                                      "this process was stalled, or revoked by a restore).")
        except BaseException as e:  # noqa: BLE001 - surfaced in the consuming thread
            self._fail(e)

    def close(self, release: bool = True) -> None:
        """Stop the threads; with ``release`` give unacked leases back (their tails return to TODO)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.config.request_timeout_s + 5)
        self._threads = []
        with self._cond:
            items = [{"epoch": lease.epoch, "shard_id": lease.shard_id, "token": lease.token}
                     for lease in self._open.values()]
            self._open.clear()
            self._leases.clear()
            self._status = "open"
        if release and items and self._error is None:
            self.client.release(items)

    def mark_acked(self, items: list[dict]) -> None:
        """Forget leases that an accepted ack finished (no more heartbeats for them). The accepted ack renewed
        the others, so the heartbeat can skip a beat."""
        self._last_renew = time.monotonic()
        with self._cond:
            for it in items:
                lease = self._open.get((it["epoch"], it["shard_id"]))
                if lease is not None and it["offset"] >= lease.size:
                    del self._open[lease.key]

    # ------------------------------------------------------------------------------------------- batches
    def _take(self, n: int) -> tuple[np.ndarray, list[dict], bool]:
        """Take up to ``n`` sample ids; returns (ids, ack items, at_end). Blocks only while more is coming."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.stop_timeout_s
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                avail = sum(lease.left for lease in self._leases)
                if avail >= n or self._status == "end":
                    break
                if not self.sync and self._status == "wait" and avail > 0:
                    # Independent consumers at the end of the data: every peer may likewise hold a tail shorter
                    # than its batch while the service says WAIT because of the others' leases. Waiting for a
                    # full batch would deadlock them all; a short last batch drains the tail instead.
                    break
                if time.monotonic() > deadline:
                    raise AntDTError(f"rank {self.rank}: no data from the service for {self.config.stop_timeout_s} s "
                                     f"(status {self._status!r}).")
                self._cond.wait(timeout=0.1)
            ids, items = [], []
            while n > 0 and self._leases:
                lease = self._leases[0]
                k = min(n, lease.left)
                if k > 0:
                    ids.append(lease.ids[lease.taken:lease.taken + k])
                    lease.taken += k
                    n -= k
                    items.append({"epoch": lease.epoch, "shard_id": lease.shard_id, "token": lease.token,
                                  "offset": lease.offset + lease.taken})
                if lease.left == 0:
                    self._leases.pop(0)
            at_end = self._status == "end" and not any(lease.left for lease in self._leases)
            self._cond.notify_all()
        self.wait_s += time.perf_counter() - t0
        return (np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)), items, at_end

    def _collate(self, ids: np.ndarray) -> Any:
        return self.collate_fn([self.dataset[int(i)] for i in ids])

    def _cut(self) -> _Pending:
        """Take this rank's next batch of ids and *start* the stop-together all-reduce of ``[samples, at_end,
        restart]`` (asynchronously: for the lookahead batch it completes while the current step computes, instead
        of adding a blocking collective, i.e. one more barrier, to every step)."""
        t0 = time.perf_counter()
        wait0 = self.wait_s
        ids, items, at_end = self._take(self.batch_size)
        p = _Pending(ids, items, at_end, self.restart_requested or self.preempted)
        if self.sync:
            p.tensor = torch.tensor([len(ids), int(at_end), int(p.restart)], dtype=torch.int64,
                                    device=_control_device())
            p.work = dist.all_reduce(p.tensor, async_op=True)
        p.wait_s = self.wait_s - wait0
        p.fetch_s = time.perf_counter() - t0
        return p

    def _resolve(self, p: _Pending) -> tuple[Any, BatchMeta] | None:
        """Finish a cut batch: wait for its all-reduce, then build it (None when no rank has data left). While no
        rank has data but leases are still held elsewhere (a stalled peer), poll together with fresh cuts."""
        if p.done:
            return p.result
        t_start = time.perf_counter()
        deadline = time.monotonic() + self.config.stop_timeout_s
        first = p
        wait_s = coll_s = 0.0
        while True:
            if p is not first:
                wait_s += p.wait_s
            if p.work is not None:
                t0 = time.perf_counter()
                p.work.wait()
                coll_s += time.perf_counter() - t0
                total, ends, restarts = (int(x) for x in p.tensor.tolist())
                world = dist.get_world_size()
            else:
                total, ends, restarts, world = len(p.ids), int(p.at_end), int(p.restart), 1
            if total > 0:
                break
            if ends == world:
                first.done, first.result = True, None
                self.collective_s += coll_s
                return None
            # Nothing anywhere right now but not finished (leases held by a stalled peer): poll together.
            if time.monotonic() > deadline:
                raise AntDTError(f"rank {self.rank}: all ranks had no data for {self.config.stop_timeout_s} s while "
                                 "the service still had leased shards (a stalled worker?).")
            time.sleep(self.config.wait_poll_s)
            p = self._cut()
        self.collective_s += coll_s
        ids = p.ids
        meta = BatchMeta(sample_ids=ids, ack_items=p.items, global_samples=total, micro_sizes=[],
                         restart=restarts > 0)
        # A rank without data still runs forward/backward (DDP needs every rank) on one dummy sample, weight 0.
        use = ids if len(ids) else np.zeros(1, dtype=np.int64)
        cap = self.micro_cap or len(use)
        chunks = [use[i:i + cap] for i in range(0, len(use), cap)]
        meta.micro_sizes = [len(c) if len(ids) else 0 for c in chunks]
        if len(chunks) == 1:
            batch = self._collate(chunks[0])
        else:
            batch = {"antdt_micro": [self._collate(c) for c in chunks]}
        if not isinstance(batch, dict):
            raise TypeError(f"collate_fn must return a dict (Trainer inputs), got {type(batch).__name__}.")
        batch["antdt_meta"] = meta
        # Where the data path's time goes (bench/antdt's breakdown): blocked on leases, waiting for the
        # stop-together all-reduce, and the whole cut + resolve (the rest is cutting and collating).
        meta.wait_s = first.wait_s + wait_s
        meta.collective_s = coll_s
        meta.fetch_s = first.fetch_s + time.perf_counter() - t_start
        first.done, first.result = True, (batch, meta)
        return batch, meta

    def _next_batch(self) -> tuple[Any, BatchMeta] | None:
        return self._resolve(self._cut())

    def settle(self, meta: BatchMeta) -> BatchMeta:
        """Resolve the lookahead behind ``meta`` (its all-reduce is normally done by now) so that ``meta.last``
        says whether this was the last batch on every rank. The Agent calls it at ``on_step_end``."""
        p = meta.extra.pop("antdt_next", None)
        if p is not None:
            meta.last = self._resolve(p) is None
        return meta

    def __iter__(self) -> Iterator[Any]:
        self._start()
        if not self.sync and self.world_size > 1:
            # Independent consumers: no lookahead. A batch cut ahead would hold leases that only its ack releases,
            # and peers waiting on those leases would wait on each other at the end of the data.
            while (batch := self._next_batch()) is not None:
                yield batch[0]
            return
        cur = self._next_batch()
        while cur is not None:
            # Lookahead: cut the next batch and start its all-reduce now; `settle` (or the next iteration) finishes
            # it, and marks the current batch as the last one when no rank has data left.
            nxt = self._cut()
            cur[1].extra["antdt_next"] = nxt
            yield cur[0]
            self.settle(cur[1])
            cur = self._resolve(nxt)

    def ack(self, meta: BatchMeta, metrics: dict | None = None) -> dict:
        """Acknowledge a consumed batch (synchronously; a lease refill rides along when one is due); used outside
        Trainer. Applies a returned plan."""
        lease = self.lease_request()
        try:
            reply = self.client.ack(meta.ack_items, metrics, lease=lease)
        except BaseException:
            if lease is not None:
                self.accept_lease(None)
            raise
        self.mark_acked(meta.ack_items)
        if lease is not None:
            self.accept_lease(reply.get("lease"))
        self.apply_plan(Plan.from_dict(reply["plan"]))
        return reply
