"""`PlacedPPOTrainer`: `PPOTrainer` plus ``placement=`` (a `PlacementPlan`, a strategy name or a YAML/JSON plan file).

The trainer keeps `PPOTrainer`'s interface (``train()``, logging, checkpoints, callbacks) and hands each iteration to
the executor of the plan (`trl_trainers.placement.executors`). Batch arithmetic is always the co-located one: the
global batch is ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` whatever the placement, so
switching the strategy changes where things run, not what is learned (see `equivalence_issues` for the exact
conditions).

What each rank holds:

- colocated: policy, value model, reference and reward model on every rank;
- interleaved: policy and value model on every rank; the reference only on its owners, the reward model only on its
  owners (other ranks drop their references to those models after construction);
- disaggregated: training ranks hold policy + value model + optimizer and drop reference and reward; inference ranks
  hold the shadow policy and shadow value model (overwritten by every weight sync), the reference and the reward.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from transformers.utils import logging

from hf_placement import PlacementPlan, build_role_groups, gather_timelines

from .._distributed import init_distributed_from_env
from ..ppo_config import PPOConfig
from ..ppo_trainer import Experience, PPOTrainer
from .executors import DisaggregatedExecutor, InterleavedExecutor, make_executor

__all__ = ["PlacedPPOTrainer", "equivalence_issues", "resolve_plan"]

logger = logging.get_logger(__name__)


def resolve_plan(placement: str | PlacementPlan | dict | None, world_size: int) -> PlacementPlan:
    """A validated plan for ``world_size`` ranks from a plan, a strategy name, a plan dict or a YAML/JSON path."""
    plan = PlacementPlan.from_ppo_config_fields(placement, world_size=world_size)
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
    disaggregated plan trains the global batch on fewer ranks, which changes (1) which rows form a mini-batch, since
    `PPOTrainer` shuffles per rank, and (2) how rows are grouped into micro-batches.
    """
    if not plan.is_disaggregated:
        return []
    issues = []
    if max_staleness:
        issues.append(f"max_staleness={max_staleness}: batches are generated with weights one update old "
                      "(one-step off-policy); use max_staleness=0 for the synchronous update")
    if args.num_mini_batches > 1:
        issues.append(f"num_mini_batches={args.num_mini_batches}: PPOTrainer shuffles each rank's rows into "
                      "mini-batches, so fewer training ranks form different mini-batches; use num_mini_batches=1 "
                      "for an exactly equivalent update")
    if args.loss_normalization != "mini_batch" and (args.stop_token is not None or args.stop_token_id is not None):
        issues.append("loss_normalization='micro_batch' with a stop token: per-micro-batch loss means depend on how "
                      "rows of different lengths are grouped; use loss_normalization='mini_batch'")
    return issues


