"""``PPOTrainer``: TRL 1.12's PPO trainer interface (actor, critic, reward and reference model), clean-room.

One PPO iteration is three phases, each a public method so a placement executor can schedule them on other ranks:

1. :meth:`PPOTrainer.rollout` — sample responses for the local prompts (generation);
2. :meth:`PPOTrainer.make_experience` — frozen forwards (sampler/reference log-probs, values, reward scores), then
   KL-penalised rewards, GAE and whitening from :mod:`trl_trainers.ppo_math`;
3. :meth:`PPOTrainer.train_on_experience` — ``num_ppo_epochs`` passes of clipped policy + value loss over
   mini-batches with gradient accumulation, one optimizer over policy and value model (as TRL).

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
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
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

from . import ppo_math as pm
from ._distributed import DistContext, init_distributed_from_env
from ._generation import policy_response_logits, sample_responses, score_head_outputs, sequence_scores
from .ppo_config import PPOConfig

__all__ = ["Experience", "OnlineTrainerState", "PPOTrainer", "PolicyAndValueWrapper", "Rollout"]

logger = logging.get_logger(__name__)

CHECKPOINT_PREFIX = "checkpoint"
_TRAINING_STATE = "ppo_training_state.safetensors"


@dataclass
class OnlineTrainerState(TrainerState):
    """``TrainerState`` plus the number of episodes (prompts) consumed so far, as in TRL."""

    episode: int = 0


class PolicyAndValueWrapper(nn.Module):
    """Holds policy and value model so one optimizer, one checkpoint and one ``.train()`` cover both (as in TRL)."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model


@dataclass
class Rollout:
    """Output of the generation phase for one rank's prompts."""

    queries: torch.Tensor  # (B, P) left-padded prompt ids
    query_responses: torch.Tensor  # (B, P + R)
    logprobs: torch.Tensor  # (B, R) sampler log-probs of the emitted tokens (temperature-scaled distribution)

    @property
    def context_length(self) -> int:
        return self.queries.size(1)

    @property
    def responses(self) -> torch.Tensor:
        return self.query_responses[:, self.context_length :]


@dataclass
class Experience:
    """Everything the PPO update needs for one rank's share of the batch (all ``(B, R)`` unless noted)."""

    query_responses: torch.Tensor  # (B, P + R)
    responses: torch.Tensor
    context_length: int
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor  # (B,)
    sequence_lengths: torch.Tensor  # (B,)
    token_mask: torch.Tensor  # valid generated tokens
    value_mask: torch.Tensor  # token_mask plus the position after the last token
    kl: torch.Tensor
    non_score_reward: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


def _exact_div(a: int, b: int, what: str, fix: str) -> int:
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}. {fix}")
    return a // b


def _disable_dropout(module: nn.Module | None) -> None:
    if module is None:
        return
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0


