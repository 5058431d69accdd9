"""Sharded PPO roles on the one sharding engine of the project, `paro_zero_backend.ParoEngine`.

A plan lists ``sharded_roles`` with a PaRO strategy each (``"GGG"`` = ZeRO-3 by default; ``"IIG"`` keeps the
parameter gathers inside a node, and so on). Each role is sharded over *its own* rank set, e.g. under the
interleaved plan of 4 ranks the reference model over ranks [0, 1] and the reward model over [2, 3] (the halved
all-gather of the placement paper), the policy and value model over all 4.

- actor and critic train with one optimizer, so they share one engine over their ranks (same strategy);
  `ParoBackend` hands that engine to the PPO update as its `TrainingBackend`;
- ref and reward are frozen: an inference-only engine each, holding the parameter shard only;
- the trainer's phases pin a model's full weights for the phase that uses it (`RoleSharding.gathered`): one gather
  for a whole rollout (TRL's ``ds3_gather_for_generation=True``), one per scoring pass; training gathers per unit
  and micro-step through the engine's hooks, and reduces gradients as the strategy says.

Process groups are collective to create, so every rank builds every sharded role's topology, in the plan's role
order, before any rank builds an engine; only member ranks build the role's engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from hf_placement import PlacementPlan, Topology, build_topology
from paro_zero_backend import ParoConfig, ParoEngine, parse_strategy

from ..ppo_config import PPOConfig
from ..training_backend import TrainingBackend, adamw_factory

__all__ = ["ParoBackend", "RoleSharding", "ShardSpec", "shard_specs", "sharding_error"]

TRAINED = ("actor", "critic")


@dataclass(frozen=True)
class ShardSpec:
    """One engine of a plan: the roles it holds, their ranks, the PaRO strategy and the ranks per intra group."""

    roles: tuple[str, ...]
    ranks: tuple[int, ...]
    strategy: str
    group_size: int


def shard_specs(plan: PlacementPlan, ranks_per_node: int | None) -> list[ShardSpec]:
    """The engines a plan's ``sharded_roles`` need, in the plan's role order (pure: the same on every rank)."""
    out: list[ShardSpec] = []
    sharded = plan.sharded_roles
    if set(TRAINED) & set(sharded):
        out.append(ShardSpec(TRAINED, tuple(sorted(plan.ranks("actor"))), sharded["actor"],
                             plan.role_group_size("actor", ranks_per_node)))
    for role in ("ref", "reward"):
        if role in sharded:
            out.append(ShardSpec((role,), tuple(sorted(plan.ranks(role))), sharded[role],
                                 plan.role_group_size(role, ranks_per_node)))
    return out


def _seq_cls_units(model: nn.Module) -> list[nn.Module]:
    """A reward / value model is called as ``backbone(...)`` then ``score(...)``: each is a unit of its own."""
    return [getattr(model, model.base_model_prefix), model.score]


def _has_params(model: nn.Module | None) -> bool:
    return model is not None and next(model.parameters(), None) is not None


class ParoBackend(TrainingBackend):
    """Policy + value model trained on a `ParoEngine`: gradients reduced during backward as the strategy says
    (per micro-step for g=I/G, at the boundary otherwise), the optimizer stepping this rank's shards."""

    def __init__(self, engine: ParoEngine):
        self.engine = engine
        self.optimizer = engine.optimizer

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def micro_step(self, last: bool) -> AbstractContextManager[Any]:
        return nullcontext() if last else self.engine.no_sync()

    def step(self) -> None:
        self.engine.step()

    def gathered(self) -> AbstractContextManager[Any]:
        return self.engine.gathered()


