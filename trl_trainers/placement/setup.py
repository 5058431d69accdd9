"""The placement decisions `PPOTrainer` takes before it builds anything: the plan, its groups, this rank's side.

Every PPO job runs under a plan (co-located when none is given). `prepare_placement` resolves it for the job's world,
creates its process groups (collective: the same order on every rank) and says which group this rank's training
collectives use and how many co-located shards it trains on; the result is a frozen `PlacementSetup`.

What each rank holds (the trainer drops the models of roles a rank does not own):

- co-located: policy, value model, reference and reward model on every rank;
- interleaved: policy and value model on every rank; the reference only on its owners, the reward model only on its
  owners;
- disaggregated: training ranks hold policy + value model (+ optimizer); inference ranks hold the shadow policy and
  shadow value model (overwritten by every weight sync), the reference and the reward model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from transformers.utils import logging

from hf_placement import PlacementPlan, RoleGroups, build_role_groups

from ..launch_engine import LaunchEngine
from ..ppo_config import PPOConfig
from .resolve import apply_launch_engine, equivalence_issues, resolve_plan

__all__ = ["PlacementSetup", "prepare_placement"]

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class PlacementSetup:
    """This rank's view of the job's placement.

    ``rank`` indexes the plan's world; ``training_group`` is the process group of this rank's data-parallel
    collectives (``None``: the whole world); ``shards_per_rank`` is how many co-located shards this rank trains on;
    ``ranks_per_node`` is the launcher's ``LOCAL_WORLD_SIZE`` (the intra group of sharded roles).
    """

    plan: PlacementPlan
    rank: int
    role_groups: RoleGroups | None
    training_group: Any
    shards_per_rank: int
    ranks_per_node: int | None


def prepare_placement(args: PPOConfig, placement: Any = None, group: Any = None,
                      strict_equivalence: bool = False, launch: LaunchEngine | None = None) -> PlacementSetup:
    """Resolve the plan (``placement``, else ``args.placement``, else co-located) for this job and build its groups.

    ``group`` (a process group) runs co-located PPO inside that sub-group without creating groups of its own (for a
    job that places a whole PPO trainer on some of its ranks); it excludes ``placement`` and an engine launched by
    an accelerate config. ``launch`` (the engine of the launch, `launch_engine_from_env`) shards the plan's roles
    under a PaRO config and restricts it to co-located under DeepSpeed / FSDP2.
    """
    launch = launch or LaunchEngine()
    spec = placement if placement is not None else args.placement
    if group is not None and launch.kind != "replicated":
        raise ValueError(f"`group` runs PPO inside a sub-group, but the launch names an engine ({launch.source}) "
                         "that trains over the whole job. Drop `group`, or launch without that config.")
    if group is not None:
        if spec is not None:
            raise ValueError("`group` and `placement` are mutually exclusive: a placement builds its own process "
                             "groups. Drop `group` (it runs co-located PPO inside a sub-group of a larger job).")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return PlacementSetup(plan=PlacementPlan.colocated(world), rank=rank, role_groups=None, training_group=group,
                              shards_per_rank=1, ranks_per_node=None)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    plan = resolve_plan(apply_launch_engine(resolve_plan(spec, world, args), launch), world, args)
    issues = equivalence_issues(args, plan)
    if issues and strict_equivalence:
        raise ValueError(f"placement '{plan.strategy}' would not compute the co-located update: "
                         + "; ".join(issues) + ".")
    for issue in issues:
        logger.info("placement %s: not bit-for-bit the co-located update: %s", plan.strategy, issue)
    role_groups = build_role_groups(plan, timeout_s=args.placement_timeout_s) if world > 1 else None
    training_group, shards = None, 1
    if plan.is_disaggregated:
        side = sorted(plan.roles["actor"]) if rank in plan.roles["actor"] else sorted(plan.roles["rollout"])
        training_group = role_groups.group_for_ranks(side)
        # a trainer takes world / #trainers co-located shards; inference ranks generate shards round-robin
        shards = world // len(side) if rank in plan.roles["actor"] else 1
    local = launch.paro_group_size or os.environ.get("LOCAL_WORLD_SIZE")
    return PlacementSetup(plan=plan, rank=rank, role_groups=role_groups, training_group=training_group,
                          shards_per_rank=shards, ranks_per_node=int(local) if local else None)