class PlacedPPOTrainer(PPOTrainer):
    """`PPOTrainer` whose iterations run under a placement plan.

    Args (beyond `PPOTrainer`'s):
        placement (`PlacementPlan`, `str` or `dict`, *optional*, defaults to `"colocated"`): the plan, a strategy
            name (``"colocated"``, ``"interleaved"``, ``"disaggregated"``), a path to a ``.yaml``/``.json`` plan or a
            plan dict. Its ``world_size`` must equal the job's.
        placement_timeout_s (`float`, *optional*, defaults to 300): timeout of every transfer and collective of the
            placement (experience channels, owner dispatch, weight sync, role groups). A dead or stalled peer turns
            into a `PlacementError` naming it within this time.
        weight_sync (`str`, *optional*, defaults to `"broadcast"`): disaggregated trainer -> shadow transport,
            ``"broadcast"`` or ``"bucketed_p2p"``.
        strict_equivalence (`bool`, *optional*, defaults to `False`): raise if the configuration cannot compute
            exactly the co-located update (see `equivalence_issues`) instead of logging it.
        max_staleness (`int`, *optional*, defaults to 0): 1 makes a disaggregated run one-step off-policy: the
            inference ranks generate batch ``u + 1`` while the trainers train on batch ``u`` (not the co-located
            update by design).

    Example (under ``torchrun --nproc_per_node 2``):

    ```python
    trainer = PlacedPPOTrainer(args, tok, policy, None, reward, train_ds, value, placement="disaggregated")
    trainer.train()
    trainer.timeline            # this rank's phases; gather_timeline() collects every rank's
    ```
    """

    def __init__(self, args: PPOConfig, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None,
                 placement: str | PlacementPlan | dict | None = None, placement_timeout_s: float = 300.0,
                 weight_sync: str = "broadcast", strict_equivalence: bool = False, max_staleness: int = 0) -> None:
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a trl_trainers.PPOConfig, got {type(args).__name__}.")
        if placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s={placement_timeout_s} must be positive (seconds).")
        init_distributed_from_env(timeout_s=float(args.ddp_timeout))
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        plan = resolve_plan(placement, world)
        if max_staleness not in (0, 1):
            raise ValueError(f"max_staleness={max_staleness!r}: use 0 (synchronous PPO) or 1 (one-step off-policy).")
        if max_staleness and not plan.is_disaggregated:
            raise ValueError(f"max_staleness={max_staleness} needs placement='disaggregated' (generation on other "
                             f"ranks than training); got a {plan.strategy} plan. Use max_staleness=0.")
        issues = equivalence_issues(args, plan, max_staleness)
        if issues and strict_equivalence:
            raise ValueError(f"placement '{plan.strategy}' would not compute the co-located update: "
                             + "; ".join(issues) + ".")
        for issue in issues:
            logger.info("placement %s: not bit-for-bit the co-located update: %s", plan.strategy, issue)
        self.plan = plan
        self.placement_timeout_s = float(placement_timeout_s)
        self.placement_local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.role_groups = build_role_groups(plan, timeout_s=placement_timeout_s) if world > 1 else None
        group = None
        if plan.is_disaggregated:
            # Each side runs PPOTrainer's collectives inside its own group, over a batch scaled so that the global
            # batch stays local_batch * world_size.
            side = sorted(plan.roles["actor"]) if rank in plan.roles["actor"] else sorted(plan.roles["rollout"])
            if world % len(side):
                raise ValueError(f"the {len(side)} inference ranks {side} do not divide world_size={world}; the "
                                 "global batch is cut into world_size shards shared equally. Pick a divisor.")
            group = self.role_groups.group_for_ranks(side)
            args = copy.deepcopy(args)
            args.gradient_accumulation_steps *= world // len(side)
        super().__init__(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                         data_collator=data_collator, eval_dataset=eval_dataset, optimizers=optimizers,
                         callbacks=callbacks, peft_config=peft_config, group=group)
        owns = set(plan.roles_of(rank))
        if "ref" not in owns and self.ref_model is not None:
            self.ref_model = None  # held only by its owners
        if "reward" not in owns:
            self.reward_model = None
        if plan.is_disaggregated and rank not in plan.roles["actor"]:
            # Shadows never take an optimizer step, yet the training loop steps the LR scheduler every iteration (to
            # report the trainer's LR); tell torch that is intended instead of warning about the call order.
            self.optimizer._opt_called = True
        self.executor = make_executor(self, plan, placement_timeout_s, self.role_groups, weight_sync=weight_sync,
                                      max_staleness=max_staleness)

    # ------------------------------------------------------------------ placement views
    @property
    def timeline(self):
        """This rank's `hf_placement.Timeline` (phases of every iteration so far)."""
        return self.executor.timeline

    def gather_timeline(self) -> list:
        """Every rank's timeline, on every rank (collective over the world)."""
        return gather_timelines(self.timeline)

    @property
    def is_training_rank(self) -> bool:
        """Whether this rank holds the optimizer and produces the update (all ranks unless disaggregated)."""
        return self.executor.is_trainer

    # ------------------------------------------------------------------ iteration
    def training_iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        """One iteration scheduled by the placement executor; per-phase seconds from this rank's timeline."""
        first = len(self.timeline.events)
        exp, stats = self.executor.iteration(update)
        timings: dict[str, float] = defaultdict(float)
        for ev in self.timeline.events[first:]:
            timings[ev.phase] += ev.duration
        self.last_timings = dict(timings)
        self.phase_history.append(self.last_timings)
        for k, v in self.last_timings.items():
            self.timings[k] += v
        return exp, stats

    def train(self, resume_from_checkpoint: str | bool | None = None):
        state = super().train(resume_from_checkpoint=resume_from_checkpoint)
        self.executor.finish(self.state.global_step + 1)
        return state

    def _metrics(self, exp, stats, start_time):
        if exp is None:  # a disaggregated inference rank: it produced experience, the trainers report on it
            return {"lr": self.lr_scheduler.get_last_lr()[0], "episode": self.state.episode}
        return super()._metrics(exp, stats, start_time)

    def _save_checkpoint(self) -> str:
        if not self.is_training_rank:  # shadows are refreshed from the trainer; nothing of their own to save
            return os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        return super()._save_checkpoint()

    def _completion_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        if isinstance(self.executor, InterleavedExecutor):  # only the reward owners hold the reward model
            ex = self.executor
            return ex.reward_handle.call(ex._reward_fn, {"queries": queries, "responses": responses})
        return super()._completion_scores(queries, responses)

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> dict[str, list] | None:
        """Completions on the eval set. Disaggregated: generated by the inference ranks with the shadow policy (the
        weights of the last sync); ``None`` on training ranks. Interleaved: scores come from the reward owners."""
        if self.eval_dataset is not None and isinstance(self.executor, DisaggregatedExecutor):
            return super().generate_completions(sampling) if self.executor.is_inference else None
        return super().generate_completions(sampling)
