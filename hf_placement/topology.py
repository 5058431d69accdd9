"""Device groups and the process groups over them: the one place where hf-scale-plugins calls ``new_group``.

Two-level jobs (PaRO's intra/inter groups, placement plans that give models exclusive rank sets) need the same
things: a validated layout of ranks into groups, process groups created once and in the same order on every rank
(``new_group`` is itself a collective over the whole world: ranks that create groups in different orders deadlock),
and a timeout on every group so that a stalled rank becomes an error.

Layout used throughout (PaRO paper App. A.1.2): ``n`` ranks form ``ng = n / m`` groups of ``m`` consecutive ranks.
Rank ``r`` is device ``j = r % m`` of group ``i = r // m``. A topology may cover a subset of the world (the ranks of one
model in a placement plan): ``r`` is then the index of the rank among the topology's sorted ``ranks``.

- intra group ``i``: ranks ``[i*m, ..., i*m + m - 1]`` (one node, fast links);
- inter group ``j``: ranks ``[j, j + m, ..., j + (ng-1)*m]`` (same local index on every node; PaRO's "E" groups).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["GroupLayout", "Topology", "all_gather_single", "backend_device_types", "build_topology",
           "check_collective_device", "collective_device", "new_process_groups", "reduce_scatter_single",
           "DEFAULT_GROUP_TIMEOUT_S"]

DEFAULT_GROUP_TIMEOUT_S = 600.0

logger = logging.getLogger(__name__)

# torch 2.13 renamed the tensor-API collectives (the old names emit a FutureWarning) and older releases only have the
# old ones: the base picks the name once, for every package that runs collectives on its groups.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _backend_map(group: dist.ProcessGroup | None) -> dict[str, str]:
    config = str(dist.get_backend_config(group))
    pairs = (part.split(":", 1) for part in config.split(",") if ":" in part)
    return {kind.strip(): backend.strip() for kind, backend in pairs}


def backend_device_types(group: dist.ProcessGroup | None = None) -> tuple[str, ...]:
    """Device types whose tensors ``group``'s backend communicates, from its backend config: ``("cpu", "cuda")``
    for gloo, ``("cuda",)`` for NCCL alone, both for ``"cpu:gloo,cuda:nccl"``."""
    return tuple(_backend_map(group))


def collective_device(group: dist.ProcessGroup | None = None, *, accelerator_first: bool = False) -> torch.device:
    """Where to make a tensor that only travels through ``group``.

    For a flag, a count or a norm (the default): the CPU when the backend has a CPU transport (gloo, or a
    ``cpu:gloo,cuda:nccl`` pair), else the current device of the accelerator it serves (``cuda:<current>`` under
    NCCL). The same code then runs on gloo CPU ranks and on NCCL GPU ranks. ``accelerator_first=True`` (a bandwidth
    probe, which should cross the links training will use): the accelerator of a non-gloo backend (NCCL's GPUs) even
    where gloo also carries CPU tensors."""
    mapping = _backend_map(group)
    if accelerator_first:
        for kind, backend in mapping.items():
            if kind != "cpu" and backend != "gloo":
                return _current(kind)
    if not mapping or "cpu" in mapping:
        return torch.device("cpu")
    return _current(next(iter(mapping)))


def _current(kind: str) -> torch.device:
    current = getattr(getattr(torch, kind, None), "current_device", None)
    return torch.device(kind, current()) if callable(current) else torch.device(kind)


def check_collective_device(device: torch.device, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise a `ValueError` naming ``what`` when ``group``'s backend cannot communicate tensors on ``device`` (a
    model left on the CPU under NCCL), before the first collective fails with a backend error."""
    types = backend_device_types(group)
    if types and torch.device(device).type not in types:
        raise ValueError(f"{what} is on {device}, but the process group's backend ({dist.get_backend_config(group)}) "
                         f"communicates only {', '.join(types)} tensors: move it to the device of this rank first "
                         "(e.g. model.to(accelerator.device) or model.to(f'cuda:{LOCAL_RANK}')), or initialise the "
                         "process group with a backend for that device (gloo for CPU).")


@dataclass(frozen=True)
class GroupLayout:
    """Pure description of ``world_size`` ranks cut into groups of ``group_size`` consecutive ranks."""

    world_size: int
    group_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if self.group_size < 1 or self.world_size % self.group_size != 0:
            raise ValueError(
                f"group_size={self.group_size} does not divide world_size={self.world_size}. Choose a group size "
                f"among the divisors of the world size ({_divisors(self.world_size)}), usually the ranks per node."
            )

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    def group_index(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.group_size

    def local_index(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.group_size

    def intra_ranks(self, group: int) -> list[int]:
        """Ranks of intra group ``group`` (one node)."""
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def inter_ranks(self, local: int) -> list[int]:
        """Ranks with local index ``local`` on every node."""
        return list(range(local, self.world_size, self.group_size))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def new_process_groups(rank_lists: Sequence[Sequence[int]], timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                       backend: str | None = None) -> list[dist.ProcessGroup | None]:
    """Create one process group per rank list, in list order, on every rank (``new_group`` is collective).

    Returns the group object for lists that contain this rank and ``None`` for the others.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group (or launch with torchrun "
                           "/ accelerate launch) before building process groups.")
    world = dist.get_world_size()
    me = dist.get_rank()
    out: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        ranks = [int(r) for r in ranks]
        bad = [r for r in ranks if not 0 <= r < world]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"invalid rank list {ranks} for a world of {world} ranks (empty, duplicate or out of "
                             "range ranks).")
        pg = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
        out.append(pg if me in ranks else None)
    return out


@dataclass
class Topology:
    """This rank's view of a two-level layout over a set of ranks, with its process groups (see `build_topology`).

    ``ranks`` are the global ranks the layout covers (the whole world, or a sub-group such as the ranks of one model
    of a placement plan); ``rank`` is this process's index in ``ranks`` (``-1`` on a non-member, whose groups are
    ``None``). Everything that runs on the topology (engines, collectives) uses ``rank``, ``world_size`` and
    ``world_group``, never the default group, so several topologies can run side by side.
    """

    layout: GroupLayout
    rank: int
    intra_group: dist.ProcessGroup | None = field(repr=False)
    inter_group: dist.ProcessGroup | None = field(repr=False)
    world_group: dist.ProcessGroup | None = field(repr=False)
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = tuple(range(self.layout.world_size))
        if len(self.ranks) != self.layout.world_size:
            raise ValueError(f"Topology over ranks {list(self.ranks)} needs a layout of {len(self.ranks)} ranks, got "
                             f"world_size={self.layout.world_size}.")

    @property
    def is_member(self) -> bool:
        """Whether this process is one of ``ranks`` (non-members hold no groups and cannot run on the topology)."""
        return self.rank >= 0

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def group_size(self) -> int:
        return self.layout.group_size

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def group_index(self) -> int:
        return self.layout.group_index(self._member_rank())

    @property
    def local_index(self) -> int:
        return self.layout.local_index(self._member_rank())

    def global_rank(self, local_index: int) -> int:
        """The global rank of member ``local_index`` (``ranks[local_index]``): what ``src=`` / ``dst=`` of a
        ``torch.distributed`` call over ``world_group`` expect."""
        if not 0 <= local_index < len(self.ranks):
            raise ValueError(f"member index {local_index} is outside the topology's {len(self.ranks)} ranks "
                             f"{list(self.ranks)}.")
        return self.ranks[local_index]

    def _member_rank(self) -> int:
        if not self.is_member:
            raise ValueError(f"this process is not a member of the topology over ranks {list(self.ranks)}: it has no "
                             "group index. Check topology.is_member before using it.")
        return self.rank


_TOPOLOGY_CACHE: dict[tuple[int, int, tuple[int, ...], int], Topology] = {}


def _check_ranks(ranks: Sequence[int], world: int) -> tuple[int, ...]:
    out = tuple(int(r) for r in ranks)
    if not out or any(not 0 <= r < world for r in out) or any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError(f"ranks={list(ranks)} must be a non-empty, strictly increasing list of global ranks in "
                         f"[0, {world}); pass sorted(set(ranks)).")
    return out


def _warn_if_groups_span_nodes(group_size: int) -> None:
    """Warn when an explicit group size cuts the launcher's nodes so that an intra group spans two of them.

    Launchers number ranks node by node (``LOCAL_WORLD_SIZE`` consecutive ranks per node), so intra groups of ``m``
    consecutive ranks stay inside one node exactly when ``m`` divides ``LOCAL_WORLD_SIZE``. Otherwise every "intra"
    collective crosses the slow inter-node link: supported (a deliberate experiment may want it) but most likely a
    group size copied from another cluster.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) % group_size:
        logger.warning("group_size=%d does not divide the launcher's LOCAL_WORLD_SIZE=%s (ranks per node): intra "
                       "groups span nodes, so their collectives cross the inter-node link. Leave group_size unset to "
                       "use LOCAL_WORLD_SIZE, or set it to one of %s.", group_size, local, _divisors(int(local)))


def build_topology(group_size: int | None = None, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                   ranks: Sequence[int] | None = None) -> Topology:
    """Build (once per process-group lifetime) the groups of a two-level layout over ``ranks``.

    Args:
        group_size (`int`, *optional*): members per intra group (consecutive members, usually ranks per node).
            Defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun / accelerate launch) clipped to the number of members.
        timeout_s (`float`, *optional*, defaults to `600.0`): timeout of every group created.
        ranks (`list[int]`, *optional*): sorted global ranks the layout covers; ``None`` = the whole world, whose
            ``world_group`` is the default group. For a subset a group over the members is created as well.

    Collective: every rank of the world calls this with the same arguments, in the same order relative to other
    topologies (``new_group`` is a collective over the whole world). Members get ``Topology(rank=<index in ranks>,
    ranks=tuple(ranks))``; other ranks get a topology whose ``is_member`` is False and whose groups are None.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first.")
    world = dist.get_world_size()
    members = tuple(range(world)) if ranks is None else _check_ranks(ranks, world)
    whole = members == tuple(range(world))
    if group_size is None:
        group_size = min(int(os.environ.get("LOCAL_WORLD_SIZE", len(members))), len(members))
    if whole:
        layout = GroupLayout(world, int(group_size))
    elif group_size < 1 or len(members) % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {len(members)} ranks {list(members)} of the "
                         f"topology: choose one of {_divisors(len(members))} (members per intra group).")
    else:
        layout = GroupLayout(len(members), int(group_size))
    key = (id(dist.group.WORLD), world, members, layout.group_size)
    cached = _TOPOLOGY_CACHE.get(key)
    if cached is not None:
        return cached
    if whole:
        _warn_if_groups_span_nodes(layout.group_size)
    me = dist.get_rank()
    # Fixed order on every rank: the members' group (subsets only), all intra groups, then all inter groups.
    world_group = dist.group.WORLD if whole else new_process_groups([members], timeout_s)[0]
    intra = new_process_groups([[members[r] for r in layout.intra_ranks(i)] for i in range(layout.num_groups)],
                               timeout_s)
    inter = new_process_groups([[members[r] for r in layout.inter_ranks(j)] for j in range(layout.group_size)],
                               timeout_s)
    if me in members:
        rank = members.index(me)
        topo = Topology(layout=layout, rank=rank, intra_group=intra[layout.group_index(rank)],
                        inter_group=inter[layout.local_index(rank)], world_group=world_group, ranks=members)
    else:
        topo = Topology(layout=layout, rank=-1, intra_group=None, inter_group=None, world_group=None, ranks=members)
    _TOPOLOGY_CACHE[key] = topo
    return topo
