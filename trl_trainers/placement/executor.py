"""The executor contract: how one PPO iteration of a placement plan runs on this rank, and the registry of executors.

`PPOTrainer` always runs its iterations through an executor (the co-located one by default). An executor receives
everything it schedules up front, in a `PlacementContext` (the plan, its process groups, the sharded roles, the
placement options) and a `trl_trainers.PPOPhases` (the phase functions over this rank's models), and never reaches
back into the trainer. A new placement strategy subclasses `PPOExecutor`, implements `PPOExecutor.iteration` (and
overrides the defaults below where the strategy differs), and registers itself for the plans it runs with
`register_executor`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hf_placement import PlacementPlan, RoleGroups
from hf_placement.runtime import Timeline

from ..ppo_phases import Experience, PPOPhases
from .sharding import RoleSharding

__all__ = ["PPOExecutor", "PlacementContext", "PlacementError", "executor_kind", "make_executor",
           "register_executor", "registered_executors"]


class PlacementError(RuntimeError):
    """A placed PPO iteration failed because a peer rank (named in the message) died, stalled or misbehaved."""


@dataclass(frozen=True)
class PlacementContext:
    """What an executor needs besides the phases, decided once by the trainer's set-up.

    ``rank`` is this rank's index in the world of the plan; ``role_groups`` is ``None`` on a single process;
    ``training_group`` is the group of the ranks that train (``None``: the whole world).
    """

    plan: PlacementPlan
    rank: int
    role_groups: RoleGroups | None
    sharding: RoleSharding
    timeout_s: float
    weight_sync: str
    max_staleness: int
    num_total_batches: int


def to_device(tree: Any, device: torch.device) -> Any:
    """Channels deliver tensors on their transfer device (CPU on gloo); move a received tree to the model's device."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


class PPOExecutor(ABC):
    """Runs PPO iterations of one plan on this rank (see the module docstring for the contract).

    Subclasses implement `iteration`; the defaults cover a rank that trains, holds the reward model whenever it
    scores completions, and shards nothing beyond what `RoleSharding` already holds.
    """

    strategy: ClassVar[str]

    def __init__(self, phases: PPOPhases, context: PlacementContext):
        self.phases, self.context = phases, context
        self.plan, self.rank, self.timeout_s = context.plan, context.rank, context.timeout_s
        self.timeline = Timeline(self.rank)

    @property
    def is_trainer(self) -> bool:
        """Whether this rank holds the optimizer and produces the update."""
        return self.rank in self.plan.roles["actor"]

    @property
    def serves_completions(self) -> bool:
        """Whether this rank generates evaluation completions (`PPOTrainer.generate_completions`)."""
        return True

    @abstractmethod
    def iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        """One PPO iteration (1-based ``update``): the experience this rank trained on and the training statistics,
        or ``(None, None)`` on a rank that does not train."""

    def finish(self, update: int) -> None:  # noqa: B027 - optional hook, most executors have nothing to finish
        """Called once after the last iteration (e.g. a last weight sync)."""

    def completion_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Reward scores of evaluation completions."""
        with self.context.sharding.gathered("reward"):
            return self.phases.reward_scores(queries, responses)

    def full_weights(self) -> AbstractContextManager[Any]:
        """Every model this rank holds has its full weights inside the block (collective under sharded roles)."""
        return self.context.sharding.gathered("actor", "critic", "ref", "reward")

    def bytes_gathered(self) -> int:
        """Parameter all-gather bytes of this rank's sharded models so far."""
        return self.context.sharding.bytes_gathered()

    def train(self, exp: Experience, update: int) -> dict[str, torch.Tensor]:
        """The training phase, on this rank's timeline."""
        with self.timeline.phase("training"):
            return self.phases.train_on_experience(exp, update)


_REGISTRY: dict[str, type[PPOExecutor]] = {}


def register_executor(kind: str) -> Callable[[type[PPOExecutor]], type[PPOExecutor]]:
    """Class decorator: the executor of plans of ``kind`` (see `executor_kind`)."""

    def deco(cls: type[PPOExecutor]) -> type[PPOExecutor]:
        if kind in _REGISTRY and _REGISTRY[kind] is not cls:
            raise ValueError(f"an executor for {kind!r} plans is already registered ({_REGISTRY[kind].__name__}).")
        cls.strategy = kind
        _REGISTRY[kind] = cls
        return cls

    return deco


def registered_executors() -> dict[str, type[PPOExecutor]]:
    return dict(_REGISTRY)


def executor_kind(plan: PlacementPlan) -> str:
    """``"disaggregated"`` when shadow roles exist, ``"colocated"`` when every role is on every rank, else
    ``"interleaved"`` (ref / reward on owner subsets, actor / critic on all ranks)."""
    if plan.is_disaggregated:
        return "disaggregated"
    everyone = list(range(plan.world_size))
    if all(sorted(plan.roles[r]) == everyone for r in ("actor", "critic", "ref", "reward")):
        return "colocated"
    return "interleaved"


def make_executor(phases: PPOPhases, context: PlacementContext) -> PPOExecutor:
    """The registered executor for ``context.plan``."""
    kind = executor_kind(context.plan)
    if kind not in _REGISTRY:
        raise ValueError(f"no executor is registered for {kind} plans (registered: {sorted(_REGISTRY)}).")
    return _REGISTRY[kind](phases, context)
