"""Device groups and the process groups over them: the one place where hf-scale-plugins calls ``new_group``.

Two-level jobs (PaRO's intra/inter groups, placement plans that give models exclusive rank sets) need the same
things: a validated layout of ranks into groups, process groups created once and in the same order on every rank
(``new_group`` is itself a collective over the whole world: ranks that create groups in different orders deadlock),
and a timeout on every group so that a stalled rank becomes an error.

Layout used throughout (PaRO paper App. A.1.2): ``n`` ranks form ``ng = n / m`` groups of ``m`` consecutive ranks.
Rank ``r`` is device ``j = r % m`` of group ``i = r // m``.

- intra group ``i``: ranks ``[i*m, ..., i*m + m - 1]`` (one node, fast links);
- inter group ``j``: ranks ``[j, j + m, ..., j + (ng-1)*m]`` (same local index on every node; PaRO's "E" groups).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["GroupLayout", "Topology", "build_topology", "new_process_groups", "DEFAULT_GROUP_TIMEOUT_S"]

DEFAULT_GROUP_TIMEOUT_S = 600.0


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
    """This rank's view of a two-level layout with its process groups (created by `build_topology`)."""

    layout: GroupLayout
    rank: int
    intra_group: dist.ProcessGroup | None = field(repr=False)
    inter_group: dist.ProcessGroup | None = field(repr=False)
    world_group: dist.ProcessGroup | None = field(repr=False)

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
        return self.layout.group_index(self.rank)

    @property
    def local_index(self) -> int:
        return self.layout.local_index(self.rank)


_TOPOLOGY_CACHE: dict[tuple[int, int, int], Topology] = {}


def build_topology(group_size: int | None = None, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> Topology:
    """Build (once per process-group lifetime) the intra/inter groups for ``group_size`` ranks per group.

    ``group_size`` defaults to ``LOCAL_WORLD_SIZE`` (ranks per node, set by torchrun / accelerate launch). Every rank
    must call this with the same arguments, since group creation is collective.
    """
    import os

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first.")
    world = dist.get_world_size()
    if group_size is None:
        group_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    layout = GroupLayout(world, int(group_size))
    key = (id(dist.group.WORLD), world, layout.group_size)
    cached = _TOPOLOGY_CACHE.get(key)
    if cached is not None:
        return cached
    rank = dist.get_rank()
    # Fixed order on every rank: all intra groups, then all inter groups.
    intra = new_process_groups([layout.intra_ranks(i) for i in range(layout.num_groups)], timeout_s)
    inter = new_process_groups([layout.inter_ranks(j) for j in range(layout.group_size)], timeout_s)
    topo = Topology(
        layout=layout,
        rank=rank,
        intra_group=intra[layout.group_index(rank)],
        inter_group=inter[layout.local_index(rank)],
        world_group=dist.group.WORLD,
    )
    _TOPOLOGY_CACHE[key] = topo
    return topo