class PPOTrainer:
    """PPO for causal LMs with a reward model and a value model; drop-in for ``trl.experimental.ppo.PPOTrainer``.

    Args mirror TRL 1.12: ``model`` (policy), ``ref_model`` (``None``: a frozen copy, or with PEFT the
    adapter-disabled policy), ``reward_model`` and ``value_model`` (sequence classifiers with ``score`` head),
    ``train_dataset`` with an ``input_ids`` column, optional ``eval_dataset`` for :meth:`generate_completions`.
    ``group`` (ours) restricts the data-parallel collectives to a process sub-group.

    ``placement`` (ours, FlexRLHF): where the four models run. A `hf_placement.PlacementPlan`, a strategy name
    (``"colocated"``, ``"interleaved"``, ``"disaggregated"``), a path to a ``.yaml``/``.json`` plan or a plan dict; when
    omitted, ``args.placement`` (with ``args.placement_ratios`` / ``args.rollout_replicas``); when both are ``None``,
    plain data-parallel PPO without the placement layer. Transfers time out after ``args.placement_timeout_s``; a
    disaggregated plan syncs weights with ``args.weight_sync`` and may run one step off-policy
    (``args.max_staleness=1``). With staleness 0 every placement computes the co-located update (see
    `trl_trainers.placement.equivalence_issues`; ``strict_equivalence=True`` raises instead of logging when a
    configuration cannot). A colocated plan with ``sharded_roles`` shards those models ZeRO-3-style over the ranks.
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
        self._check_dataset(train_dataset, "train_dataset")
        if eval_dataset is not None:
            self._check_dataset(eval_dataset, "eval_dataset")
        pad_token_id = getattr(processing_class, "pad_token_id", None)
        if pad_token_id is None:
            raise ValueError(
                "The tokenizer (`processing_class`) has no pad token, which PPO needs to left-pad prompts and to mark "
                "the end of responses. Add one, e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'}) and "
                "resize the model embeddings if needed."
            )
        if args.fp16:
            raise ValueError("fp16=True is not supported by this PPOTrainer; use bf16=True or fp32 (bf16=False).")

        self.args = args
        self.processing_class = processing_class
        self.pad_token_id = int(pad_token_id)
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_collator = data_collator

        if args.stop_token == "eos":
            self.stop_token_id = processing_class.eos_token_id
        else:
            self.stop_token_id = args.stop_token_id

        # PEFT: the LoRA-wrapped policy is trained; its adapter-disabled self is the reference.
        self.is_peft_model = False
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

            self.is_peft_model = isinstance(model, PeftModel)
        except ImportError:
            self.is_peft_model = False
        self.policy_model = model
        if ref_model is None and not self.is_peft_model:
            ref_model = copy.deepcopy(model)
        if ref_model is not None:
            ref_model.requires_grad_(False)
            ref_model.eval()
        self.ref_model = ref_model
        self.reward_model = reward_model
        self.reward_model.requires_grad_(False)
        self.reward_model.eval()
        self.value_model = value_model

        # Distributed set-up and batch arithmetic (TRL's names, filled into args).
        init_distributed_from_env(timeout_s=float(args.ddp_timeout))
        # Placement (ours): resolve the plan, build its role groups and, for a disaggregated plan, move this rank's
        # data-parallel collectives into its side's group with the batch scaled so the global batch is unchanged.
        self.plan = self.executor = self.role_groups = None
        self.gradient_reducer = None  # set by a placement that shards the trained models
        self.shards_per_rank = 1  # co-located shards of the global batch this rank trains on
        spec = placement if placement is not None else args.placement
        if spec is not None:
            if group is not None:
                raise ValueError("`group` and `placement` are mutually exclusive: a placement builds its own process "
                                 "groups. Drop `group` (it is for executors running PPOTrainer inside a sub-group).")
            from .placement.trainer import prepare_placement

            setup = prepare_placement(args, spec, strict_equivalence=strict_equivalence)
            self.plan, self.role_groups, args = setup.plan, setup.role_groups, setup.args
            group, self.shards_per_rank = setup.group, setup.shards_per_rank
            self.args = args
        self.dist = DistContext(group)
        world = self.dist.world_size
        args.world_size = world
        args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.micro_batch_size = args.per_device_train_batch_size * world
        args.batch_size = args.local_batch_size * world
        args.mini_batch_size = _exact_div(
            args.batch_size, args.num_mini_batches, "batch_size (per_device_train_batch_size * "
            "gradient_accumulation_steps * world_size) must be a multiple of num_mini_batches",
            "Change num_mini_batches or the batch sizes.")
        args.local_mini_batch_size = _exact_div(
            args.local_batch_size, args.num_mini_batches, "local_batch_size (per_device_train_batch_size * "
            "gradient_accumulation_steps) must be a multiple of num_mini_batches",
            "Change num_mini_batches or the batch sizes.")
        # Shards: the co-located local batch. A rank training several shards (a disaggregated trainer) cuts each one
        # into mini-batch slices exactly as the co-located rank holding it would, so placements share mini-batches.
        self.shard_size = args.local_batch_size // self.shards_per_rank
        shard_mini = _exact_div(
            self.shard_size, args.num_mini_batches, "the co-located local batch (per_device_train_batch_size * "
            "gradient_accumulation_steps) must be a multiple of num_mini_batches",
            "Change num_mini_batches or the batch sizes.")
        # Micro-batches: per_device_train_batch_size sequences, or the whole mini-batch when that is smaller (TRL).
        self.micro_batch = min(args.per_device_train_batch_size, shard_mini)
        _exact_div(shard_mini, self.micro_batch,
                   "local_mini_batch_size (local_batch_size / num_mini_batches) must be a multiple of "
                   "per_device_train_batch_size", "Make gradient_accumulation_steps a multiple of num_mini_batches.")
        self.accumulation_steps = args.local_mini_batch_size // self.micro_batch
        if args.whiten_rewards and args.local_mini_batch_size < 8:
            raise ValueError(
                f"whiten_rewards=True needs a per-rank mini-batch of at least 8 sequences, got "
                f"local_mini_batch_size={args.local_mini_batch_size}. Increase the batch or disable whiten_rewards."
            )
        if args.total_episodes is None:
            args.total_episodes = int(args.num_train_epochs * len(train_dataset))
        args.num_total_batches = math.ceil(args.total_episodes / args.batch_size)
        if len(train_dataset) < args.batch_size:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} rows, fewer than one global rollout batch "
                f"(batch_size={args.batch_size}). Add prompts or lower per_device_train_batch_size / "
                "gradient_accumulation_steps."
            )
        self.sample_generations_freq = max(1, args.num_total_batches // max(1, args.num_sample_generations))

        if args.use_cpu or not torch.cuda.is_available():
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))

        for module in (self.policy_model, self.ref_model, self.value_model, self.reward_model):
            _disable_dropout(module)
        self.model = PolicyAndValueWrapper(self.policy_model, self.value_model).to(self.device)
        self.model.config = getattr(self.policy_model, "config", None)
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self.reward_model.to(self.device)
        if args.gradient_checkpointing:
            for module in (self.policy_model, getattr(value_model, value_model.base_model_prefix, None)):
                if module is not None and hasattr(module, "gradient_checkpointing_enable"):
                    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        self.dist.broadcast_module(self.model)  # identical start on every rank, as DDP guarantees
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]

        self.optimizer, self.lr_scheduler = optimizers
        self._user_optimizer = self.optimizer is not None
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                self.trainable_params,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
        if self.lr_scheduler is None:
            from transformers import get_scheduler

            self.lr_scheduler = get_scheduler(
                args.lr_scheduler_type,
                self.optimizer,
                num_warmup_steps=args.get_warmup_steps(args.num_total_batches),
                num_training_steps=args.num_total_batches,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
            )

        is_zero = self.dist.rank == 0
        default_callbacks = [DefaultFlowCallback, *get_reporting_integration_callbacks(args.report_to)]
        self.callback_handler = CallbackHandler(
            default_callbacks + list(callbacks or []), self.model, processing_class, self.optimizer,
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
        if self.plan is not None:
            from .placement.trainer import attach_placement

            attach_placement(self, setup)

    # ------------------------------------------------------------------ inputs
    @staticmethod
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

    def _collate(self, rows: list[dict]) -> torch.Tensor:
        """Left-pad prompt ids (or use the user's collator), returning ``input_ids`` on the device."""
        if self.data_collator is not None:
            return self.data_collator(rows)["input_ids"].to(self.device)
        ids = [list(r["input_ids"]) for r in rows]
        width = max(len(x) for x in ids)
        padded = [[self.pad_token_id] * (width - len(x)) + x for x in ids]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def global_batch_indices(self, update: int) -> list[int]:
        """Dataset rows of iteration ``update`` (1-based): a per-epoch global permutation, last partial batch dropped.

        Depends only on the seed and the iteration, so a resumed run sees the same prompts it would have seen.
        """
        n, batch = len(self.train_dataset), self.args.batch_size
        per_epoch = n // batch
        epoch, slot = divmod(update - 1, per_epoch)
        gen = torch.Generator().manual_seed(self.args.seed * 7919 + epoch)
        perm = torch.randperm(n, generator=gen)
        return perm[slot * batch : (slot + 1) * batch].tolist()

    def local_batch(self, update: int) -> tuple[torch.Tensor, list[int]]:
        """This rank's left-padded prompts of iteration ``update`` and their per-sample sampling seeds."""
        local = self.args.local_batch_size
        rank = self.dist.rank
        rows = self.global_batch_indices(update)[rank * local : (rank + 1) * local]
        seeds = [self._sample_seed(update, rank * local + i) for i in range(local)]
        return self._collate([self.train_dataset[i] for i in rows]), seeds

    def _sample_seed(self, update: int, global_position: int) -> int:
        return (self.args.seed * 1_000_003 + update * 100_003 + global_position) % (2**62)

    # ------------------------------------------------------------------ helpers
    def _autocast(self):
        if self.args.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @contextmanager
    def null_ref_context(self):
        """With PEFT and no separate reference: run the policy with adapters disabled (or the named ref adapter)."""
        policy = self.model.policy
        ref_adapter = self.args.ref_adapter_name
        ctx = policy.disable_adapter() if self.is_peft_model and not ref_adapter else nullcontext()
        with ctx:
            if ref_adapter:
                policy.set_adapter(ref_adapter)
            try:
                yield
            finally:
                if ref_adapter:
                    policy.set_adapter(self.args.model_adapter_name or "default")

    # ------------------------------------------------------------------ phase 1: generation
    @torch.no_grad()
    def rollout(self, queries: torch.Tensor, sample_seeds: list[int], temperature: float | None = None) -> Rollout:
        """Sample ``response_length`` tokens per prompt in chunks of ``local_rollout_forward_batch_size``."""
        args = self.args
        temperature = args.temperature if temperature is None else temperature
        policy = self.model.policy
        was_training = policy.training
        policy.eval()
        chunk = args.local_rollout_forward_batch_size
        outs, logprobs = [], []
        with self._autocast():
            for i in range(0, queries.size(0), chunk):
                qr, lp = sample_responses(
                    policy, queries[i : i + chunk], pad_token_id=self.pad_token_id,
                    response_length=args.response_length, temperature=temperature,
                    sample_seeds=sample_seeds[i : i + chunk], stop_token_id=self.stop_token_id,
                )
                outs.append(qr)
                logprobs.append(lp)
        policy.train(was_training)
        width = max(o.size(1) for o in outs)  # chunks may stop early at different lengths
        outs = [torch.nn.functional.pad(o, (0, width - o.size(1)), value=self.pad_token_id) for o in outs]
        steps = width - queries.size(1)
        logprobs = [torch.nn.functional.pad(lp, (0, steps - lp.size(1)), value=pm.INVALID_LOGPROB) for lp in logprobs]
        return Rollout(queries=queries, query_responses=torch.cat(outs), logprobs=torch.cat(logprobs))

    # ------------------------------------------------------------------ phase 2: experience
    @torch.no_grad()
    def ref_logprobs(self, query_response: torch.Tensor, context_length: int) -> torch.Tensor:
        """Reference log-probs of the response tokens (the adapter-disabled policy when there is no ref model).

        Call inside :meth:`_autocast`; placement executors call it on the reference model's owner ranks.
        """
        if self.ref_model is None:
            with self.null_ref_context():
                logits = policy_response_logits(self.model.policy, query_response, self.pad_token_id,
                                                context_length, self.args.temperature)
        else:
            logits = policy_response_logits(self.ref_model, query_response, self.pad_token_id, context_length,
                                            self.args.temperature)
        return pm.logprobs_from_logits(logits, query_response[:, context_length:])

    @torch.no_grad()
    def score_rollout(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Frozen forwards: sampler log-probs, reference log-probs, values and reward scores (per chunk)."""
        args = self.args
        ctx = rollout.context_length
        chunk = args.local_rollout_forward_batch_size
        out = defaultdict(list)
        self.model.eval()
        for i in range(0, rollout.queries.size(0), chunk):
            query = rollout.queries[i : i + chunk]
            query_response = rollout.query_responses[i : i + chunk]
            response = query_response[:, ctx:]
            out["logprobs"].append(rollout.logprobs[i : i + chunk])
            with self._autocast():
                out["ref_logprobs"].append(self.ref_logprobs(query_response, ctx))
                processed = response
                if self.stop_token_id is not None:
                    processed = pm.truncate_after_stop_token(response, self.stop_token_id, self.pad_token_id)
                full_values = score_head_outputs(self.model.value_model, query_response, self.pad_token_id)
                out["values"].append(full_values[:, ctx - 1 : -1].float())
                scores = sequence_scores(
                    self.reward_model, torch.cat([query, processed], 1), self.pad_token_id, ctx)
                out["scores"].append(scores.float())
            out["responses"].append(processed)
            out["sequence_lengths"].append(pm.first_true_indices(processed == self.pad_token_id) - 1)
        self.model.train()
        return {k: torch.cat(v) for k, v in out.items()}

    @torch.no_grad()
    def per_sample_rewards(self, scored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The per-sample half of :meth:`compute_advantages`: masks, EOS penalty, KL and KL-penalised rewards.

        Nothing here mixes samples, so a placement executor can run it on any shard of the batch.
        """
        args = self.args
        responses, lengths = scored["responses"], scored["sequence_lengths"]
        scores = scored["scores"].clone()
        contain_eos = (responses == self.processing_class.eos_token_id).any(dim=-1)
        if args.missing_eos_penalty is not None:
            scores[~contain_eos] -= args.missing_eos_penalty
        token_mask, value_mask = pm.response_masks(lengths, responses.size(1))
        logprobs = scored["logprobs"].masked_fill(~token_mask, pm.INVALID_LOGPROB)
        ref_logprobs = scored["ref_logprobs"].masked_fill(~token_mask, pm.INVALID_LOGPROB)
        values = scored["values"].masked_fill(~value_mask, 0.0)
        kl = pm.kl_per_token(logprobs, ref_logprobs, args.kl_estimator)
        rewards, non_score_reward = pm.kl_penalty_rewards(kl, scores, lengths, args.kl_coef)
        return {
            "responses": responses, "sequence_lengths": lengths, "scores": scores, "logprobs": logprobs,
            "ref_logprobs": ref_logprobs, "values": values, "kl": kl, "non_score_reward": non_score_reward,
            "rewards": rewards, "token_mask": token_mask, "value_mask": value_mask, "contain_eos": contain_eos,
        }

    @torch.no_grad()
    def batch_advantages(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch half of :meth:`compute_advantages`: reward whitening, GAE and advantage whitening.

        Whitening statistics are summed over ``self.dist`` (all ranks, or the training group under a placement), which
        holds the whole global batch exactly once.
        """
        args = self.args
        token_mask, value_mask = part["token_mask"], part["value_mask"]
        reduce = self.dist.all_reduce_sum if self.dist.world_size > 1 else None
        rewards = part["rewards"]
        if args.whiten_rewards:
            rewards = pm.masked_whiten(rewards, value_mask, shift_mean=False, all_reduce=reduce)
            rewards = rewards.masked_fill(~value_mask, 0.0)
        advantages, returns = pm.compute_gae(rewards, part["values"], args.gamma, args.lam)
        advantages = pm.masked_whiten(advantages, token_mask, all_reduce=reduce).masked_fill(~token_mask, 0.0)
        return {**part, "rewards": rewards, "advantages": advantages, "returns": returns}

    def compute_advantages(self, scored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Masks, EOS penalty, KL-penalised rewards, GAE and whitening (statistics over all ranks)."""
        return self.batch_advantages(self.per_sample_rewards(scored))

    def make_experience(self, rollout: Rollout) -> Experience:
        """Phase 2: :meth:`score_rollout` then :meth:`compute_advantages`."""
        scored = self.score_rollout(rollout)
        adv = self.compute_advantages(scored)
        return Experience(
            query_responses=rollout.query_responses, responses=scored["responses"],
            context_length=rollout.context_length, logprobs=adv["logprobs"], ref_logprobs=adv["ref_logprobs"],
            values=adv["values"], scores=adv["scores"], sequence_lengths=scored["sequence_lengths"],
            token_mask=adv["token_mask"], value_mask=adv["value_mask"], kl=adv["kl"],
            non_score_reward=adv["non_score_reward"], rewards=adv["rewards"], advantages=adv["advantages"],
            returns=adv["returns"], extras={"contain_eos": adv["contain_eos"], "raw_responses": rollout.responses},
        )

    # ------------------------------------------------------------------ phase 3: training
    def train_on_experience(self, exp: Experience, update: int) -> dict[str, torch.Tensor]:
        """PPO epochs x mini-batches x micro-batches; one optimizer step per mini-batch (gradients averaged over
        micro-batches and ranks). Returns per-(epoch, mini-batch, micro-batch) statistics."""
        args = self.args
        ctx = exp.context_length
        shape = (args.num_ppo_epochs, args.num_mini_batches, self.accumulation_steps)
        stats = {k: torch.zeros(shape, device=self.device)
                 for k in ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        accum, micro = self.accumulation_steps, self.micro_batch
        self.model.train()
        shards, shard, first_shard = self.shards_per_rank, self.shard_size, self.dist.rank * self.shards_per_rank
        shard_mini = args.local_mini_batch_size // shards
        for epoch in range(args.num_ppo_epochs):
            # One permutation per co-located shard keyed by its global index (= the rank holding it when co-located),
            # so every placement forms the same global mini-batches from the same rows.
            orders = []
            for s in range(shards):
                gen = torch.Generator().manual_seed(self._sample_seed(update, 0) * 31 + epoch * 7 + first_shard + s)
                orders.append(torch.randperm(shard, generator=gen) + s * shard)
            for mb in range(args.num_mini_batches):
                mini = torch.cat([o[mb * shard_mini : (mb + 1) * shard_mini] for o in orders])
                self.optimizer.zero_grad(set_to_none=True)
                tok_norm = val_norm = None
                if args.loss_normalization == "mini_batch":
                    # Global token counts of this mini-batch; x world_size because gradients are averaged over ranks.
                    counts = torch.stack([exp.token_mask[mini].sum(), exp.value_mask[mini].sum()]).double()
                    counts = self.dist.all_reduce_sum(counts) / self.dist.world_size
                    tok_norm, val_norm = counts[0].float(), counts[1].float()
                for k, mstart in enumerate(range(0, args.local_mini_batch_size, micro)):
                    idx = mini[mstart : mstart + micro].to(self.device)
                    token_mask, value_mask = exp.token_mask[idx], exp.value_mask[idx]
                    with self._autocast():
                        logits = policy_response_logits(
                            self.model.policy, exp.query_responses[idx], self.pad_token_id, ctx, args.temperature)
                        vpred = score_head_outputs(self.model.value_model, exp.query_responses[idx],
                                                   self.pad_token_id)[:, ctx - 1 : -1].float()
                    new_logprobs = pm.logprobs_from_logits(logits, exp.responses[idx])
                    new_logprobs = new_logprobs.masked_fill(~token_mask, pm.INVALID_LOGPROB)
                    vpred = vpred.masked_fill(~value_mask, 0.0)
                    vf_loss, vf_clipfrac = pm.value_loss(
                        vpred, exp.values[idx], exp.returns[idx], value_mask, args.cliprange_value, val_norm)
                    pg_loss, pg_clipfrac, ratio = pm.policy_loss(
                        new_logprobs, exp.logprobs[idx], exp.advantages[idx], token_mask, args.cliprange, tok_norm)
                    loss = pg_loss + args.vf_coef * vf_loss
                    (loss if tok_norm is not None else loss / accum).backward()
                    with torch.no_grad():
                        at = (epoch, mb, k)
                        stats["approxkl"][at] = pm.approx_kl(new_logprobs, exp.logprobs[idx])
                        stats["pg_clipfrac"][at] = pg_clipfrac
                        if tok_norm is None:
                            stats["pg_loss"][at] = pg_loss.detach()
                            stats["vf_loss"][at] = vf_loss.detach()
                        else:  # report the micro-batch mean either way
                            stats["pg_loss"][at] = pg_loss.detach() * tok_norm / token_mask.sum()
                            stats["vf_loss"][at] = vf_loss.detach() * val_norm / value_mask.sum()
                        stats["vf_clipfrac"][at] = vf_clipfrac
                        stats["entropy"][at] = pm.entropy_from_logits(logits.detach()).mean()
                        stats["ratio"][at] = ratio.detach().mean()
                    del logits, vpred, loss
                if self.gradient_reducer is not None:  # a sharded placement reduce-scatters into its slices
                    self.gradient_reducer()
                else:
                    self.dist.average_gradients(self.trainable_params)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return stats

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
        """Context in which every model holds its full weights (a no-op unless the placement shards models).
        Collective under a sharded placement: call it on every rank."""
        if self.executor is not None and hasattr(self.executor, "full_weights"):
            return self.executor.full_weights()
        return nullcontext()

    @property
    def timeline(self):
        """This rank's `hf_placement.Timeline` under a placement (phases of every iteration so far), else ``None``."""
        return None if self.executor is None else self.executor.timeline

    def gather_timeline(self) -> list:
        """Every rank's timeline, on every rank (collective over the world); needs a placement."""
        if self.executor is None:
            raise ValueError("gather_timeline() needs a placement: pass placement='colocated' (or another plan) to "
                             "PPOTrainer to record per-rank timelines.")
        from hf_placement import gather_timelines

        return gather_timelines(self.timeline)

    @property
    def is_training_rank(self) -> bool:
        """Whether this rank holds the optimizer and produces the update (all ranks unless disaggregated)."""
        return True if self.executor is None else self.executor.is_trainer

    def training_iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        """One full PPO iteration on this rank's share: generation, experience, training (timed per phase).

        Under a placement the executor schedules the phases on the ranks of the plan, and the per-phase seconds come
        from this rank's timeline (which also has ``sync``, ``send:*`` and ``wait:*`` phases)."""
        if self.executor is not None:
            first = len(self.timeline.events)
            exp, stats = self.executor.iteration(update)
            timings: dict[str, float] = defaultdict(float)
            for ev in self.timeline.events[first:]:
                timings[ev.phase] += ev.duration
            self.last_timings = dict(timings)
        else:
            queries, seeds = self.local_batch(update)
            t0 = time.perf_counter()
            rollout = self.rollout(queries, seeds)
            t1 = time.perf_counter()
            exp = self.make_experience(rollout)
            t2 = time.perf_counter()
            stats = self.train_on_experience(exp, update)
            t3 = time.perf_counter()
            self.last_timings = {"generation": t1 - t0, "experience": t2 - t1, "training": t3 - t2}
        self.phase_history.append(self.last_timings)
        for k, v in self.last_timings.items():
            self.timings[k] += v
        return exp, stats

    def train(self, resume_from_checkpoint: str | bool | None = None) -> OnlineTrainerState:
        """Run ``num_total_batches`` PPO iterations, logging TRL's metrics every iteration."""
        args = self.args
        self.state.global_step = 0
        self.state.episode = 0
        self.state.max_steps = args.num_total_batches
        self.state.num_train_epochs = args.total_episodes / len(self.train_dataset)
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
        for update in range(start_update, args.num_total_batches + 1):
            self.state.episode += args.batch_size
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
        if self.executor is not None:
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
    def _completion_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Reward scores of eval completions (under interleaving, computed on the reward model's owner ranks)."""
        if self.executor is not None and hasattr(self.executor, "completion_scores"):
            return self.executor.completion_scores(queries, responses)
        return sequence_scores(self.reward_model, torch.cat([queries, responses], 1), self.pad_token_id,
                               queries.size(1)).float()

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> dict[str, list] | None:
        """Near-greedy completions (temperature 0.01) on the eval set, with reward scores; ``sampling=True`` stops
        after the first batch. Returns the table (query, model response, score), gathered on every rank.

        Disaggregated placement: generated by the inference ranks with the shadow policy (the weights of the last
        sync), ``None`` on training ranks."""
        if self.eval_dataset is None:
            return None
        if self.executor is not None and not getattr(self.executor, "serves_completions", True):
            return None
        batch = self.args.per_device_eval_batch_size
        table: dict[str, list] = defaultdict(list)
        world, rank = self.dist.world_size, self.dist.rank
        n = (len(self.eval_dataset) // (batch * world)) * batch * world
        for start in range(0, n, batch * world):
            rows = list(range(start + rank * batch, start + (rank + 1) * batch))
            queries = self._collate([self.eval_dataset[i] for i in rows])
            rollout = self.rollout(queries, [self._sample_seed(0, -1 - i) for i in rows], temperature=0.01)
            response = rollout.responses
            if self.stop_token_id is not None:
                response = pm.truncate_after_stop_token(response, self.stop_token_id, self.pad_token_id)
            scores = self._completion_scores(queries, response)
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
        if not self.is_training_rank:  # disaggregated shadows are refreshed from the trainer; nothing of their own
            return path
        with self.full_weights():
            self._write_checkpoint(path)
        self.dist.barrier()
        return path

    def _write_checkpoint(self, path: str) -> None:
        from safetensors.torch import save_model as save_safetensors

        if self.dist.rank == 0:
            self.save_model(path)
            save_safetensors(self.model, os.path.join(path, _TRAINING_STATE))
            if hasattr(self.model.value_model, "save_pretrained"):
                self.model.value_model.save_pretrained(os.path.join(path, "value_model"), safe_serialization=True)
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(path, "scheduler.pt"))
            for cb in self.callback_handler.callbacks + [self.control]:
                if isinstance(cb, ExportableState):
                    self.state.stateful_callbacks[cb.__class__.__name__] = cb.state()
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

    def _load_checkpoint(self, path: str) -> None:
        from safetensors.torch import load_model as load_safetensors

        if self.plan is not None and self.plan.sharded_roles:
            raise ValueError(f"resuming under a plan with sharded roles {self.plan.sharded_roles} is not supported "
                             "(the checkpoint holds rank 0's optimizer slice only); resume with an unsharded plan.")
        state_file = os.path.join(path, _TRAINING_STATE)
        if not os.path.isfile(state_file):
            raise ValueError(f"{path!r} is not a PPOTrainer checkpoint (no {_TRAINING_STATE}).")
        load_safetensors(self.model, state_file, device=str(self.device))
        self.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), map_location=self.device))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt")))
        with open(os.path.join(path, "trainer_state.json")) as f:
            saved = json.load(f)
        self.state.global_step = saved["global_step"]
        self.state.episode = saved.get("episode", saved["global_step"] * self.args.batch_size)
        self.state.log_history = saved.get("log_history", [])
        self.state.epoch = saved.get("epoch")
        logger.info("Resumed from %s at step %d", path, self.state.global_step)