class RoleSharding:
    """This rank's sharded roles: topologies for every sharded role (built on every rank) and engines on members.

    Args:
        plan (`PlacementPlan`): validated; its ``sharded_roles`` say what to shard and with which strategy.
        timeout_s (`float`): timeout of the engines' process groups (a stalled peer raises, naming the group).
        ranks_per_node (`int`, *optional*): ranks per node (the launcher's ``LOCAL_WORLD_SIZE``); the I level of a
            strategy partitions inside groups of that many ranks of the role.
    """

    def __init__(self, plan: PlacementPlan, timeout_s: float, ranks_per_node: int | None, rank: int):
        self.plan, self.timeout_s, self.rank = plan, float(timeout_s), rank
        self.specs = shard_specs(plan, ranks_per_node)
        # Collective: every rank creates every topology, in order, before any engine exists.
        self.topologies: dict[tuple[str, ...], Topology] = {
            s.roles: build_topology(group_size=s.group_size, timeout_s=self.timeout_s, ranks=list(s.ranks))
            for s in self.specs}
        self.engines: dict[str, ParoEngine] = {}
        # actor and critic share one engine: each role pins only its own model's buckets
        self._role_modules: dict[str, nn.Module] = {}

    def spec(self, role: str) -> ShardSpec | None:
        return next((s for s in self.specs if role in s.roles), None)

    def is_sharded(self, role: str) -> bool:
        return self.spec(role) is not None

    def _config(self, spec: ShardSpec) -> ParoConfig:
        # unit_module_classes=[]: each model (or backbone / score head) is gathered whole per call, the fewest
        # collectives; the extra units below make the sub-models the trainer calls directly gather themselves. A
        # whole-model unit is entirely gathered during its forward anyway, so keeping it for the backward
        # (reshard_after_forward=False) saves one gather per micro-step at no extra peak memory.
        return ParoConfig(strategy=spec.strategy, group_size=spec.group_size, unit_module_classes=[],
                          reshard_after_forward=False, timeout_s=self.timeout_s)

    def shard_trained(self, model: nn.Module, args: PPOConfig, user_optimizer: bool) -> ParoBackend | None:
        """Shard the policy + value wrapper on this rank's engine; None when actor/critic are not sharded here."""
        spec = self.spec("actor")
        if spec is None or self.rank not in spec.ranks:
            return None
        if user_optimizer:
            raise ValueError("a custom optimizer cannot be combined with sharded actor/critic (it holds the full "
                             "parameters); let PPOTrainer build AdamW, which the PaRO engine then steps on each "
                             "rank's shard.")
        units = [model.policy, *_seq_cls_units(model.value_model)]
        engine = ParoEngine(model, adamw_factory(args), self._config(spec), topology=self.topologies[spec.roles],
                            extra_units=units)
        self.engines["actor"] = self.engines["critic"] = engine
        self._role_modules = {"actor": model.policy, "critic": model.value_model}
        return ParoBackend(engine)

    def shard_frozen(self, role: str, model: nn.Module | None) -> None:
        """Shard a frozen model (ref, reward) on this rank's engine for it; a rule-based model has nothing to shard."""
        spec = self.spec(role)
        if spec is None or self.rank not in spec.ranks or not _has_params(model):
            return
        units = _seq_cls_units(model) if role == "reward" else []
        self.engines[role] = ParoEngine(model, None, self._config(spec), topology=self.topologies[spec.roles],
                                        extra_units=units)

    @contextmanager
    def gathered(self, *roles: str) -> Iterator[None]:
        """Full weights of the named roles held by this rank inside the block (collective over each role's ranks;
        a no-op for roles that are not sharded or not held here). Re-entrant."""
        with ExitStack() as stack:
            for role in dict.fromkeys(roles):
                engine = self.engines.get(role)
                if engine is not None:
                    module = self._role_modules.get(role)
                    stack.enter_context(engine.gathered(module) if module is not None else engine.gathered())
            yield

    def held_engines(self) -> list[ParoEngine]:
        """This rank's engines, each once, in the plan's role order."""
        out: list[ParoEngine] = []
        for engine in self.engines.values():
            if all(engine is not e for e in out):
                out.append(engine)
        return out

    def bytes_gathered(self) -> int:
        """Parameter bytes this rank's engines have sent in all-gathers so far (0 when nothing is sharded here)."""
        return sum(int(e.gathered_bytes) for e in self.held_engines())

    def model_state_bytes(self) -> dict[str, int]:
        """Model-state bytes per sharded role held by this rank (actor and critic share one engine: reported once
        under ``"actor"``), as the engines count them."""
        out: dict[str, int] = {}
        for role in ("actor", "ref", "reward"):
            engine = self.engines.get(role)
            if engine is not None:
                out[role] = int(engine.memory_bytes()["total"])
        return out


def sharding_error(plan: PlacementPlan) -> str | None:
    """Why the plan's ``sharded_roles`` cannot run under this PPO trainer (a message naming the fix), or None."""
    sharded = plan.sharded_roles
    for role, strategy in sharded.items():
        try:
            level = parse_strategy(strategy)
        except (TypeError, ValueError) as exc:
            return f"sharded_roles['{role}'] = {strategy!r}: {exc}"
        if role in ("ref", "reward") and not level.partitions_params:
            return (f"sharded_roles['{role}'] = {strategy!r} keeps the frozen {role} model's parameters whole "
                    "(p=N), so it shards nothing: drop the role from sharded_roles or partition its parameters "
                    "(e.g. 'GGG', or 'IIG' inside a node).")
    shadows = [r for r in ("rollout", "value") if r in sharded]
    if shadows:
        return (f"sharded_roles names the shadow role(s) {shadows}: shadow models are overwritten by the weight sync "
                "every iteration and are kept whole. Drop them from sharded_roles (shard actor/critic on the "
                "training ranks and ref/reward on the inference ranks instead).")
    trained = [r for r in TRAINED if r in sharded]
    if len(trained) == 1:
        return (f"sharded_roles={dict(sharded)} shards '{trained[0]}' only: actor and critic share one optimizer "
                "(one engine), so shard both or neither.")
    if len(trained) == 2 and sharded["actor"] != sharded["critic"]:
        return (f"actor and critic are sharded with different strategies ({sharded['actor']} vs {sharded['critic']}); "
                "they share one engine. Give both the same strategy.")
    return None
