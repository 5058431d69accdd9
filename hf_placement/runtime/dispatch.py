"""Role handles with owner semantics (APP's ``GroupPlacePolicy``, FlexRLHF arXiv 2312.11819).

A role's model lives only on its *owner* ranks. Every data rank (a rank holding a micro-batch, by default the
generators) that is not an owner is paired with one owner (`PlacementPlan.partners`: round-robin, so each owner
serves ``ceil(non_owners / owners)`` partners). A call then:

1. sends each non-owner's inputs to its owner;
2. runs ``fn`` on every owner, on its own micro-batch (if it is a data rank) and on each partner's;
3. sends the outputs back, so every data rank ends with ``fn(its own batch)`` without holding the weights.

`run_concurrently` issues several calls at once and orders the work per rank as "post all input sends, run every
owned computation, then collect remote results". With ref on ranks [0, 1] and reward on [2, 3] the two models
therefore run at the same time on disjoint halves (the Interleaving strategy), instead of one half idling while the
other computes.

By default ``fn`` runs once per micro-batch, so the result is bit-identical to a local call. ``concat=True`` runs it
once on the concatenation (dim 0) of the owner's and its partners' batches, a larger effective batch for frozen
forwards; results then match to floating-point tolerance only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..plan import PlacementPlan
from .channels import Channel, _flatten, _unflatten
from .timeline import Timeline

__all__ = ["RoleCall", "RoleHandle", "run_concurrently"]


class RoleHandle:
    """Dispatches calls of one role from data ranks to its owners.

    Args:
        plan (`PlacementPlan`): the job's plan.
        role (`str`): role whose owners run the function (e.g. ``"ref"``).
        data_ranks (`list[int]`, *optional*): ranks that hold micro-batches; defaults to `PlacementPlan.data_ranks`.
        timeout_s (`float`, *optional*, defaults to 60): timeout of every transfer.
        concat (`bool`, *optional*, defaults to `False`): run ``fn`` once on the concatenated batches of an owner
            and its partners (tensor leaves concatenated on dim 0) instead of once per micro-batch.
        timeline (`Timeline`, *optional*): records an owner's compute as phase ``role``, its receipt of partner
            inputs as ``"dispatch:<role>"`` and a data rank's wait for its results as ``"wait:<role>"``, with bytes.
        device (`torch.device`, *optional*): device of the transfer buffers; defaults to `Channel`'s (the one the
            group's backend carries: CPU under gloo, the rank's GPU under NCCL alone).
        group (`ProcessGroup`, *optional*): group the channels send on (default: the world); pass
            `RoleGroups.wire_group` so that owners and partners never exchange over NCCL alone.
    """

    def __init__(self, plan: PlacementPlan, role: str, data_ranks: Sequence[int] | None = None,
                 timeout_s: float = 60.0, concat: bool = False, timeline: Timeline | None = None,
                 device: torch.device | str | None = None, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: role handles need a process group.")
        self.plan, self.role = plan, role
        self.rank = dist.get_rank()
        self.owners = plan.ranks(role)
        self.data_ranks = sorted(plan.data_ranks() if data_ranks is None else data_ranks)
        bad = [r for r in self.data_ranks if not 0 <= r < plan.world_size]
        if bad:
            raise ValueError(f"data_ranks {bad} are outside the world of {plan.world_size} ranks.")
        self.partner_map = plan.partners(role, self.data_ranks)
        self.timeout_s, self.concat, self.timeline = float(timeout_s), bool(concat), timeline
        self.device, self.group = device, group
        self.is_owner = self.rank in self.owners
        self.is_data = self.rank in self.data_ranks
        self.owner = plan.owner_of(role, self.rank, self.data_ranks) if self.is_data else None
        self.partners = self.partner_map.get(self.rank, [])
        self._channels: dict[tuple[str, int], Channel] = {}

    def __repr__(self) -> str:
        return (f"RoleHandle(role={self.role!r}, rank={self.rank}, owner={self.is_owner}, "
                f"partners={self.partners}, serves_me={self.owner})")

    @property
    def participates(self) -> bool:
        """Whether this rank takes part in calls of this role (as owner or data rank)."""
        return self.is_owner or self.is_data

    def _channel(self, direction: str, peer: int) -> Channel:
        key = (direction, peer)
        if key not in self._channels:
            # The name (hence the tag) must be the same on both sides: it names the data rank and its owner.
            data_rank, owner = (peer, self.rank) if self.is_owner else (self.rank, peer)
            name = f"role:{self.role}:{direction}:data{data_rank}:owner{owner}"
            self._channels[key] = Channel(peer, name, self.timeout_s, group=self.group, device=self.device)
        return self._channels[key]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for this role so far (inputs to its owner or outputs to its partners)."""
        return sum(ch.bytes_sent for ch in self._channels.values())

    @property
    def bytes_received(self) -> int:
        return sum(ch.bytes_received for ch in self._channels.values())

    def call(self, fn: Callable[[Any], Any], batch: Any = None) -> Any:
        """Run ``fn`` for this rank's ``batch`` on its owner; returns ``fn(batch)`` on data ranks, ``None`` else."""
        return run_concurrently([RoleCall(self, fn, batch)])[0]


