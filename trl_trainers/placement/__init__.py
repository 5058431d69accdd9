"""PPO under the FlexRLHF placements (All-colocated, Interleaving, Disaggregated), same update at staleness 0.

The entry point is `trl_trainers.PPOTrainer` itself:

```python
from trl_trainers import PPOTrainer

trainer = PPOTrainer(args, tok, policy, None, reward_model, train_ds, value_model, placement="interleaved")
trainer.train()
```

``placement`` is a `hf_placement.PlacementPlan`, a strategy name or a YAML/JSON plan file (or ``PPOConfig.placement``
with ``placement_ratios``, ``rollout_replicas``, ``placement_timeout_s``, ``weight_sync``, ``max_staleness``). Each
rank records a `hf_placement.Timeline` of its phases (``trainer.timeline``, ``trainer.gather_timeline()``). This
package holds the machinery: plan resolution (`resolve_plan`, `prepare_placement`), the executors, and
`PlacedPPOTrainer`, the first API (placement settings as keyword arguments), kept as a thin alias.
"""

from .executors import ColocatedExecutor, DisaggregatedExecutor, InterleavedExecutor, PlacementError, make_executor
from .trainer import (
    PlacedPPOTrainer,
    PlacementSetup,
    attach_placement,
    equivalence_issues,
    prepare_placement,
    resolve_plan,
)

__all__ = [
    "ColocatedExecutor",
    "DisaggregatedExecutor",
    "InterleavedExecutor",
    "PlacedPPOTrainer",
    "PlacementError",
    "PlacementSetup",
    "attach_placement",
    "equivalence_issues",
    "make_executor",
    "prepare_placement",
    "resolve_plan",
]
