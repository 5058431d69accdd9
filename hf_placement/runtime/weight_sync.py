"""Versioned trainer -> shadow weight sync (disaggregated RLHF placement).

Once per iteration, before generation, the trained actor (critic) pushes its weights to the shadow actor (critic)
on the inference ranks. Two transports:

- ``"broadcast"``: the source broadcasts each bucket to the sync group (source + destinations). One collective per
  bucket; what OpenRLHF does. Needs a process group over exactly those ranks (`RoleGroups.sync_group`).
- ``"bucketed_p2p"``: the source sends each bucket to every destination over its own point-to-point `Channel`
  (APP's scheme: one link per destination; ~100 MB buckets). No group needed besides the world.

Parameters are packed, in name order, into flat byte buckets of at most ``bucket_bytes`` (a tensor larger than a
bucket travels alone) and copied back byte for byte, so the shadow is bit-identical to the trainer. A JSON header
(version, names, dtypes, shapes, bucket layout) precedes the payload; the receiver checks that every name exists with
the same dtype and shape, and that the version increases (and equals ``expected_version`` when given): a stale or
replayed sync is an error, never silently applied.

``param_filter`` selects what travels: ``"all"``, ``"trainable"`` (``requires_grad``), ``"lora"`` (names containing
``lora_``; with PEFT only the adapters change, so only they need syncing) or a callable ``(name, tensor) ->
bool``. The filter runs on the source; the destination applies whatever names the header lists.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .channels import Channel
from .timeline import Timeline

__all__ = ["SyncStats", "WeightSync", "WeightSyncError", "select_tensors"]

_MAGIC = 0x48465753  # "HFWS"
DEFAULT_BUCKET_BYTES = 100 * 2**20
ParamFilter = str | Callable[[str, torch.Tensor], bool]


class WeightSyncError(RuntimeError):
    """A sync failed or was inconsistent (version, names, shapes, a stalled peer)."""


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved: ``payload_bytes`` of tensor data in ``num_buckets`` buckets, plus header bytes."""

    version: int
    strategy: str
    num_tensors: int
    num_buckets: int
    payload_bytes: int
    header_bytes: int
    seconds: float

    @property
    def bytes(self) -> int:
        return self.payload_bytes + self.header_bytes