@dataclass
class RoleCall:
    """One pending call: ``handle`` runs ``fn`` for ``batch`` (``None`` on ranks without a micro-batch)."""

    handle: RoleHandle
    fn: Callable[[Any], Any]
    batch: Any = None


def _concat(batches: list[Any]) -> tuple[Any, list[int]]:
    flat: list[list[torch.Tensor]] = []
    trees = []
    for b in batches:
        ts: list[torch.Tensor] = []
        trees.append(_flatten(b, ts))
        flat.append(ts)
    if any(t != trees[0] for t in trees) or any(len(ts) != len(flat[0]) for ts in flat):
        raise ValueError("concat=True needs micro-batches with the same structure on every rank; use concat=False.")
    sizes = [ts[0].shape[0] if ts and ts[0].dim() else 0 for ts in flat]
    merged = []
    for i in range(len(flat[0])):
        parts = [ts[i] for ts in flat]
        if any(p.dim() == 0 or p.shape[1:] != parts[0].shape[1:] or p.shape[0] != s
               for p, s in zip(parts, sizes)):
            raise ValueError(f"concat=True needs tensors that agree beyond dim 0 and share the batch size on dim 0; "
                             f"got shapes {[tuple(p.shape) for p in parts]}. Pad to a common length or use "
                             "concat=False.")
        merged.append(torch.cat(parts))
    return _unflatten(trees[0], merged), sizes


def _split(out: Any, sizes: list[int]) -> list[Any]:
    ts: list[torch.Tensor] = []
    tree = _flatten(out, ts)
    total = sum(sizes)
    for t in ts:
        if t.dim() == 0 or t.shape[0] != total:
            raise ValueError(f"with concat=True the function must return tensors with the batch on dim 0 "
                             f"({total} rows), got shape {tuple(t.shape)}; use concat=False.")
    pieces = [list(t.split(sizes)) for t in ts]
    return [_unflatten(tree, [p[i] for p in pieces]) for i in range(len(sizes))]


def run_concurrently(calls: Sequence[RoleCall]) -> list[Any]:
    """Run several role calls at once; returns, per call, ``fn(batch)`` on data ranks and ``None`` elsewhere.

    Every rank must issue the same calls in the same order (like collectives). Calls whose owner sets are disjoint
    overlap in time.
    """
    results: list[Any] = [None] * len(calls)
    # 1. non-owner data ranks post their inputs (non-blocking).
    for call in calls:
        h = call.handle
        if h.is_data and not h.is_owner:
            if call.batch is None:
                raise ValueError(f"rank {h.rank} is a data rank of role '{h.role}' but passed no batch.")
            h._channel("in", h.owner).send(call.batch, wait=False)
    # 2. owners run their own and their partners' micro-batches, post outputs (non-blocking).
    for i, call in enumerate(calls):
        h = call.handle
        if not h.is_owner:
            continue
        t0 = time.time()
        received_before = h.bytes_received
        if h.is_data and call.batch is None:
            raise ValueError(f"rank {h.rank} is a data rank of role '{h.role}' but passed no batch.")
        inputs = [h._channel("in", p).recv() for p in h.partners]
        recv_end = time.time()
        own = [call.batch] if h.is_data else []
        batches = own + inputs
        with torch.no_grad():
            if h.concat and len(batches) > 1:
                merged, sizes = _concat(batches)
                outs = _split(call.fn(merged), sizes)
            else:
                outs = [call.fn(b) for b in batches]
        compute_end = time.time()
        if h.is_data:
            results[i] = outs[0]
        sent = sum(h._channel("out", p).send(out, wait=False) for p, out in zip(h.partners, outs[len(own):]))
        if h.timeline is not None:
            if h.partners:
                h.timeline.record(f"dispatch:{h.role}", t0, recv_end, bytes=h.bytes_received - received_before)
            h.timeline.record(h.role, recv_end, compute_end, bytes=sent)
    # 3. non-owners collect their results; then every pending send completes.
    for i, call in enumerate(calls):
        h = call.handle
        if h.is_data and not h.is_owner:
            t0 = time.time()
            ch = h._channel("out", h.owner)
            before = ch.bytes_received
            results[i] = ch.recv()
            if h.timeline is not None:
                # blocked until the owner has computed this rank's result: idle time of a data rank
                h.timeline.record(f"wait:{h.role}", t0, time.time(), bytes=ch.bytes_received - before)
    for call in calls:
        for ch in call.handle._channels.values():
            ch.flush()
    return results
