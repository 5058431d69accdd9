"""The placement set-up behind ``PPOTrainer(..., placement=...)``: plan resolution, role groups, executor.

`PPOTrainer` calls `prepare_placement` before its distributed set-up (the plan decides which process group a rank's
data-parallel collectives use and how large its batch is) and `attach_placement` once its models exist (dropping the
models a rank does not own and creating the executor, `trl_trainers.placement.executors`). The trainer keeps its
interface (``train()``, logging, checkpoints, callbacks) and hands each iteration to the executor. Batch arithmetic is
always the co-located one: the global batch is ``per_device_train_batch_size * gradient_accumulation_steps *
world_size`` whatever the placement, so switching the strategy changes where things run, not what is learned (see
`equivalence_issues` for the exact conditions).

What each rank holds:

- colocated: policy, value model, reference and reward model on every rank;
- interleaved: policy and value model on every rank; the reference only on its owners, the reward model only on its
  owners (other ranks drop their references to those models after construction);
- disaggregated: training ranks hold policy + value model + optimizer and drop reference and reward; inference ranks
  hold the shadow policy and shadow value model (overwritten by every weight sync), the reference and the reward.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from transformers.utils import logging

from hf_placement import PlacementPlan, build_role_groups

from .._distributed import init_distributed_from_env
from ..ppo_config import PPOConfig
from ..ppo_trainer import PPOTrainer
from .executors import make_executor

__all__ = ["PlacedPPOTrainer", "PlacementSetup", "attach_placement", "equivalence_issues", "prepare_placement",
           "resolve_plan"]

logger = logging.get_logger(__name__)


def resolve_plan(placement: str | PlacementPlan | dict | None, world_size: int,
                 args: PPOConfig | None = None) -> PlacementPlan:
    """A validated plan for ``world_size`` ranks from a plan, a strategy name, a plan dict or a YAML/JSON path
    (with ``placement_ratios`` / ``rollout_replicas`` taken from ``args`` when given)."""
    extra: dict[str, Any] = {}
    if args is not None and isinstance(placement, str):
        extra = {"placement_ratios": args.placement_ratios, "rollout_replicas": args.rollout_replicas}
    plan = PlacementPlan.from_ppo_config_fields(placement, world_size=world_size, **extra)
    roles = plan.roles
    everyone = list(range(world_size))
    if plan.is_disaggregated:
        infer = sorted(roles["rollout"])
        for role in ("value", "ref", "reward"):
            if sorted(roles[role]) != infer:
                raise ValueError(
                    f"disaggregated PPO needs roles 'rollout', 'value', 'ref' and 'reward' on the same inference "
                    f"ranks (they score each shard where it was generated); got rollout={infer}, "
                    f"{role}={sorted(roles[role])}. Use PlacementPlan.disaggregated(world, train_ranks=..., "
                    "infer_ranks=...).")
        if sorted(roles["critic"]) != sorted(roles["actor"]):
            raise ValueError(f"actor ranks {sorted(roles['actor'])} and critic ranks {sorted(roles['critic'])} "
                             "differ; this PPOTrainer trains policy and value model with one optimizer, so both "
                             "must live on the same training ranks.")
        if world_size % len(roles["actor"]):
            raise ValueError(f"{len(roles['actor'])} training ranks do not divide world_size={world_size}: each "
                             "trainer takes world_size / #trainers co-located shards. Pick a divisor of the world.")
    else:
        for role in ("actor", "critic"):
            if sorted(roles[role]) != everyone:
                raise ValueError(f"role '{role}' is on ranks {sorted(roles[role])}; colocated and interleaved PPO "
                                 f"train data-parallel on all {world_size} ranks. Put '{role}' on every rank, or use "
                                 "a disaggregated plan (separate training and inference ranks).")
    return plan


def equivalence_issues(args: PPOConfig, plan: PlacementPlan, max_staleness: int = 0) -> list[str]:
    """Why ``plan`` would not compute exactly the co-located update for ``args`` (empty list: it does).

    Co-located and interleaved share the data-parallel training split, so they are always equivalent. A
    disaggregated plan trains the global batch on fewer ranks; mini-batches stay the same because `PPOTrainer`
    shuffles each co-located shard with a key of its global index, and micro-batches never cross shards, so only
    the summation order of gradients differs (fp32 round-off) unless a per-micro-batch loss mean meets responses of
    different lengths.
    """
    if not plan.is_disaggregated:
        return []
    issues = []
    if max_staleness:
        issues.append(f"max_staleness={max_staleness}: batches are generated with weights one update old "
                      "(one-step off-policy); use max_staleness=0 for the synchronous update")
    if args.loss_normalization != "mini_batch" and (args.stop_token is not None or args.stop_token_id is not None):
        issues.append("loss_normalization='micro_batch' with a stop token: per-micro-batch loss means depend on how "
                      "rows of different lengths are grouped; use loss_normalization='mini_batch'")
    return issues


@dataclass
class PlacementSetup:
    """What `prepare_placement` decided for this rank, handed to `attach_placement`."""

    plan: PlacementPlan
    args: PPOConfig
    group: Any
    role_groups: Any
    shards_per_rank: int


def prepare_placement(args: PPOConfig, placement: str | PlacementPlan | dict,
                      strict_equivalence: bool = False) -> PlacementSetup:
    """Resolve and validate the plan for this job and build its role groups (collective: same order on all ranks).

    A disaggregated side runs `PPOTrainer`'s collectives inside its own group, over a batch scaled so that the global
    batch stays ``per_device_train_batch_size * gradient_accumulation_steps * world_size``: a rank of a side with
    ``n`` ranks holds ``world_size / n`` co-located shards (``args`` is copied, never mutated, in that case).
    """
    init_distributed_from_env(timeout_s=float(args.ddp_timeout))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    plan = resolve_plan(placement, world, args)
    if args.max_staleness and not plan.is_disaggregated:
        raise ValueError(f"max_staleness={args.max_staleness} needs placement='disaggregated' (generation on other "
                         f"ranks than training); got a {plan.strategy} plan. Use max_staleness=0.")
    issues = equivalence_issues(args, plan, args.max_staleness)
    if issues and strict_equivalence:
        raise ValueError(f"placement '{plan.strategy}' would not compute the co-located update: "
                         + "; ".join(issues) + ".")
    for issue in issues:
        logger.info("placement %s: not bit-for-bit the co-located update: %s", plan.strategy, issue)
    role_groups = build_role_groups(plan, timeout_s=args.placement_timeout_s) if world > 1 else None
    group, shards = None, 1
    if plan.is_disaggregated:
        side = sorted(plan.roles["actor"]) if rank in plan.roles["actor"] else sorted(plan.roles["rollout"])
        if world % len(side):
            raise ValueError(f"the {len(side)} inference ranks {side} do not divide world_size={world}; the global "
                             "batch is cut into world_size shards shared equally. Pick a divisor.")
        group = role_groups.group_for_ranks(side)
        shards = world // len(side)
        args = copy.deepcopy(args)
        args.gradient_accumulation_steps *= shards
    return PlacementSetup(plan=plan, args=args, group=group, role_groups=role_groups, shards_per_rank=shards)


def attach_placement(trainer: PPOTrainer, setup: PlacementSetup) -> None:
    """Drop the frozen models this rank does not own and create the plan's executor on a constructed trainer."""
    plan = setup.plan
    rank = dist.get_rank() if dist.is_initialized() else 0
    owns = set(plan.roles_of(rank))
    if "ref" not in owns and trainer.ref_model is not None:
        trainer.ref_model = None  # held only by its owners
    if "reward" not in owns:
        trainer.reward_model = None
    if plan.is_disaggregated and rank not in plan.roles["actor"]:
        # Shadows never take an optimizer step, yet the training loop steps the LR scheduler every iteration (to
        # report the trainer's LR); tell torch that is intended instead of warning about the call order.
        trainer.optimizer._opt_called = True
    args = trainer.args
    trainer.executor = make_executor(trainer, plan, args.placement_timeout_s, setup.role_groups,
                                     weight_sync=args.weight_sync, max_staleness=args.max_staleness)


