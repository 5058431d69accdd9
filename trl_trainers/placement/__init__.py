"""PPO under the FlexRLHF placements (All-colocated, Interleaving, Disaggregated), same update at staleness 0.

The entry point is `trl_trainers.PPOTrainer` itself:

```python
from trl_trainers import PPOTrainer

trainer = PPOTrainer(args, tok, policy, None, reward_model, train_ds, value_model, placement="interleaved")
trainer.train()
```

``placement`` is a `hf_placement.PlacementPlan`, a strategy name or a YAML/JSON plan file (or ``PPOConfig.placement``
with ``placement_ratios``, ``rollout_replicas``, ``placement_timeout_s``, ``weight_sync``, ``max_staleness``). A plan's
``sharded_roles`` are sharded over their own ranks by `paro_zero_backend.ParoEngine` with the PaRO strategy the plan
names per role. Each rank records a `hf_placement.runtime.Timeline` of its phases (``trainer.timeline``,
``trainer.gather_timeline()``).

This package holds: plan resolution (`resolve_plan`, `plan_from_config`, `equivalence_issues`), the set-up
(`prepare_placement`), sharded roles (`RoleSharding`, `ParoBackend`), the executor contract and registry
(`PPOExecutor`, `register_executor`, `make_executor`) and the three executors.
"""

from .colocated import ColocatedExecutor
from .disaggregated import DisaggregatedExecutor
from .executor import (
    PlacementContext,
    PlacementError,
    PPOExecutor,
    executor_kind,
    make_executor,
    register_executor,
    registered_executors,
)
from .interleaved import InterleavedExecutor
from .resolve import equivalence_issues, plan_from_config, resolve_plan
from .setup import PlacementSetup, prepare_placement
from .sharding import ParoBackend, RoleSharding, ShardSpec, shard_specs, sharding_error

__all__ = [
    "ColocatedExecutor",
    "DisaggregatedExecutor",
    "InterleavedExecutor",
    "PPOExecutor",
    "ParoBackend",
    "PlacedPPOTrainer",
    "PlacementContext",
    "PlacementError",
    "PlacementSetup",
    "RoleSharding",
    "ShardSpec",
    "equivalence_issues",
    "executor_kind",
    "make_executor",
    "plan_from_config",
    "prepare_placement",
    "register_executor",
    "registered_executors",
    "resolve_plan",
    "shard_specs",
    "sharding_error",
]


def __getattr__(name: str):
    # PlacedPPOTrainer subclasses PPOTrainer, which imports this package: load it on first use.
    if name == "PlacedPPOTrainer":
        from .trainer import PlacedPPOTrainer

        return PlacedPPOTrainer
    raise AttributeError(f"module 'trl_trainers.placement' has no attribute {name!r}")
