"""The seam between the PPO update and whatever holds the trained weights: one gradient-sync path per engine.

`PPOPhases.train_on_experience` runs the same loop whatever the engine: zero the gradients, run each micro-batch's
backward inside `TrainingBackend.micro_step` (which tells the engine whether this is the accumulation boundary),
then `TrainingBackend.step`. The engine decides how gradients are synchronised and where the optimizer state lives:

- `ReplicatedBackend`: every training rank holds the full policy and value model (DDP's layout); gradients are
  averaged with one flat all-reduce per optimizer step, in a fixed order;
- `trl_trainers.placement.ParoBackend`: the models are sharded by `paro_zero_backend.ParoEngine` (any of the PaRO
  strategies; ``"GGG"`` is ZeRO-3), which reduces gradients during backward and steps its optimizer on the shards;
- `trl_trainers.accelerate_backends`: DeepSpeed ZeRO or FSDP2, prepared by Accelerate from the launch's config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from ._distributed import DistContext
from .ppo_config import PPOConfig

__all__ = ["ReplicatedBackend", "TrainingBackend", "adamw_factory"]


def adamw_factory(args: PPOConfig):
    """``fn(params_or_groups) -> optimizer``: the optimizer the HF Trainer (and so TRL's PPO trainer) builds from
    ``args.optim`` (default ``adamw_torch_fused``, several times faster than the per-tensor loop on CPU) with the
    config's learning rate, betas, epsilon and weight decay."""
    from transformers import Trainer

    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    kwargs = {**kwargs, "weight_decay": args.weight_decay}

    def make(params: Any) -> torch.optim.Optimizer:
        return optimizer_cls(params, **kwargs)

    return make


class TrainingBackend(ABC):
    """What the PPO update needs from the engine that trains policy + value model.

    A backend implements: `optimizer` (the object LR schedulers act on), `zero_grad`, `micro_step` (a context for
    one micro-batch's forward and backward; ``last=True`` marks the accumulation boundary), `step` (synchronise the
    gradients if the engine has not already, update, clear) and `gathered` (a context in which the trained models
    hold their full weights: a no-op unless the engine shards them; collective when it does).
    """

    optimizer: torch.optim.Optimizer

    @abstractmethod
    def zero_grad(self) -> None:
        """Drop gradients accumulated so far."""

    @abstractmethod
    def micro_step(self, last: bool) -> AbstractContextManager[Any]:
        """Context around one micro-batch's forward and backward."""

    @abstractmethod
    def step(self) -> None:
        """Synchronise gradients over the training group, update the weights, clear the gradients."""

    def gathered(self) -> AbstractContextManager[Any]:
        """Full weights of the trained models inside the block."""
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already scaled) loss."""
        loss.backward()

    def train_forward(self, model: nn.Module, query_responses: torch.Tensor, pad_token_id: int,
                      context_length: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy logits of the response tokens and per-position values (`PolicyAndValueWrapper.forward`).

        Called without the wrapper's own module hooks here; an engine whose hooks start at the root (DeepSpeed,
        FSDP2) calls its prepared root instead."""
        return model.forward(query_responses, pad_token_id, context_length, temperature)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full state dict of ``module`` (one of the trained models), for saving; call inside `gathered` when the
        engine shards (collective there)."""
        return module.state_dict()

    def model_state_bytes(self) -> int | None:
        """Bytes of parameters and optimizer state this rank holds for the trained models (None: not measured)."""
        return None


class ReplicatedBackend(TrainingBackend):
    """Full models on every training rank; one flat all-reduce of the gradients per optimizer step (DDP's result).

    Why not DDP itself: the gradients are averaged once per optimizer step in one bucket and a fixed order, over an
    explicit group (a disaggregated plan trains on a sub-group), which keeps every placement's update identical.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dist: DistContext):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.dist = optimizer, dist
        dist.broadcast_module(model)  # identical start on every rank, as DDP guarantees

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def micro_step(self, last: bool) -> AbstractContextManager[Any]:
        return nullcontext()

    def step(self) -> None:
        self.dist.average_gradients(self.params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
