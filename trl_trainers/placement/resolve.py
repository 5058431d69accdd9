"""From a `PPOConfig`'s placement fields to a plan this PPO trainer can run, validated once.

`plan_from_config` turns the fields (a strategy name, a plan file, a plan dict or a `hf_placement.PlacementPlan`, with
``placement_ratios`` / ``rollout_replicas``) into a plan; `resolve_plan` adds the checks that belong to *this*
trainer (policy and value model trained data-parallel on every rank unless disaggregated, the inference roles of a
disaggregated plan on one rank set, sharded roles the PaRO engine can run, ``max_staleness`` only where generation
runs apart from training). The options themselves (``max_staleness`` in {0, 1}, ``weight_sync``, timeouts) are
validated by `PPOConfig` against themselves; here only against the plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf_placement import PlacementPlan
from paro_zero_backend import parse_strategy

from ..launch_engine import LaunchEngine
from ..ppo_config import PPOConfig
from .sharding import TRAINED, sharding_error

__all__ = ["apply_launch_engine", "equivalence_issues", "plan_from_config", "resolve_plan"]

PLACEMENT_NAMES = ("colocated", "interleaved", "disaggregated")


def _parse_ratios(ratios: Mapping[str, float] | str | None) -> dict[str, float] | None:
    if ratios is None or ratios == "":
        return None
    if isinstance(ratios, Mapping):
        return {str(k): float(v) for k, v in ratios.items()}
    if isinstance(ratios, str):
        out = {}
        for item in ratios.split(","):
            if "=" not in item:
                raise ValueError(f"placement_ratios={ratios!r}: expected 'role=ratio' items separated by commas, "
                                 "e.g. 'ref=0.5,reward=0.5'.")
            k, v = item.split("=", 1)
            try:
                out[k.strip()] = float(v)
            except ValueError:
                raise ValueError(f"placement_ratios={ratios!r}: {v!r} is not a number.") from None
        return out
    raise TypeError(f"placement_ratios must be a dict or a 'role=ratio,...' string, got {type(ratios).__name__}.")


def plan_from_config(placement: str | PlacementPlan | Mapping[str, Any] | None, world_size: int,
                     placement_ratios: Mapping[str, float] | str | None = None, rollout_replicas: int = 1,
                     train_ranks: Sequence[int] | None = None,
                     infer_ranks: Sequence[int] | None = None) -> PlacementPlan:
    """A plan for ``world_size`` ranks from the placement fields of a `PPOConfig`.

    ``placement`` is a strategy name, a path to a ``.yaml``/``.yml``/``.json`` plan file, a plan dict or a plan
    (``None``: co-located). ``placement_ratios`` (interleaved) may be a dict or a CLI string
    ``"ref=0.5,reward=0.5"``. A plan loaded from a file or dict must have ``world_size`` equal to the job's.
    """
    if placement is None:
        placement = "colocated"
    if isinstance(placement, PlacementPlan):
        plan = placement
    elif isinstance(placement, Mapping):
        plan = PlacementPlan.from_dict(placement)
    elif isinstance(placement, str) and placement.lower().endswith((".yaml", ".yml", ".json")):
        plan = PlacementPlan.load(placement)
    elif isinstance(placement, str):
        name = placement.strip().lower()
        ratios = _parse_ratios(placement_ratios)
        if name not in PLACEMENT_NAMES:
            raise ValueError(f"placement={placement!r} is not a strategy {PLACEMENT_NAMES} nor a path to a "
                             ".yaml/.yml/.json plan file.")
        if ratios and name != "interleaved":
            raise ValueError(f"placement_ratios={placement_ratios!r} only applies to placement='interleaved', "
                             f"got placement={placement!r}. Drop placement_ratios or switch the strategy.")
        if name != "disaggregated" and (train_ranks is not None or infer_ranks is not None):
            raise ValueError("train_ranks/infer_ranks only apply to placement='disaggregated'.")
        if name != "disaggregated" and rollout_replicas != 1:
            raise ValueError(f"rollout_replicas={rollout_replicas} only applies to placement='disaggregated' "
                             f"(placement={placement!r} generates with the actor itself). Set it to 1.")
        if name == "colocated":
            plan = PlacementPlan.colocated(world_size)
        elif name == "interleaved":
            plan = PlacementPlan.interleaved(world_size, ratios=ratios)
        else:
            plan = PlacementPlan.disaggregated(world_size, train_ranks=train_ranks, infer_ranks=infer_ranks,
                                               rollout_replicas=rollout_replicas)
    else:
        raise TypeError(f"placement must be a strategy name, a plan file path, a dict or a PlacementPlan, got "
                        f"{type(placement).__name__}.")
    plan.check_world_size(world_size)
    return plan


def resolve_plan(placement: str | PlacementPlan | Mapping[str, Any] | None, world_size: int,
                 args: PPOConfig | None = None) -> PlacementPlan:
    """A validated plan for ``world_size`` ranks that this PPO trainer can run (errors name the fix).

    With ``args``, its ``placement_ratios`` / ``rollout_replicas`` shape a plan given by name, and its
    ``max_staleness`` is checked against the plan.
    """
    extra: dict[str, Any] = {}
    if args is not None and isinstance(placement, str):
        extra = {"placement_ratios": args.placement_ratios, "rollout_replicas": args.rollout_replicas}
    plan = plan_from_config(placement, world_size, **extra)
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
    problem = sharding_error(plan)
    if problem:
        raise ValueError(problem)
    if args is not None and "actor" in plan.sharded_roles and not args.ds3_gather_for_generation:
        raise NotImplementedError(
            "ds3_gather_for_generation=False with a sharded actor is not supported: ranks stop sampling at different "
            "decode steps, so per-forward parameter gathers would not match across the actor's ranks. Keep "
            "ds3_gather_for_generation=True (one gather of the policy per rollout).")
    if args is not None and args.max_staleness and not plan.is_disaggregated:
        raise ValueError(f"max_staleness={args.max_staleness} needs placement='disaggregated' (generation on other "
                         f"ranks than training); got a {plan.strategy} plan. Use max_staleness=0.")
    return plan


def apply_launch_engine(plan: PlacementPlan, launch: LaunchEngine) -> PlacementPlan:
    """The plan as the launched engine trains it (errors name the key to change).

    - PaRO config: policy and value model are sharded with its strategy on their ranks, and so are the frozen
      reference and reward model when the strategy partitions parameters (a plan that already shards a role with
      another strategy conflicts with the launch);
    - DeepSpeed / FSDP2: they shard over the whole world, so only the co-located plan (without sharded roles of its
      own) runs under them;
    - a plain or DDP launch: the plan as it is.
    """
    if launch.kind == "replicated":
        return plan
    if launch.is_accelerate_engine:
        engine = "DeepSpeed" if launch.kind == "deepspeed" else "FSDP2"
        if plan.strategy != "colocated" or plan.sharded_roles:
            what = f"placement '{plan.strategy}'" + (f" with sharded_roles {dict(plan.sharded_roles)}"
                                                     if plan.sharded_roles else "")
            raise ValueError(f"{what} conflicts with the launched engine: the accelerate config runs {engine} "
                             f"({launch.source}), which shards the models over every rank of the job. Drop "
                             "`placement` (co-located, as TRL), or launch a PaRO config with a plain multi-process "
                             "accelerate config to combine a placement with sharded roles "
                             "(PARO_CONFIG_FILE=paro.yaml accelerate launch --config_file multi_gpu.yaml ...).")
        return plan
    strategy = str(launch.paro_strategy)
    wanted = dict.fromkeys(TRAINED, strategy)
    if parse_strategy(strategy).partitions_params:
        wanted.update({role: strategy for role in ("ref", "reward") if role in plan.roles})
    clash = {r: s for r, s in plan.sharded_roles.items() if wanted.get(r, s) != s}
    if clash:
        raise ValueError(f"the plan shards {clash} while the launched PaRO config trains with strategy {strategy} "
                         f"({launch.source}). Drop sharded_roles from the plan (the launch decides), or set the "
                         "PaRO config's strategy to the plan's.")
    data = plan.to_dict()
    data["sharded_roles"] = {**wanted, **plan.sharded_roles}
    merged = PlacementPlan.from_dict(data)
    problem = sharding_error(merged)
    if problem:
        raise ValueError(f"{problem} (from the launched PaRO config: {launch.source})")
    return merged


def equivalence_issues(args: PPOConfig, plan: PlacementPlan, max_staleness: int | None = None) -> list[str]:
    """Why ``plan`` would not compute exactly the co-located update for ``args`` (empty list: it does).

    Co-located and interleaved share the data-parallel training split, so they are always equivalent. A
    disaggregated plan trains the global batch on fewer ranks; mini-batches stay the same because the trainer
    shuffles each co-located shard with a key of its global index, and micro-batches never cross shards, so only
    the summation order of gradients differs (fp32 round-off) unless a per-micro-batch loss mean meets responses of
    different lengths. Sharded roles change only the summation order of gradient reductions (fp32 round-off).
    """
    staleness = args.max_staleness if max_staleness is None else max_staleness
    if not plan.is_disaggregated:
        return []
    issues = []
    if staleness:
        issues.append(f"max_staleness={staleness}: batches are generated with weights one update old "
                      "(one-step off-policy); use max_staleness=0 for the synchronous update")
    if args.loss_normalization != "mini_batch" and (args.stop_token is not None or args.stop_token_id is not None):
        issues.append("loss_normalization='micro_batch' with a stop token: per-micro-batch loss means depend on how "
                      "rows of different lengths are grouped; use loss_normalization='mini_batch'")
    return issues
