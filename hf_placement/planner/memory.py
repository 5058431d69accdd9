"""Analytic model-state memory per rank for a `PlacementPlan`.

Model state = weights + gradients + optimizer state of the trained roles, and weights of the frozen ones (ref,
reward, shadow actor, shadow critic). Activations, KV cache and the framework runtime are excluded on purpose: they
depend on the batch, not on the placement, and on CPU the torch runtime dominates RSS.

Bytes per element of each state:

| precision | weights | gradients | optimizer (Adam m, v; + fp32 master in bf16) | trained | frozen |
|---|---|---|---|---|---|
| ``fp32`` (CPU) | 4 | 4 | 8 | 16 | 4 |
| ``bf16`` (GPU mixed precision) | 2 | 2 | 12 | 16 | 2 |

A role in ``plan.sharded_roles`` is held the way the PaRO engine that shards it holds it: its strategy partitions
weights, gradients and optimizer state over the role's ranks (``n``) or inside groups of ``m`` of them, so this
module prices every role with `hf_placement.partition.memory_bytes` (an unsharded role is strategy ``"NNN"``), the same
formula the engine's own byte counts are checked against. With LoRA (``lora_fraction`` = adapter parameters / model
parameters) a trained role holds its frozen base weights plus the adapter's weights, gradients and optimizer state.
For four equal models of Φ parameters in fp32 this gives, per rank: co-located 40Φ, interleaved 36Φ, disaggregated
32Φ (trainer) / 16Φ (generator), co-located ZeRO-3 (``"GGG"``) over 2 ranks 20Φ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..partition import memory_bytes as partition_memory_bytes
from ..plan import BASE_ROLES, DEFAULT_SHARD_STRATEGY, ROLES, SHADOW_OF, TRAINED_ROLES, PlacementPlan

__all__ = ["BYTES_PER_PARAM", "MemoryReport", "MemoryVerdict", "ModelSizes", "STATE_BYTES", "model_state_bytes",
           "shard_verdict"]

#: (weights, gradients, optimizer state) bytes per element by precision.
STATE_BYTES: dict[str, tuple[float, float, float]] = {"fp32": (4.0, 4.0, 8.0), "bf16": (2.0, 2.0, 12.0)}
#: (trained, frozen) bytes per parameter by precision, unsharded.
BYTES_PER_PARAM: dict[str, tuple[float, float]] = {k: (sum(v), v[0]) for k, v in STATE_BYTES.items()}


@dataclass(frozen=True)
class ModelSizes:
    """Parameter counts of the four RLHF models (shadows mirror actor and critic)."""

    actor: float = field(metadata={"help": "Parameters of the actor (policy)."})
    critic: float | None = field(default=None, metadata={"help": "Parameters of the critic; defaults to actor."})
    ref: float | None = field(default=None, metadata={"help": "Parameters of the reference; defaults to actor."})
    reward: float | None = field(default=None, metadata={"help": "Parameters of the reward model; defaults to "
                                                                 "critic."})
    lora_fraction: float | None = field(default=None, metadata={
        "help": "Trainable adapter parameters / model parameters when actor and critic train LoRA adapters."})

    def __post_init__(self) -> None:
        if self.critic is None:
            object.__setattr__(self, "critic", self.actor)
        if self.ref is None:
            object.__setattr__(self, "ref", self.actor)
        if self.reward is None:
            object.__setattr__(self, "reward", self.critic)
        for name in BASE_ROLES:
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"ModelSizes.{name}={v!r}: parameter counts must be positive.")
        if self.lora_fraction is not None and not 0 < self.lora_fraction <= 1:
            raise ValueError(f"lora_fraction={self.lora_fraction} must be in (0, 1] (adapter params / model params).")

    def params(self, role: str) -> float:
        return float(getattr(self, SHADOW_OF.get(role, role)))


@dataclass
class MemoryReport:
    """Model-state bytes per rank, split by role."""

    plan: PlacementPlan
    precision: str
    per_rank: dict[int, dict[str, float]]

    def rank_bytes(self, rank: int) -> float:
        return float(sum(self.per_rank[rank].values()))

    @property
    def max_bytes(self) -> float:
        return max(self.rank_bytes(r) for r in self.per_rank)

    @property
    def total_bytes(self) -> float:
        return float(sum(self.rank_bytes(r) for r in self.per_rank))

    def over_cap(self, cap_bytes: float) -> list[int]:
        """Ranks whose model state exceeds ``cap_bytes``."""
        return [r for r in sorted(self.per_rank) if self.rank_bytes(r) > cap_bytes]

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "max_bytes": self.max_bytes, "total_bytes": self.total_bytes,
                "per_rank": {str(r): {"total": self.rank_bytes(r), **self.per_rank[r]} for r in sorted(self.per_rank)}}


def role_state_bytes(plan: PlacementPlan, role: str, sizes: ModelSizes, precision: str = "fp32",
                     ranks_per_node: int | None = None) -> float:
    """Model-state bytes one rank of ``role`` holds (the role's strategy over its ranks; unsharded = ``"NNN"``)."""
    weights, grads, optim = STATE_BYTES[precision]
    psi = sizes.params(role)
    trained, total = 0.0, psi
    if role in TRAINED_ROLES:
        trained = psi * (sizes.lora_fraction or 1.0)
        total = psi + (trained if sizes.lora_fraction is not None else 0.0)  # base weights + adapter weights
    n = len(plan.ranks(role))
    if role not in plan.sharded_roles:  # replicated: every rank holds everything (the intra group does not matter)
        return float(partition_memory_bytes("NNN", total, trained, n, n, weights, grads, optim)["total"])
    strategy = plan.sharded_roles[role]
    m = plan.role_group_size(role, ranks_per_node)
    return float(partition_memory_bytes(strategy, total, trained, n, m, weights, grads, optim)["total"])


def model_state_bytes(plan: PlacementPlan, sizes: ModelSizes | Mapping[str, float], precision: str = "fp32",
                      ranks_per_node: int | None = None) -> MemoryReport:
    """Model-state bytes per rank of ``plan`` for models of ``sizes`` parameters.

    ``ranks_per_node`` sets the intra group (``m``) of sharded roles whose strategy partitions at the I level;
    ``None`` makes each role's ranks one group.
    """
    if precision not in STATE_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(STATE_BYTES)} ('fp32' = CPU fp32 + "
                         "Adam, 'bf16' = GPU bf16 mixed precision + Adam).")
    if not isinstance(sizes, ModelSizes):
        sizes = ModelSizes(**dict(sizes))
    per_rank: dict[int, dict[str, float]] = {r: {} for r in range(plan.world_size)}
    for role in ROLES:
        if role not in plan.roles:
            continue
        per = role_state_bytes(plan, role, sizes, precision, ranks_per_node)
        for r in plan.roles[role]:
            per_rank[r][role] = per
    return MemoryReport(plan=plan, precision=precision, per_rank=per_rank)


