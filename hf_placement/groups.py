"""Process groups for a `PlacementPlan`: created once, in one deterministic order, on every rank, with timeouts.

``new_group`` is collective over the whole world, so every rank must create the same groups in the same order even
when it is not a member. `build_role_groups` derives the full list of rank sets from the plan alone (never from
rank-local state), in this order:

1. one group per distinct role rank set (roles in `ROLES` order, first occurrence wins: two roles on the same ranks
   share one group);
2. the rollout replica groups (disaggregated plans with ``rollout_replicas > 1``);
3. one weight-sync group per (trained, shadow) pair: the trained role's first rank plus the shadow role's ranks, used
   by `WeightSync` with ``strategy="broadcast"``;
4. caller-supplied ``extra_rank_sets`` (in the given order).

Rank sets that repeat are created once. Point-to-point channels use the default group (tags separate them), so no
pair groups are needed on gloo.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from .plan import PlacementPlan
from .topology import DEFAULT_GROUP_TIMEOUT_S, backend_device_types, new_process_groups

__all__ = ["RoleGroups", "build_role_groups"]


@dataclass
class RoleGroups:
    """This rank's view of the plan's process groups (built by `build_role_groups`)."""

    plan: PlacementPlan
    rank: int
    timeout_s: float
    rank_sets: list[tuple[int, ...]]
    _groups: dict[tuple[int, ...], dist.ProcessGroup | None] = field(repr=False)
    # A gloo group over the world for point-to-point channels, made only where the world's backend carries no CPU
    # tensors (NCCL alone). NCCL runs a rank pair's sends and receives in order on one stream, so two ranks that both
    # send before they receive (owners and partners exchanging inputs and results, a trainer and a rollout rank with
    # experience and weights in flight) can wait on each other once a message is too large for NCCL to send without
    # the receiver (not observed here: no GPU); gloo's sends do not wait for the receiver. Channels on this group use
    # CPU buffers (`collective_device`).
    wire_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def group_for_ranks(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The group over exactly ``ranks`` (``None`` on ranks outside it); raises if it was not created."""
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self._groups:
            raise KeyError(f"no process group over ranks {list(key)} was created; groups exist for "
                           f"{[list(k) for k in self.rank_sets]}. Pass the rank set in extra_rank_sets to "
                           "build_role_groups (groups must be created up front, on all ranks).")
        return self._groups[key]

    def group(self, role: str) -> dist.ProcessGroup | None:
        """The process group of ``role`` (``None`` on ranks that do not own it)."""
        return self.group_for_ranks(self.plan.ranks(role))

    def replica_group(self, rank: int | None = None) -> dist.ProcessGroup | None:
        """The rollout replica group containing ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        for ranks in self.plan.replica_ranks():
            if rank in ranks:
                return self.group_for_ranks(ranks)
        return None

    def sync_group(self, shadow_role: str) -> dist.ProcessGroup | None:
        """The broadcast group of the weight sync into ``shadow_role`` (source = first rank of the trained role)."""
        return self.group_for_ranks(sync_rank_set(self.plan, shadow_role))

    def owns(self, role: str) -> bool:
        return role in self.plan.roles and self.rank in self.plan.roles[role]


def sync_rank_set(plan: PlacementPlan, shadow_role: str) -> list[int]:
    """Ranks of the broadcast weight sync into ``shadow_role``: source first, then the shadow ranks."""
    from .plan import SHADOW_OF

    src = min(plan.ranks(SHADOW_OF[shadow_role]))
    return [src] + sorted(plan.ranks(shadow_role))


def planned_rank_sets(plan: PlacementPlan, extra_rank_sets: Sequence[Sequence[int]] = ()) -> list[tuple[int, ...]]:
    """All rank sets `build_role_groups` creates, in creation order (pure: the same on every rank)."""
    out: list[tuple[int, ...]] = []

    def add(ranks: Sequence[int]) -> None:
        key = tuple(sorted(int(r) for r in ranks))
        if key not in out:
            out.append(key)

    for ranks in plan.rank_sets():
        add(ranks)
    if plan.is_disaggregated:
        if plan.rollout_replicas > 1:
            for ranks in plan.replica_ranks():
                add(ranks)
        for _, shadow in plan.sync_pairs():
            add(sync_rank_set(plan, shadow))
    for ranks in extra_rank_sets:
        add(ranks)
    return out


def build_role_groups(plan: PlacementPlan, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                      extra_rank_sets: Sequence[Sequence[int]] = (), backend: str | None = None) -> RoleGroups:
    """Create the plan's process groups (collective: call on every rank with the same arguments).

    Args:
        plan (`PlacementPlan`): validated plan; its ``world_size`` must equal the job's.
        timeout_s (`float`, *optional*, defaults to 600): timeout of every collective on these groups.
        extra_rank_sets (`list[list[int]]`, *optional*): more groups an executor needs, created after the plan's.
        backend (`str`, *optional*): backend of the new groups (default: the world's).
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group (or launch with torchrun / "
                           "accelerate launch) before build_role_groups.")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
    plan.check_world_size(dist.get_world_size())
    rank_sets = planned_rank_sets(plan, extra_rank_sets)
    # Created once per process-group lifetime: every rank calls with the same arguments, so every rank hits or
    # misses the cache together and the collective new_group calls stay matched.
    key = (id(dist.group.WORLD), json.dumps(plan.to_dict(), sort_keys=True), tuple(rank_sets), float(timeout_s),
           backend)
    cached = _ROLE_GROUPS_CACHE.get(key)
    if cached is not None:
        return cached
    created = new_process_groups(rank_sets, timeout_s=timeout_s, backend=backend)
    wire = None
    if "cpu" not in backend_device_types():  # the same answer on every rank: the same collective calls
        (wire,) = new_process_groups([list(range(dist.get_world_size()))], timeout_s=timeout_s, backend="gloo")
    groups = RoleGroups(plan=plan, rank=dist.get_rank(), timeout_s=float(timeout_s), rank_sets=rank_sets,
                        _groups=dict(zip(rank_sets, created)), wire_group=wire)
    _ROLE_GROUPS_CACHE[key] = groups
    return groups


_ROLE_GROUPS_CACHE: dict[tuple, RoleGroups] = {}