class PlacedPPOTrainer(PPOTrainer):
    """`PPOTrainer` with the placement settings as keyword arguments (kept for callers of the first API).

    Equivalent to ``PPOTrainer(..., placement=placement)`` with ``placement_timeout_s``, ``weight_sync`` and
    ``max_staleness`` set on (a copy of) ``args``; ``placement=None`` means ``"colocated"``.
    """

    def __init__(self, args: PPOConfig, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None,
                 placement: str | PlacementPlan | dict | None = None, placement_timeout_s: float = 300.0,
                 weight_sync: str = "broadcast", strict_equivalence: bool = False, max_staleness: int = 0) -> None:
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a trl_trainers.PPOConfig, got {type(args).__name__}.")
        if placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s={placement_timeout_s} must be positive (seconds).")
        if max_staleness not in (0, 1):
            raise ValueError(f"max_staleness={max_staleness!r}: use 0 (synchronous PPO) or 1 (one-step off-policy).")
        if weight_sync not in ("broadcast", "bucketed_p2p"):
            raise ValueError(f"weight_sync={weight_sync!r} is not supported: use 'broadcast' or 'bucketed_p2p'.")
        args = copy.copy(args)
        args.placement_timeout_s, args.weight_sync, args.max_staleness = float(placement_timeout_s), weight_sync, \
            int(max_staleness)
        super().__init__(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                         data_collator=data_collator, eval_dataset=eval_dataset, optimizers=optimizers,
                         callbacks=callbacks, peft_config=peft_config,
                         placement="colocated" if placement is None else placement,
                         strict_equivalence=strict_equivalence)