@dataclass
class MemoryVerdict:
    """Whether a plan fits a per-rank cap as is, or only with its models sharded inside their groups."""

    fits: bool
    must_shard: bool
    fits_sharded: bool
    report: MemoryReport
    sharded_report: MemoryReport
    cap_bytes: float

    @property
    def message(self) -> str:
        gb = 1e9
        if self.fits:
            return f"fits: {self.report.max_bytes / gb:.3g} GB <= cap {self.cap_bytes / gb:.3g} GB per rank"
        if self.fits_sharded:
            return (f"must shard: {self.report.max_bytes / gb:.3g} GB > cap {self.cap_bytes / gb:.3g} GB per rank; "
                    f"sharded inside role groups {self.sharded_report.max_bytes / gb:.3g} GB fits")
        return (f"does not fit even sharded: {self.sharded_report.max_bytes / gb:.3g} GB > cap "
                f"{self.cap_bytes / gb:.3g} GB per rank")


def shard_verdict(plan: PlacementPlan, sizes: ModelSizes | Mapping[str, float], cap_bytes: float,
                  precision: str = "fp32", ranks_per_node: int | None = None) -> MemoryVerdict:
    """Check ``plan`` against a per-rank model-state cap; if it does not fit, try its four base models sharded
    (ZeRO-3, ``"GGG"``) inside their rank groups (shadow models stay whole: the weight sync overwrites them)."""
    if not cap_bytes > 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}.")
    report = model_state_bytes(plan, sizes, precision, ranks_per_node)
    sharded_plan = PlacementPlan(world_size=plan.world_size, roles=plan.roles, strategy=plan.strategy,
                                 rollout_replicas=plan.rollout_replicas,
                                 sharded_roles={**dict.fromkeys(BASE_ROLES, DEFAULT_SHARD_STRATEGY),
                                                **plan.sharded_roles})
    sharded = model_state_bytes(sharded_plan, sizes, precision, ranks_per_node)
    fits = report.max_bytes <= cap_bytes
    return MemoryVerdict(fits=fits, must_shard=not fits, fits_sharded=sharded.max_bytes <= cap_bytes,
                         report=report, sharded_report=sharded, cap_bytes=float(cap_bytes))
