"""`ServiceIterableDataset`: an iterable over batches cut from shards leased from the sharding service.

Design points (each one is a trap of Trainer/Accelerate dataloading, see the AntDT design notes):

- **Batches, not samples.** The iterable yields whole per-rank batches of the *current* planned size, so a new batch
  size applies from the next fetch, in the middle of a shard if need be. Use it with ``DataLoader(batch_size=None,
  num_workers=0)`` and never through ``accelerator.prepare`` (which would re-shard it and silently drop samples).
- **Prefetch in a thread, not in DataLoader workers.** A background thread keeps ``prefetch_shards`` leases ahead
  and a heartbeat thread renews them; both are safe with ``num_workers=0`` (worker processes cannot share leases).
- **Stop together.** Under DDP every rank all-reduces ``[samples, at_end, restart]`` before each batch: the sum of
  samples is the step's global batch (gradient weights ``b_i / sum b``), ranks out of data contribute a zero-weight
  dummy sample, and all ranks see the same "no data left anywhere" at the same step. A one-batch lookahead marks the
  last batch, so the Agent stops Trainer there instead of letting it spin through ``max_steps``.
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


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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

    # ------------------------------------------------------------------------------------------- service
    def connect(self) -> dict:
        """Register this worker; returns the register reply (job, plan)."""
        reply = self.client.register(max_micro_batch=self.config.max_micro_batch)
        job = JobConfig.from_dict(reply["job"])
        if job.world_size != self.world_size:
            raise AntDTError(f"the service's job has world_size={job.world_size} but this run has "
                             f"{self.world_size} ranks. Start the service with --world-size {self.world_size}.")
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
        self.restart_requested = plan.actions.get(self.rank) == "restart"
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

    def _prefetch_loop(self) -> None:
        assert self.job is not None
        try:
            while not self._stop.is_set():
                with self._cond:
                    ahead = sum(1 for lease in self._leases if lease.left > 0)
                    avail = sum(lease.left for lease in self._leases)
                    # Lease ahead by *samples* (`prefetch_batches` of this rank's current batch), at most
                    # `prefetch_shards` shards: a slow rank with a small batch must not hoard data, or the fast ranks
                    # run dry at the end of the data while it drains its hoard alone.
                    need = self.config.prefetch_batches * max(1, self.batch_size)
                    want = avail < need and (ahead < self.config.prefetch_shards or avail < self.batch_size)
                    want = want and self._status != "end"
                    if not want:
                        self._cond.wait(timeout=0.2)
                        continue
                reply = self.client.lease()
                with self._cond:
                    if reply["status"] == "shard":
                        s = reply["shard"]
                        ids = shard_sample_ids(self.job, s["epoch"], s["shard_id"], s["start"], s["end"])
                        lease = _Lease(s["epoch"], s["shard_id"], s["token"], s["offset"], s["end"] - s["start"],
                                       ids[s["offset"]:])
                        self._leases.append(lease)
                        self._open[lease.key] = lease
                        self._status = "open"
                    elif reply["status"] == "wait" and (self.sync or not reply.get("others")):
                        # Drained: the leases left are this rank's own (or, in synchronous training, are already
                        # cut into some rank's pending batch): nothing more will come, so this rank is at its end.
                        self._status = "end"
                    else:
                        self._status = reply["status"]
                    self._cond.notify_all()
                if reply["status"] == "wait":
                    self._stop.wait(self.config.wait_poll_s)
        except BaseException as e:  # noqa: BLE001 - surfaced in the consuming thread
            self._fail(e)

    def _heartbeat_loop(self, period: float) -> None:
        try:
            while not self._stop.wait(period):
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
        """Forget leases that an accepted ack finished (no more heartbeats for them)."""
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

    def _next_batch(self) -> tuple[Any, BatchMeta] | None:
        deadline = time.monotonic() + self.config.stop_timeout_s
        while True:
            ids, items, at_end = self._take(self.batch_size)
            restart = self.restart_requested
            if self.sync:
                t0 = time.perf_counter()
                t = torch.tensor([len(ids), int(at_end), int(restart)], dtype=torch.int64)
                dist.all_reduce(t)
                self.collective_s += time.perf_counter() - t0
                total, ends, restarts = (int(x) for x in t.tolist())
                world = dist.get_world_size()
            else:
                total, ends, restarts, world = len(ids), int(at_end), int(restart), 1
            if total > 0:
                break
            if ends == world:
                return None
            # Nothing anywhere right now but not finished (leases held by a stalled peer): poll together.
            if time.monotonic() > deadline:
                raise AntDTError(f"rank {self.rank}: all ranks had no data for {self.config.stop_timeout_s} s while "
                                 "the service still had leased shards (a stalled worker?).")
            time.sleep(self.config.wait_poll_s)
        meta = BatchMeta(sample_ids=ids, ack_items=items, global_samples=total, micro_sizes=[],
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
        return batch, meta

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
            nxt = self._next_batch()
            cur[1].last = nxt is None
            yield cur[0]
            cur = nxt

    def ack(self, meta: BatchMeta, metrics: dict | None = None) -> dict:
        """Acknowledge a consumed batch (synchronously); used outside Trainer. Applies a returned plan."""
        reply = self.client.ack(meta.ack_items, metrics)
        self.mark_acked(meta.ack_items)
        self.apply_plan(Plan.from_dict(reply["plan"]))
        return reply