def select_tensors(module: torch.nn.Module, param_filter: ParamFilter = "all",
                   include_buffers: bool = False) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs that a sync with this filter moves, sorted by name (the wire order)."""
    items: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    if include_buffers:
        items += [(n, b) for n, b in module.named_buffers() if b is not None]
    if param_filter == "all":
        keep = items
    elif param_filter == "trainable":
        keep = [(n, t) for n, t in items if t.requires_grad]
    elif param_filter == "lora":
        keep = [(n, t) for n, t in items if "lora_" in n]
    elif callable(param_filter):
        keep = [(n, t) for n, t in items if param_filter(n, t)]
    else:
        raise ValueError(f"param_filter={param_filter!r} is not 'all', 'trainable', 'lora' or a callable "
                         "(name, tensor) -> bool.")
    return sorted(keep, key=lambda x: x[0])


def _bucketize(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    return buckets


class WeightSync:
    """Push ``module``'s weights from rank ``src`` to ``dst_ranks`` (call `sync` on all of those ranks).

    Args:
        module (`torch.nn.Module`): the trained model on ``src``, the shadow model on the destinations (ignored on
            other ranks; may be ``None`` there).
        src (`int`): global rank that sends (e.g. the actor's first rank).
        dst_ranks (`list[int]`): global ranks that receive (e.g. the rollout ranks).
        strategy (`str`, *optional*, defaults to `"broadcast"`): ``"broadcast"`` or ``"bucketed_p2p"``.
        group (`ProcessGroup`, *optional*): for ``"broadcast"``, a group over exactly ``[src] + dst_ranks``
            (from `build_role_groups`); may be omitted when those ranks are the whole world. For
            ``"bucketed_p2p"``, the group its channels send on (default: the world; `RoleGroups.wire_group` keeps
            them off NCCL alone).
        bucket_bytes (`int`, *optional*, defaults to 100 MiB): maximum bytes per bucket.
        param_filter (`str` or `Callable`, *optional*, defaults to `"all"`): which tensors travel (see module doc).
        include_buffers (`bool`, *optional*, defaults to `False`): also sync registered buffers.
        timeout_s (`float`, *optional*, defaults to 120): timeout of every wait.
        timeline (`Timeline`, *optional*): records a ``"sync"`` phase with its bytes (on destinations preceded by
            ``"wait:sync"``, the time spent waiting for the source to start).

    Example:

    ```python
    sync = WeightSync(model, src=0, dst_ranks=[1], strategy="bucketed_p2p", bucket_bytes=1 << 20)
    stats = sync.sync(version=step)   # on rank 0 and rank 1; rank 1 now holds bit-identical weights
    ```
    """

    def __init__(self, module: torch.nn.Module | None, src: int, dst_ranks: Sequence[int],
                 strategy: str = "broadcast", group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, param_filter: ParamFilter = "all",
                 include_buffers: bool = False, timeout_s: float = 120.0, timeline: Timeline | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: weight sync needs a process group.")
        if strategy not in ("broadcast", "bucketed_p2p"):
            raise ValueError(f"strategy={strategy!r} is not 'broadcast' or 'bucketed_p2p'.")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.src, self.dst_ranks = int(src), sorted(int(r) for r in dst_ranks)
        if not self.dst_ranks:
            raise ValueError("dst_ranks is empty: a weight sync needs at least one destination rank.")
        if self.src in self.dst_ranks:
            raise ValueError(f"src rank {self.src} is also in dst_ranks {self.dst_ranks}; a rank does not sync to "
                             "itself (co-located shadows share the weights, no sync needed).")
        bad = [r for r in [self.src, *self.dst_ranks] if not 0 <= r < world]
        if bad:
            raise ValueError(f"ranks {bad} are outside the world of {world} ranks.")
        members = [self.src, *self.dst_ranks]
        if strategy == "broadcast" and group is None and len(members) != world and self.rank in members:
            raise ValueError(f"strategy='broadcast' over ranks {sorted(members)} needs a process group over exactly "
                             "those ranks: pass group=role_groups.sync_group('rollout') (or group_for_ranks) from "
                             "build_role_groups, or use strategy='bucketed_p2p'.")
        self.module, self.strategy, self.group = module, strategy, group
        self.bucket_bytes, self.param_filter, self.include_buffers = int(bucket_bytes), param_filter, include_buffers
        self.timeout_s, self.timeline = float(timeout_s), timeline
        self.version: int | None = None
        self.history: list[SyncStats] = []
        self._channels: dict[int, Channel] = {}
        self._header_time = 0.0
        if self.participates and module is None:
            raise ValueError(f"rank {self.rank} takes part in the weight sync but module is None.")

    @property
    def participates(self) -> bool:
        return self.rank == self.src or self.rank in self.dst_ranks

    @property
    def is_source(self) -> bool:
        return self.rank == self.src

    def _channel(self, peer: int) -> Channel:
        if peer not in self._channels:
            dst = peer if self.is_source else self.rank
            self._channels[peer] = Channel(peer, f"weight_sync:{self.src}->{dst}", self.timeout_s, group=self.group)
        return self._channels[peer]

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - re-raised naming the ranks
            raise WeightSyncError(f"rank {self.rank}: weight sync broadcast ({what}) from rank {self.src} to ranks "
                                  f"{self.dst_ranks} failed within {self.timeout_s:g} s; a member is stalled or "
                                  f"dead. (backend said: {str(exc).splitlines()[0] if str(exc) else exc!r})") from exc

    def _bcast(self, t: torch.Tensor, what: str) -> None:
        self._wait(dist.broadcast(t, src=self.src, group=self.group, async_op=True), what)

    # ------------------------------------------------------------------------------------------------ api
    def sync(self, version: int | None = None) -> SyncStats | None:
        """Run one sync. On the source ``version`` is required (strictly increasing); on destinations it is the
        expected version (optional). Returns the stats, or ``None`` on ranks outside the sync.
        """
        if not self.participates:
            return None
        start = time.time()
        stats = self._push(version) if self.is_source else self._pull(version)
        stats = SyncStats(stats.version, stats.strategy, stats.num_tensors, stats.num_buckets, stats.payload_bytes,
                          stats.header_bytes, time.time() - start)
        self.version = stats.version
        self.history.append(stats)
        if self.timeline is not None:
            # A destination first waits for the source to start the sync (its header); that part is idle time.
            begin = start if self.is_source else self._header_time
            if begin > start:
                self.timeline.record("wait:sync", start, begin)
            self.timeline.record("sync", begin, start + stats.seconds, bytes=stats.bytes)
        return stats

    def _push(self, version: int | None) -> SyncStats:
        if version is None or isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"the source of a weight sync needs an integer version, got {version!r}.")
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"version {version} is not newer than the last pushed version {self.version}; "
                                  "versions must increase (use the global step).")
        items = select_tensors(self.module, self.param_filter, self.include_buffers)
        if not items:
            raise WeightSyncError(f"param_filter={self.param_filter!r} selects no tensors of the module on rank "
                                  f"{self.rank}; nothing would be synced. Check the filter (e.g. 'lora' needs a "
                                  "PEFT model).")
        raws = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in items]
        buckets = _bucketize([r.numel() for r in raws], self.bucket_bytes)
        header = {"magic": _MAGIC, "version": version, "names": [n for n, _ in items],
                  "dtypes": [str(t.dtype) for _, t in items], "shapes": [list(t.shape) for _, t in items],
                  "buckets": buckets}
        payload_bytes = sum(r.numel() for r in raws)
        device = raws[0].device
        if self.strategy == "broadcast":
            import json

            head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
            self._bcast(torch.tensor([_MAGIC, head.numel()], dtype=torch.int64, device=device), "header size")
            self._bcast(head, "header")
            header_bytes = 16 + head.numel()
            for b in buckets:
                self._bcast(torch.cat([raws[i] for i in b]), "bucket")
        else:
            header_bytes = 0
            for d in self.dst_ranks:
                header_bytes += self._channel(d).send({"header": header}, wait=False)
            for b in buckets:
                flat = torch.cat([raws[i] for i in b])
                for d in self.dst_ranks:
                    self._channel(d).send(flat, wait=False)
                for d in self.dst_ranks:
                    self._channel(d).flush()
        return SyncStats(version, self.strategy, len(items), len(buckets), payload_bytes, header_bytes, 0.0)

    def _pull(self, expected_version: int | None) -> SyncStats:
        import json

        first = next(iter(self.module.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        if self.strategy == "broadcast":
            meta = torch.zeros(2, dtype=torch.int64, device=device)
            self._bcast(meta, "header size")
            if int(meta[0]) != _MAGIC:
                raise WeightSyncError(f"rank {self.rank}: corrupt weight-sync header from rank {self.src}.")
            head = torch.empty(int(meta[1]), dtype=torch.uint8, device=device)
            self._bcast(head, "header")
            header = json.loads(head.cpu().numpy().tobytes().decode())
            header_bytes = 16 + head.numel()
        else:
            ch = self._channel(self.src)
            before = ch.bytes_received
            header = ch.recv()["header"]
            header_bytes = ch.bytes_received - before
        # Problems are collected first and raised only after the payload has been drained, so the source (and the
        # other destinations of a broadcast) complete the transfer instead of waiting for the timeout.
        problems: list[str] = []
        self._header_time = time.time()
        version = int(header["version"])
        if self.version is not None and version <= self.version:
            problems.append(f"received weight version {version} from rank {self.src}, not newer than the version "
                            f"{self.version} already held (stale or replayed sync)")
        if expected_version is not None and version != expected_version:
            problems.append(f"expected weight version {expected_version} from rank {self.src} but received "
                            f"{version}; trainer and shadow disagree on the step")
        targets = dict(select_tensors(self.module, "all", include_buffers=True))
        names, dtypes, shapes = header["names"], header["dtypes"], header["shapes"]
        missing = [n for n in names if n not in targets]
        if missing:
            problems.append(f"the shadow module has no tensor(s) {missing[:5]} sent by rank {self.src}; source and "
                            "shadow must have the same architecture and parameter names")
        for n, d, s in zip(names, dtypes, shapes):
            t = targets.get(n)
            if t is not None and (str(t.dtype) != d or list(t.shape) != list(s)):
                problems.append(f"tensor '{n}' is {t.dtype}{list(t.shape)} here but {d}{list(s)} on rank "
                                f"{self.src}; shadow and trainer must match exactly")
        wire_sizes = [math.prod(s) * _itemsize(d) for d, s in zip(dtypes, shapes)]
        payload_bytes = 0
        for b in header["buckets"]:
            sizes = [wire_sizes[i] for i in b]
            if self.strategy == "broadcast":
                flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                self._bcast(flat, "bucket")
            else:
                flat = self._channel(self.src).recv()
                if flat.numel() != sum(sizes):
                    raise WeightSyncError(f"rank {self.rank}: bucket of {flat.numel()} bytes from rank {self.src}, "
                                          f"expected {sum(sizes)}.")
            payload_bytes += flat.numel()
            if problems:
                continue
            with torch.no_grad():
                for i, chunk in zip(b, flat.split(sizes)):
                    t = targets[names[i]]
                    t.copy_(chunk.clone().view(t.dtype).view(t.shape))
        if problems:
            raise WeightSyncError(f"rank {self.rank}: weight sync from rank {self.src} rejected, weights left "
                                  "unchanged: " + "; ".join(problems) + ".")
        return SyncStats(version, self.strategy, len(names), len(header["buckets"]), payload_bytes, header_bytes,
                         0.0)


def _itemsize(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {dtype_name!r} in a weight-sync header.")
    return torch.empty(0, dtype=dtype).element_size()
