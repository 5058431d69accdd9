"""``PPOConfig``: TRL 1.12's PPO configuration (same field names and defaults), on ``transformers.TrainingArguments``.

TRL removed its PPO trainer after 1.12.0; scripts written for ``trl.experimental.ppo.PPOConfig`` keep working when they
import this class instead. The runtime fields (``world_size``, ``batch_size``, ``num_total_batches``, ...) are filled on
the trainer's copy, ``trainer.args``, once the world size is known (TRL wrote them into the caller's object); the
config a script passes is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from transformers import TrainingArguments

__all__ = ["PPOConfig"]


def _bf16_device_available() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available

    return bool(is_torch_bf16_gpu_available())


def _cpu_only_multiprocess() -> bool:
    import os

    import torch

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


@dataclass
class PPOConfig(TrainingArguments):
    r"""Configuration of :class:`trl_trainers.PPOTrainer`.

    Only PPO-specific parameters are listed; everything else is a :class:`~transformers.TrainingArguments` field.

    > Parameters whose defaults differ from ``TrainingArguments`` (as in TRL)

    learning_rate (3e-6), logging_steps (10), gradient_checkpointing / activation_checkpointing (True),
    bf16 (True unless ``fp16`` is set or the host has no bf16 GPU and ``use_cpu`` is not set).

    > Parameters that control the rollout

    response_length, temperature, stop_token / stop_token_id, missing_eos_penalty, local_rollout_forward_batch_size.

    > Parameters that control the PPO update

    num_ppo_epochs, num_mini_batches, kl_coef, kl_estimator, cliprange, vf_coef, cliprange_value, gamma, lam,
    whiten_rewards.
    """

    # TrainingArguments fields whose default TRL overrides.
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial learning rate for AdamW."})
    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every X updates (PPO iterations); a float in [0, 1) is a ratio of the total."},
    )
    # TRL's `gradient_checkpointing=True` default; transformers 5.2x renamed the field `activation_checkpointing` and
    # keeps `gradient_checkpointing` as an alias, so the default lives on the new name and the old one maps onto it.
    activation_checkpointing: bool | None = field(
        default=True,
        metadata={"help": "Trade compute for memory with activation (gradient) checkpointing in policy and value."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={"help": "Use bf16 autocast. If not set: True unless `fp16` is set (as in TRL), False on a host "
                  "without a bf16 GPU unless `use_cpu` is set (TrainingArguments refuses bf16 there)."},
    )

    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Number of processes to use for processing the dataset."}
    )
    num_mini_batches: int = field(default=1, metadata={"help": "Number of minibatches to split a batch into."})
    total_episodes: int | None = field(
        default=None,
        metadata={"help": "Total number of episodes (sampled prompts); defaults to num_train_epochs * len(dataset)."},
    )
    local_rollout_forward_batch_size: int = field(
        default=64, metadata={"help": "Per-rank chunk size of the no-grad generation and forward passes."}
    )
    num_sample_generations: int = field(
        default=10,
        metadata={"help": "Number of `generate_completions` calls during training (0 disables them)."},
    )
    response_length: int = field(default=53, metadata={"help": "Number of tokens to generate per response."})
    stop_token: Literal["eos"] | None = field(
        default=None,
        metadata={"help": "'eos' truncates responses after the tokenizer's EOS; exclusive with `stop_token_id`."},
    )
    stop_token_id: int | None = field(
        default=None,
        metadata={"help": "Token id after which responses are truncated; exclusive with `stop_token`."},
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of responses without an EOS token (a positive value)."},
    )
    sft_model_path: str = field(
        default="EleutherAI/pythia-160m", metadata={"help": "Path to the SFT model (used by example scripts)."}
    )
    world_size: int | None = field(
        default=None, metadata={"help": "Number of processes; set by the trainer at runtime."}
    )
    num_total_batches: int | None = field(
        default=None, metadata={"help": "Number of PPO iterations; set by the trainer at runtime."}
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "per_device_train_batch_size * world_size; set by the trainer at runtime."},
    )
    local_batch_size: int | None = field(
        default=None,
        metadata={"help": "per_device_train_batch_size * gradient_accumulation_steps; set by the trainer."},
    )
    batch_size: int | None = field(
        default=None,
        metadata={"help": "Global rollout batch (local_batch_size * world_size); set by the trainer at runtime."},
    )
    local_mini_batch_size: int | None = field(
        default=None, metadata={"help": "Per-rank mini-batch size; set by the trainer at runtime."}
    )
    mini_batch_size: int | None = field(
        default=None, metadata={"help": "Global mini-batch size; set by the trainer at runtime."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Whether to push the model to the Hub after training."})
    reward_model_path: str = field(
        default="EleutherAI/pythia-160m",
        metadata={"help": "Path to the reward model (used by example scripts)."},
    )
    model_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the trained PEFT adapter when the model holds several."}
    )
    ref_adapter_name: str | None = field(
        default=None, metadata={"help": "Name of the PEFT adapter that acts as reference model, if any."}
    )
    num_ppo_epochs: int = field(default=4, metadata={"help": "Number of PPO epochs over each rollout batch."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whether to whiten the per-token rewards."})
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient."})
    kl_estimator: Literal["k1", "k3"] = field(
        default="k1",
        metadata={"help": "KL estimator: 'k1' (log-ratio, unbiased) or 'k3' (lower variance, unbiased)."},
    )
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    vf_coef: float = field(default=0.1, metadata={"help": "Value loss coefficient."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value function."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE."})
    loss_normalization: Literal["micro_batch", "mini_batch"] = field(
        default="micro_batch",
        metadata={
            "help": "(trl_trainers extension) 'micro_batch' (TRL): each micro-batch loss is a mean over its own "
            "tokens and gradients are averaged over micro-batches and ranks. 'mini_batch': losses are sums divided by "
            "the token count of the whole mini-batch over all ranks, so the update does not depend on how the "
            "mini-batch is split into micro-batches or ranks even when responses have different lengths."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "When the policy is sharded (DeepSpeed ZeRO-3, or a plan with a sharded actor), gather its "
            "weights once for the whole generation; False under ZeRO-3 gathers per layer through DeepSpeed's hooks "
            "(less memory, slower), as in TRL. FSDP2 always unshards once per phase."
        },
    )

    placement: str | None = field(
        default=None,
        metadata={
            "help": "(trl_trainers extension) Where the four PPO models run (FlexRLHF placements): 'colocated' (every "
            "model on every rank, TRL), 'interleaved' (reference and reward on disjoint owner halves), "
            "'disaggregated' (training ranks and inference ranks with shadow models synced every iteration), or a "
            "path to a .yaml/.json `hf_placement.PlacementPlan`. None: co-located (TRL's data-parallel PPO). "
            "The `placement=` argument of PPOTrainer, when given, wins over this field."
        },
    )
    placement_ratios: str | None = field(
        default=None,
        metadata={"help": "(trl_trainers extension) Interleaved only: share of the ranks owning each frozen model, "
                  "e.g. 'ref=0.5,reward=0.5' (the default split)."},
    )
    rollout_replicas: int = field(
        default=1,
        metadata={"help": "(trl_trainers extension) Disaggregated only: number of shadow-actor generation replicas."},
    )
    placement_timeout_s: float = field(
        default=300.0,
        metadata={"help": "(trl_trainers extension) Timeout in seconds of every placement transfer (experience "
                  "channels, owner dispatch, weight sync); a dead or stalled peer becomes an error naming it."},
    )
    weight_sync: Literal["broadcast", "bucketed_p2p"] = field(
        default="broadcast",
        metadata={"help": "(trl_trainers extension) Disaggregated trainer -> shadow weight transport: 'broadcast' "
                  "or 'bucketed_p2p' (100 MB point-to-point buckets, as APP)."},
    )
    max_staleness: int = field(
        default=0,
        metadata={"help": "(trl_trainers extension) 0: synchronous PPO (all placements compute the same update). 1: "
                  "disaggregated one-step off-policy mode, generating batch u+1 while batch u trains."},
    )

    def __post_init__(self):
        # As in TRL: bf16 by default unless fp16 was asked for; on a host without a bf16 GPU the default is fp32
        # (TrainingArguments refuses bf16 there unless use_cpu=True, so TRL's default failed on every CPU host).
        if self.bf16 is None:
            self.bf16 = not self.fp16 and (self.use_cpu or _bf16_device_available())
        if self.ddp_backend is None and _cpu_only_multiprocess():
            # Without it, Accelerate picks a backend for CPU DeepSpeed launches that is not there (TRL needed the
            # flag on CPU hosts); gloo is what the trainer's own process group uses.
            self.ddp_backend = "gloo"
        if self.gradient_checkpointing is not None:  # TRL scripts pass the old name: it wins over our default
            self.activation_checkpointing = self.gradient_checkpointing
            self.gradient_checkpointing = None
        super().__post_init__()
        # The accelerate config's `mixed_precision` (exported as ACCELERATE_MIXED_PRECISION) applies when the
        # arguments ask for none, as in the HF Trainer.
        if self.mixed_precision == "fp16" and not self.fp16:
            raise ValueError("the accelerate config sets `mixed_precision: fp16`, which PPOTrainer does not support "
                             "(PPO's ratios and KL need bf16's range). Set `mixed_precision: bf16` or 'no'.")
        if self.mixed_precision == "bf16":
            self.bf16 = True
        if self.stop_token is not None and self.stop_token != "eos":
            raise ValueError(
                f"stop_token={self.stop_token!r} is not supported: use 'eos' (the tokenizer's EOS) or None, "
                "or give a token id through `stop_token_id`."
            )
        if self.stop_token is not None and self.stop_token_id is not None:
            raise ValueError(
                f"stop_token={self.stop_token!r} and stop_token_id={self.stop_token_id} are both set; they are "
                "mutually exclusive. Keep one of them."
            )
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(
                f"kl_estimator={self.kl_estimator!r} is not supported: use 'k1' (straightforward, unbiased) or 'k3' "
                "(lower variance, unbiased). See http://joschu.net/blog/kl-approx.html."
            )
        if self.loss_normalization not in ("micro_batch", "mini_batch"):
            raise ValueError(
                f"loss_normalization={self.loss_normalization!r} is not supported: use 'micro_batch' (TRL's) or "
                "'mini_batch' (split-invariant)."
            )
        positive = {
            "num_mini_batches": self.num_mini_batches,
            "num_ppo_epochs": self.num_ppo_epochs,
            "response_length": self.response_length,
            "local_rollout_forward_batch_size": self.local_rollout_forward_batch_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name}={value} must be a positive integer.")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (sampling needs a positive temperature).")
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ValueError(f"total_episodes={self.total_episodes} must be >= 1 (or None for epochs * dataset size).")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(
                f"missing_eos_penalty={self.missing_eos_penalty} must be a positive value: it is subtracted from the "
                "score of responses without EOS."
            )
        self.check_placement_options()
        if self.num_sample_generations < 0:
            raise ValueError(f"num_sample_generations={self.num_sample_generations} must be >= 0.")

    def check_placement_options(self) -> None:
        """Validate the placement options against themselves (the one place they are checked; the plan-dependent
        checks, e.g. ``max_staleness=1`` needs a disaggregated plan, run when the plan is resolved)."""
        if isinstance(self.max_staleness, bool) or self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness={self.max_staleness!r} is not supported: use 0 (synchronous PPO) or 1 "
                             "(one-step off-policy, disaggregated placement only).")
        if self.weight_sync not in ("broadcast", "bucketed_p2p"):
            raise ValueError(f"weight_sync={self.weight_sync!r} is not supported: use 'broadcast' or 'bucketed_p2p'.")
        if not self.placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s={self.placement_timeout_s} must be positive (seconds).")
        if self.rollout_replicas < 1:
            raise ValueError(f"rollout_replicas={self.rollout_replicas} must be a positive integer.")
