"""``PPOTrainer``: TRL 1.12's PPO trainer interface (actor, critic, reward and reference model), clean-room.

The trainer reads top to bottom: `__init__` is a fixed sequence of named set-up steps, `train` is TRL's loop
(callbacks, logging, checkpoints), and every iteration runs through a placement executor
(`trl_trainers.placement`; co-located, TRL's layout, by default) that schedules the phases of
`trl_trainers.PPOPhases` (generation, scoring, experience, training) on the ranks of its plan.

Differences from TRL 1.12 that only show on several ranks, and why: advantage (and reward) whitening statistics are
reduced over all ranks, sampling noise is keyed by the sample's global position, and the prompt order is a global
permutation split by rank. Together they make N ranks compute exactly the update one process computes on the same
global batch (TRL whitens per rank). On one process the algorithm is TRL's.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
)
from transformers.utils import logging

from hf_placement import release_process_groups_at_exit

from . import ppo_math as pm
from ._distributed import DistContext, init_distributed_from_env
from .batch_layout import BatchLayout, compute_batch_layout
from .launch_engine import LaunchEngine, launch_engine_from_env
from .placement import PlacementContext, PlacementSetup, RoleSharding, make_executor, prepare_placement
from .ppo_config import PPOConfig
from .ppo_phases import Experience, PolicyAndValueWrapper, PPOModels, PPOPhases, Rollout
from .training_backend import ReplicatedBackend, TrainingBackend, adamw_factory

__all__ = ["OnlineTrainerState", "PPOTrainer"]

logger = logging.get_logger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
_TRAINING_STATE = "ppo_training_state.safetensors"


@dataclass
class OnlineTrainerState(TrainerState):
    """``TrainerState`` plus the number of episodes (prompts) consumed so far, as in TRL."""

    episode: int = 0


def _disable_dropout(module: nn.Module | None) -> None:
    if module is None:
        return
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0


def _check_dataset(dataset, name: str) -> None:
    columns = getattr(dataset, "column_names", None)
    if columns is None and len(dataset) > 0:
        columns = list(dataset[0].keys())
    if not columns or "input_ids" not in columns:
        raise ValueError(
            f"{name} has no `input_ids` column (columns: {columns}). PPOTrainer expects pre-tokenised prompts: "
            "map your text column through the tokenizer first, e.g. "
            "dataset.map(lambda x: {'input_ids': tokenizer(x['prompt'])['input_ids']}, "
            "remove_columns=dataset.column_names)."
        )


class PPOTrainer:
    """PPO for causal LMs with a reward model and a value model; drop-in for ``trl.experimental.ppo.PPOTrainer``.

    Args mirror TRL 1.12: ``model`` (policy), ``ref_model`` (``None``: a frozen copy, or with PEFT the
    adapter-disabled policy), ``reward_model`` and ``value_model`` (sequence classifiers with ``score`` head),
    ``train_dataset`` with an ``input_ids`` column, optional ``eval_dataset`` for :meth:`generate_completions`.
    ``group`` (ours) runs co-located PPO inside a process sub-group.

    ``placement`` (ours, FlexRLHF): where the four models run. A `hf_placement.PlacementPlan`, a strategy name
    (``"colocated"``, ``"interleaved"``, ``"disaggregated"``), a path to a ``.yaml``/``.json`` plan or a plan dict; when
    omitted, ``args.placement`` (with ``args.placement_ratios`` / ``args.rollout_replicas``); when both are ``None``,
    co-located. Transfers time out after ``args.placement_timeout_s``; a disaggregated plan syncs weights with
    ``args.weight_sync`` and may run one step off-policy (``args.max_staleness=1``). With staleness 0 every
    placement computes the co-located update (see `trl_trainers.placement.equivalence_issues`;
    ``strict_equivalence=True`` raises instead of logging when a configuration cannot). A plan's ``sharded_roles``
    are sharded over their ranks by the PaRO engine (``"GGG"`` = ZeRO-3 by default, any PaRO strategy per role).

    Engine: the one the launch names (`trl_trainers.launch_engine_from_env`), as TRL's prepare did through
    Accelerate. An accelerate config with DeepSpeed trains on DeepSpeed ZeRO-0..3, with reference and reward as
    ZeRO-3 inference engines under stage 3; FSDP trains on FSDP2; a PaRO config (``PARO_CONFIG_FILE`` /
    ``PARO_STRATEGY``) shards the plan's roles with its strategy. A plain or data-parallel launch keeps full models
    with one averaged gradient per step.
    """

    _tag_names = ["trl", "ppo"]
    _name = "PPO"

    def __init__(
        self,
        args: PPOConfig,
        processing_class,
        model: nn.Module,
        ref_model: nn.Module | None,
        reward_model: nn.Module,
        train_dataset,
        value_model: nn.Module,
        data_collator=None,
        eval_dataset=None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        group=None,
        placement=None,
        strict_equivalence: bool = False,
    ) -> None:
        # 1. inputs, checked before anything is built
        self._check_inputs(args, processing_class, model, ref_model, reward_model, value_model, train_dataset,
                           eval_dataset)
        self.processing_class = processing_class
        self.pad_token_id = int(processing_class.pad_token_id)
        self.stop_token_id = processing_class.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        self.train_dataset, self.eval_dataset, self.data_collator = train_dataset, eval_dataset, data_collator
        # 2. where things run: the plan, its process groups, this rank's side (collective)
        init_distributed_from_env(timeout_s=float(args.ddp_timeout))
        release_process_groups_at_exit()  # TRL scripts end without destroying their groups (hf_placement.lifecycle)
        self.launch: LaunchEngine = launch_engine_from_env()
        self.placement: PlacementSetup = prepare_placement(args, placement, group, strict_equivalence,
                                                           launch=self.launch)
        self.plan = self.placement.plan
        self.dist = DistContext(self.placement.training_group)
        # 3. batch sizes (pure), and the trainer's copy of the config with TRL's runtime fields filled
        self.layout: BatchLayout = compute_batch_layout(
            args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches,
            self.plan.world_size, len(train_dataset), args.total_episodes, args.num_train_epochs,
            self.placement.shards_per_rank)
        self._check_layout(args, self.layout)
        self.args = self._runtime_args(args, self.layout)
        self.sample_generations_freq = max(1, self.layout.num_total_batches // max(1, args.num_sample_generations))
        # 4. this rank's models: PEFT, the reference, dropout off, device, the roles this rank does not own dropped
        self.device = self._pick_device(args)
        models = self._prepare_models(model, ref_model, reward_model, value_model, peft_config)
        # 5. sharded roles on the PaRO engine (collective), then the training backend (optimizer, gradient sync)
        self.sharding = RoleSharding(self.plan, args.placement_timeout_s, self.placement.ranks_per_node,
                                     self.placement.rank)
        if self.plan.sharded_roles and models.is_peft_model:
            raise ValueError("sharded roles with a PEFT (LoRA) policy are not supported: the adapter-disabled policy "
                             "serves as reference. Use an unsharded plan with LoRA.")
        self.backend: TrainingBackend = self._build_backend(models.model, optimizers[0])
        if self.launch.is_accelerate_engine:  # DeepSpeed / FSDP2: frozen models prepared for inference as TRL did
            models.ref_model = self.ref_model = self.backend.prepare_frozen(models.ref_model)
            models.reward_model = self.reward_model = self.backend.prepare_frozen(models.reward_model)
        else:
            self.sharding.shard_frozen("ref", models.ref_model)
            self.sharding.shard_frozen("reward", models.reward_model)
        self.optimizer = self.backend.optimizer
        self.lr_scheduler = optimizers[1] if optimizers[1] is not None else self._build_scheduler()
        # 6. the phase pipeline over those models, and the executor that schedules it on the plan
        self.phases = PPOPhases(self.args, self.layout, models, self.dist, self.backend, self.pad_token_id,
                                processing_class.eos_token_id, self.stop_token_id, self.device, train_dataset,
                                data_collator, pin_weights=self._pin_weights, all_finished=self._stop_sync())
        self.executor = make_executor(self.phases, PlacementContext(
            plan=self.plan, rank=self.placement.rank, role_groups=self.placement.role_groups, sharding=self.sharding,
            timeout_s=args.placement_timeout_s, weight_sync=args.weight_sync, max_staleness=args.max_staleness,
            num_total_batches=self.layout.num_total_batches))
        # 7. callbacks, state and the output folder (TRL's Trainer plumbing)
        self._init_callbacks_and_state(callbacks)

    # ------------------------------------------------------------------ set-up steps
    @staticmethod
    def _check_inputs(args, processing_class, model, ref_model, reward_model, value_model, train_dataset,
                      eval_dataset) -> None:
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a trl_trainers.PPOConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ValueError("train_dataset is required: a dataset with an `input_ids` column of prompt token ids.")
        if ref_model is not None and ref_model is model:
            raise ValueError(
                "`model` and `ref_model` are the same object, so the KL penalty would always be 0 and the reference "
                "would drift with training. Pass a copy (e.g. copy.deepcopy(model)), or ref_model=None to let the "
                "trainer make a frozen copy (or use the adapter-disabled policy with PEFT)."
            )
        if model is None or reward_model is None or value_model is None:
            raise ValueError("`model`, `reward_model` and `value_model` are all required.")
        _check_dataset(train_dataset, "train_dataset")
        if eval_dataset is not None:
            _check_dataset(eval_dataset, "eval_dataset")
        if getattr(processing_class, "pad_token_id", None) is None:
            raise ValueError(
                "The tokenizer (`processing_class`) has no pad token, which PPO needs to left-pad prompts and to mark "
                "the end of responses. Add one, e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and "
                "resize the model embeddings if needed."
            )
        if args.fp16:
            raise ValueError("fp16=True is not supported by this PPOTrainer; use bf16=True or fp32 (bf16=False).")

    @staticmethod
    def _check_layout(args: PPOConfig, layout: BatchLayout) -> None:
        if args.whiten_rewards and layout.local_mini_batch_size < 8:
            raise ValueError(
                f"whiten_rewards=True needs a per-rank mini-batch of at least 8 sequences, got "
                f"local_mini_batch_size={layout.local_mini_batch_size}. Increase the batch or disable whiten_rewards."
            )

    @staticmethod
    def _runtime_args(args: PPOConfig, layout: BatchLayout) -> PPOConfig:
        """A copy of ``args`` with TRL's runtime fields (world_size, batch_size, ...) filled; ``args`` is untouched."""
        runtime = copy.copy(args)
        for name, value in layout.config_fields().items():
            setattr(runtime, name, value)
        return runtime

    @staticmethod
    def _pick_device(args: PPOConfig) -> torch.device:
        if args.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

    def _prepare_models(self, model, ref_model, reward_model, value_model, peft_config) -> PPOModels:
        """PEFT wrapping, the reference (a frozen copy unless PEFT), dropout off, devices; then the frozen models of
        roles this rank does not own are dropped (held only by their owners under a placement)."""
        args = self.args
        if peft_config is not None:
            from peft import PeftConfig, PeftModel, get_peft_model

            if not isinstance(peft_config, PeftConfig):
                raise TypeError(f"peft_config must be a peft.PeftConfig (e.g. LoraConfig), got {type(peft_config)}.")
            if isinstance(model, PeftModel):
                raise ValueError(
                    "A PeftModel was passed together with peft_config. Merge and unload the existing adapter first, "
                    "or pass the base model with peft_config."
                )
            model = get_peft_model(model, peft_config)
        try:
            from peft import PeftModel

            is_peft = isinstance(model, PeftModel)
        except ImportError:
            is_peft = False
        if ref_model is None and not is_peft:
            if self.launch.kind == "deepspeed" and self.launch.zero_stage == 3:
                raise ValueError("ref_model=None under DeepSpeed ZeRO-3: the policy's parameters are partitioned, so "
                                 "the trainer cannot copy it into a reference. Build the reference like the policy "
                                 "(e.g. AutoModelForCausalLM.from_pretrained(sft_model_path)) and pass it as "
                                 "ref_model, or use a PEFT policy (the adapter-disabled policy is the reference).")
            ref_model = copy.deepcopy(model)
        for frozen in (ref_model, reward_model):
            if frozen is not None:
                frozen.requires_grad_(False)
                frozen.eval()
        for module in (model, ref_model, value_model, reward_model):
            _disable_dropout(module)
        wrapper = PolicyAndValueWrapper(model, value_model).to(self.device)
        wrapper.config = getattr(model, "config", None)
        if args.gradient_checkpointing:
            for module in (model, getattr(value_model, value_model.base_model_prefix, None)):
                if module is not None and hasattr(module, "activation_checkpointing_enable"):  # the newer name
                    module.activation_checkpointing_enable(
                        activation_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
                elif module is not None and hasattr(module, "gradient_checkpointing_enable"):
                    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        owns = set(self.plan.roles_of(self.placement.rank))
        ref_model = ref_model.to(self.device) if ref_model is not None and "ref" in owns else None
        reward_model = reward_model.to(self.device) if "reward" in owns else None
        self.model, self.ref_model, self.reward_model = wrapper, ref_model, reward_model
        self.policy_model, self.value_model, self.is_peft_model = model, value_model, is_peft
        return PPOModels(model=wrapper, ref_model=ref_model, reward_model=reward_model, is_peft_model=is_peft)

    def _build_backend(self, model: PolicyAndValueWrapper, optimizer: torch.optim.Optimizer | None
                       ) -> TrainingBackend:
        """The engine the launch names (DeepSpeed, FSDP2), else the PaRO engine when the plan shards actor/critic
        (on their ranks; a PaRO launch config shards them), else full replicas with one flat gradient all-reduce per
        step (TRL's data parallelism)."""
        if self.launch.kind == "deepspeed":
            from .accelerate_backends import DeepSpeedBackend

            if optimizer is None:
                optimizer = adamw_factory(self.args)([p for p in model.parameters() if p.requires_grad])
            logger.info("PPOTrainer trains on DeepSpeed (%s)", self.launch.source)
            return DeepSpeedBackend(model, optimizer, self.args, self.layout)
        if self.launch.kind == "fsdp2":
            from .accelerate_backends import FSDP2Backend

            if optimizer is not None:
                raise ValueError("a custom optimizer cannot be combined with FSDP2: it would hold the unsharded "
                                 "parameters that fully_shard replaces. Let PPOTrainer build AdamW from PPOConfig.")
            logger.info("PPOTrainer trains on FSDP2 (%s)", self.launch.source)
            return FSDP2Backend(model, adamw_factory(self.args), self.args, self.layout,
                                broadcast_module=self.dist.broadcast_module)
        sharded = self.sharding.shard_trained(model, self.args, user_optimizer=optimizer is not None)
        if sharded is not None:
            return sharded
        if optimizer is None:
            optimizer = adamw_factory(self.args)([p for p in model.parameters() if p.requires_grad])
        if not self._trains_here():
            # Shadows never take an optimizer step, yet the loop steps the LR scheduler every iteration (to report
            # the trainer's LR); tell torch that is intended instead of warning about the call order.
            optimizer._opt_called = True
        return ReplicatedBackend(model, optimizer, self.dist)

    def _pin_weights(self, role: str):
        """Full weights of ``role`` for one phase: the launched engine's gathering, or the plan's sharded roles."""
        if self.launch.is_accelerate_engine:
            return self.backend.pin(role)
        return self.sharding.gathered(role)

    def _stop_sync(self):
        """A collective early stop for generation when the policy gathers its weights per forward call (ZeRO-3
        with ``ds3_gather_for_generation=False``): every rank must run the same decode steps."""
        if not (self.launch.kind == "deepspeed" and self.launch.zero_stage == 3
                and not self.args.ds3_gather_for_generation and self.dist.world_size > 1):
            return None
        dist = self.dist

        def all_finished(done: bool) -> bool:
            flag = torch.tensor([1.0 if done else 0.0], device=self.device)
            return bool(dist.all_reduce_sum(flag).item() == dist.world_size)

        return all_finished

    def _trains_here(self) -> bool:
        """Whether this rank trains under the plan (every rank unless it is a disaggregated inference rank)."""
        return self.placement.rank in self.plan.roles["actor"]

    def _build_scheduler(self):
        from transformers import get_scheduler

        args, total = self.args, self.layout.num_total_batches
        return get_scheduler(args.lr_scheduler_type, self.optimizer, num_warmup_steps=args.get_warmup_steps(total),
                             num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs or None)

    def _init_callbacks_and_state(self, callbacks: list[TrainerCallback] | None) -> None:
        args = self.args
        is_zero = self.dist.rank == 0
        default_callbacks = [DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to)]
        self.callback_handler = CallbackHandler(
            default_callbacks + list(callbacks or []), self.model, self.processing_class, self.optimizer,
            self.lr_scheduler,
        )
        self.callback_handler.add_callback(PrinterCallback if args.disable_tqdm else ProgressCallback)
        self.control = TrainerControl()
        self.state = OnlineTrainerState(
            is_local_process_zero=int(os.environ.get("LOCAL_RANK", "0")) == 0 if self.dist.enabled else True,
            is_world_process_zero=is_zero,
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
            ],
        )
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase, summed over iterations
        self.phase_history: list[dict[str, float]] = []  # the same, per iteration
        if args.should_save and is_zero:
            os.makedirs(args.output_dir, exist_ok=True)

    # ------------------------------------------------------------------ the phases (TRL-style entry points)
    def local_batch(self, update: int) -> tuple[torch.Tensor, list[int]]:
        """This rank's left-padded prompts of iteration ``update`` and their per-sample sampling seeds."""
        return self.phases.shard_batch(update, self.dist.rank)

    def rollout(self, queries: torch.Tensor, sample_seeds: list[int], temperature: float | None = None) -> Rollout:
        """Phase 1: sample ``response_length`` tokens per prompt (`PPOPhases.rollout`)."""
        return self.phases.rollout(queries, sample_seeds, temperature)

    def score_rollout(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """The four frozen forwards of a rollout on this rank (`PPOPhases.score_rollout`)."""
        return self.phases.score_rollout(rollout)

    def compute_advantages(self, scored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Masks, EOS penalty, KL-penalised rewards, GAE and whitening (`PPOPhases.compute_advantages`)."""
        return self.phases.compute_advantages(scored)

    def make_experience(self, rollout: Rollout) -> Experience:
        """Phase 2: scoring then advantages (`PPOPhases.make_experience`)."""
        return self.phases.make_experience(rollout)

    def train_on_experience(self, exp: Experience, update: int) -> dict[str, torch.Tensor]:
        """Phase 3: the PPO update (`PPOPhases.train_on_experience`)."""
        return self.phases.train_on_experience(exp, update)

    # ------------------------------------------------------------------ loop
    def _metrics(self, exp: Experience | None, stats: dict[str, torch.Tensor] | None,
                 start_time: float) -> dict[str, float]:
        if exp is None:  # a disaggregated inference rank: it produced experience, the trainers report on it
            return {"lr": self.lr_scheduler.get_last_lr()[0], "episode": self.state.episode}
        gather = self.dist.all_gather_cat
        mean_kl = exp.kl.sum(1).mean()
        mean_entropy = ((-exp.logprobs) * exp.token_mask.float()).sum(1).mean()
        mean_non_score = exp.non_score_reward.sum(1).mean()
        rlhf_reward = mean_non_score + exp.scores.mean()
        ratio_all = gather(stats["ratio"])
        return {
            "eps": int(self.state.episode / max(time.time() - start_time, 1e-9)),
            "objective/kl": gather(mean_kl).mean().item(),
            "objective/entropy": gather(mean_entropy).mean().item(),
            "objective/non_score_reward": gather(mean_non_score).mean().item(),
            "objective/rlhf_reward": gather(rlhf_reward).mean().item(),
            "objective/scores": gather(exp.scores.mean()).mean().item(),
            "policy/approxkl_avg": gather(stats["approxkl"]).mean().item(),
            "policy/clipfrac_avg": gather(stats["pg_clipfrac"]).mean().item(),
            "loss/policy_avg": gather(stats["pg_loss"]).mean().item(),
            "loss/value_avg": gather(stats["vf_loss"]).mean().item(),
            "val/clipfrac_avg": gather(stats["vf_clipfrac"]).mean().item(),
            "policy/entropy_avg": gather(stats["entropy"]).mean().item(),
            "val/ratio": ratio_all.mean().item(),
            "val/ratio_var": ratio_all.var().item() if ratio_all.numel() > 1 else 0.0,
            "val/num_eos_tokens": int((exp.extras["raw_responses"] == self.processing_class.eos_token_id).sum()),
            "lr": self.lr_scheduler.get_last_lr()[0],
            "episode": self.state.episode,
        }

    # ------------------------------------------------------------------ placement views
    def full_weights(self):
        """Context in which every model this rank holds has its full weights (a no-op unless the plan or the
        launched engine shards models; collective then: call it on every rank)."""
        if self.launch.is_accelerate_engine:
            return self.backend.gathered()
        return self.executor.full_weights()

    def model_state_bytes(self) -> int | None:
        """Bytes of parameters and optimizer state this rank holds for policy + value model, measured on the
        engine's tensors (None on a rank that does not train)."""
        if not self.is_training_rank:
            return None
        measured = self.backend.model_state_bytes()
        if measured is not None:
            return measured
        from .accelerate_backends import model_state_bytes

        return model_state_bytes(self.model, self.optimizer)

    @property
    def timeline(self):
        """This rank's `hf_placement.runtime.Timeline`: the phases of every iteration so far."""
        return self.executor.timeline

    def gather_timeline(self) -> list:
        """Every rank's timeline, on every rank (collective over the world)."""
        from hf_placement.runtime import gather_timelines

        return gather_timelines(self.timeline)

    @property
    def is_training_rank(self) -> bool:
        """Whether this rank holds the optimizer and produces the update (all ranks unless disaggregated)."""
        return self.executor.is_trainer

    def training_iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        """One full PPO iteration on this rank, scheduled by the placement executor; the per-phase seconds come from
        this rank's timeline (which also has ``sync``, ``send:*`` and ``wait:*`` phases under a placement)."""
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

    def train(self, resume_from_checkpoint: str | bool | None = None) -> OnlineTrainerState:
        """Run ``num_total_batches`` PPO iterations, logging TRL's metrics every iteration."""
        args = self.args
        self.state.global_step = 0
        self.state.episode = 0
        layout = self.layout
        self.state.max_steps = layout.num_total_batches
        self.state.num_train_epochs = layout.total_episodes / len(self.train_dataset)
        for name in ("logging_steps", "eval_steps", "save_steps"):
            value = getattr(args, name)
            if value is not None:
                setattr(self.state, name, math.ceil(self.state.max_steps * value) if value < 1 else int(value))
        if resume_from_checkpoint:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._latest_checkpoint()
            self._load_checkpoint(resume_from_checkpoint)
        start_update = self.state.global_step + 1
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time = time.time()
        episodes_at_start = self.state.episode
        for update in range(start_update, layout.num_total_batches + 1):
            self.state.episode += layout.batch_size
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            exp, stats = self.training_iteration(update)
            with torch.no_grad():
                metrics = self._metrics(exp, stats, start_time)
                metrics["eps"] = int((self.state.episode - episodes_at_start) / max(time.time() - start_time, 1e-9))
            self.state.epoch = self.state.episode / len(self.train_dataset)
            self.state.global_step += 1
            self.log(metrics)
            self.lr_scheduler.step()
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_save:
                self._save_checkpoint()
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if args.num_sample_generations > 0 and (update - 1) % self.sample_generations_freq == 0:
                self.generate_completions(sampling=True)
            if self.control.should_training_stop:
                break
        self.executor.finish(self.state.global_step + 1)
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        if self.control.should_save:
            self._save_checkpoint()
            self.control = self.callback_handler.on_save(args, self.state, self.control)
        return self.state

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` in ``state.log_history`` and hand them to the callbacks (``report_to`` integrations)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # ------------------------------------------------------------------ completions
    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> dict[str, list] | None:
        """Near-greedy completions (temperature 0.01) on the eval set, with reward scores; ``sampling=True`` stops
        after the first batch. Returns the table (query, model response, score), gathered on every rank.

        Disaggregated placement: generated by the inference ranks with the shadow policy (the weights of the last
        sync), ``None`` on training ranks."""
        if self.eval_dataset is None:
            return None
        if not self.executor.serves_completions:
            return None
        batch = self.args.per_device_eval_batch_size
        table: dict[str, list] = defaultdict(list)
        world, rank = self.dist.world_size, self.dist.rank
        n = (len(self.eval_dataset) // (batch * world)) * batch * world
        for start in range(0, n, batch * world):
            rows = list(range(start + rank * batch, start + (rank + 1) * batch))
            queries = self.phases.collate([self.eval_dataset[i] for i in rows])
            rollout = self.rollout(queries, [self.phases.sample_seed(0, -1 - i) for i in rows], temperature=0.01)
            response = rollout.responses
            if self.stop_token_id is not None:
                response = pm.truncate_after_stop_token(response, self.stop_token_id, self.pad_token_id)
            scores = self.executor.completion_scores(queries, response)
            parts = [(self.processing_class.batch_decode(queries, skip_special_tokens=True),
                      self.processing_class.batch_decode(response), scores.cpu().tolist())]
            if world > 1:
                gathered = [None] * world
                torch.distributed.all_gather_object(gathered, parts[0], group=self.dist.group)
                parts = gathered
            for q, r, s in parts:
                table["query"].extend(q)
                table["model response"].extend(r)
                table["score"].extend(s)
            if sampling:
                break
        if self.state.is_world_process_zero:
            for q, r, s in list(zip(table["query"], table["model response"], table["score"], strict=True))[:5]:
                logger.info("query=%r response=%r score=%.4f", q, r, s)
        return dict(table)

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy only (adapter only with PEFT) plus the tokenizer, as safetensors, on rank 0."""
        output_dir = output_dir or self.args.output_dir
        if self.launch.is_accelerate_engine:  # the engine consolidates the policy's weights (collective)
            state = self.backend.full_state_dict(self.model.policy)
            if self.dist.rank != 0:
                return
            os.makedirs(output_dir, exist_ok=True)
            self.model.policy.save_pretrained(output_dir, state_dict=state, safe_serialization=True)
        else:
            with self.full_weights():
                if self.dist.rank != 0:
                    return
                os.makedirs(output_dir, exist_ok=True)
                self.model.policy.save_pretrained(output_dir, safe_serialization=True)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args.to_dict(), os.path.join(output_dir, "training_args.bin"))

    def push_to_hub(self, commit_message: str = "End of training", **kwargs) -> str | None:
        """Save the policy to ``output_dir`` and upload that folder to ``hub_model_id`` (default: the folder name).
        Extra keyword arguments (e.g. ``dataset_name`` from TRL scripts) are accepted and ignored."""
        self.save_model(self.args.output_dir)
        if self.dist.rank != 0:
            return None
        from huggingface_hub import HfApi

        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        api = HfApi(token=self.args.hub_token)
        repo_id = api.create_repo(repo_id, private=self.args.hub_private_repo, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=self.args.output_dir, commit_message=commit_message)
        return repo_id

    def _save_checkpoint(self) -> str:
        """``checkpoint-<step>/``: policy (loadable with from_pretrained), value model, the joint training state
        (safetensors), optimizer, scheduler and trainer state. Trainer randomness is keyed by the iteration, so no RNG
        state is needed for an exact resume."""

        path = os.path.join(self.args.output_dir, f"{CHECKPOINT_PREFIX}-{self.state.global_step}")
        if self.launch.is_accelerate_engine:
            self._write_engine_checkpoint(path)
            self.dist.barrier()
            return path
        if not self.is_training_rank:  # disaggregated shadows are refreshed from the trainer; nothing of their own
            return path
        with self.full_weights():
            self._write_checkpoint(path)
        self.dist.barrier()
        return path

    def _write_checkpoint(self, path: str) -> None:
        from safetensors.torch import save_file

        if self.dist.rank == 0:
            self.save_model(path)
            # Own copies: under sharded roles the gathered weights are views of flat buffers, and tied weights
            # (embeddings / LM head) share one, which safetensors refuses to save as views.
            state = {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}
            save_file(state, os.path.join(path, _TRAINING_STATE))
            if hasattr(self.model.value_model, "save_pretrained"):
                self.model.value_model.save_pretrained(os.path.join(path, "value_model"), safe_serialization=True)
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(path, "scheduler.pt"))
            for cb in self.callback_handler.callbacks + [self.control]:
                if isinstance(cb, ExportableState):
                    self.state.stateful_callbacks[cb.__class__.__name__] = cb.state()
            self.state.save_to_json(os.path.join(path, "trainer_state.json"))
            self._rotate_checkpoints()

    def _write_engine_checkpoint(self, path: str) -> None:
        """Under DeepSpeed / FSDP2: the consolidated policy and value model (collective), scheduler and trainer
        state. The engine's sharded optimizer state is not written, so these checkpoints are for inference and
        evaluation; resuming is refused with that reason."""
        self.save_model(path)
        value_state = self.backend.full_state_dict(self.model.value_model)
        if self.dist.rank != 0:
            return
        if hasattr(self.model.value_model, "save_pretrained"):
            self.model.value_model.save_pretrained(os.path.join(path, "value_model"), state_dict=value_state,
                                                   safe_serialization=True)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(path, "scheduler.pt"))
        self.state.save_to_json(os.path.join(path, "trainer_state.json"))
        self._rotate_checkpoints()

    def _checkpoints(self) -> list[str]:
        out = self.args.output_dir
        if not os.path.isdir(out):
            return []
        found = [d for d in os.listdir(out) if d.startswith(f"{CHECKPOINT_PREFIX}-") and d.split("-")[-1].isdigit()]
        return [os.path.join(out, d) for d in sorted(found, key=lambda d: int(d.split("-")[-1]))]

    def _latest_checkpoint(self) -> str:
        found = self._checkpoints()
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but no {CHECKPOINT_PREFIX}-* folder in "
                             f"{self.args.output_dir!r}. Pass a checkpoint path or train without resuming.")
        return found[-1]

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        import shutil

        for old in self._checkpoints()[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _load_training_state(self, state_file: str) -> None:
        """Policy + value weights from a checkpoint; a tied weight (embeddings / LM head) may be stored under one
        of its names only. Anything else missing or unexpected means the file is not this model's."""
        from safetensors.torch import load_file

        try:
            state = load_file(state_file, device=str(self.device))
        except Exception as exc:  # safetensors raises its own error types for truncated / corrupt files
            raise ValueError(f"cannot read {state_file!r} ({exc}); the checkpoint is incomplete or corrupt. Resume "
                             "from an earlier checkpoint.") from exc
        current = self.model.state_dict()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        loaded = {current[k].data_ptr() for k in state if k in current}
        missing = [k for k in missing if current[k].data_ptr() not in loaded]
        if missing or unexpected:
            raise ValueError(f"{state_file!r} does not hold this trainer's policy and value model (missing "
                             f"{missing[:5]}, unexpected {list(unexpected)[:5]}). Resume with the models the "
                             "checkpoint was trained with.")

    def _load_checkpoint(self, path: str) -> None:
        if self.launch.is_accelerate_engine:
            raise ValueError(f"resuming under {self.launch.source} is not supported: its checkpoints hold the "
                             "consolidated policy and value model but not the engine's sharded optimizer state. "
                             "Start a new run from the saved policy (from_pretrained) instead.")
        if self.plan.sharded_roles:
            raise ValueError(f"resuming under a plan with sharded roles {self.plan.sharded_roles} is not supported "
                             "(the checkpoint holds rank 0's optimizer slice only); resume with an unsharded plan.")
        state_file = os.path.join(path, _TRAINING_STATE)
        if not os.path.isfile(state_file):
            raise ValueError(f"{path!r} is not a PPOTrainer checkpoint (no {_TRAINING_STATE}).")
        self._load_training_state(state_file)
        self.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=self.device))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
        with open(os.path.join(path, "trainer_state.json")) as f:
            saved = json.load(f)
        self.state.global_step = saved["global_step"]
        self.state.episode = saved.get("episode", saved["global_step"] * self.layout.batch_size)
        self.state.log_history = saved.get("log_history", [])
        self.state.epoch = saved.get("epoch")
        logger.info("Resumed from %s at step %d", path, self.state.global_step)
