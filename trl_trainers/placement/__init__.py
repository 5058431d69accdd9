"""PPO under the FlexRLHF placements (All-colocated, Interleaving, Disaggregated), same update at staleness 0.

```python
from trl_trainers.placement import PlacedPPOTrainer

trainer = PlacedPPOTrainer(args, tok, policy, None, reward_model, train_ds, value_model, placement="interleaved")
trainer.train()
```

``placement`` is a `hf_placement.PlacementPlan`, a strategy name or a YAML/JSON plan file. Each rank records a
`hf_placement.Timeline` of its phases (``trainer.timeline``, ``trainer.gather_timeline()``).
"""

from .executors import ColocatedExecutor, DisaggregatedExecutor, InterleavedExecutor, PlacementError, make_executor
from .trainer import PlacedPPOTrainer, equivalence_issues, resolve_plan

__all__ = [
    "ColocatedExecutor",
    "DisaggregatedExecutor",
    "InterleavedExecutor",
    "PlacedPPOTrainer",
    "PlacementError",
    "equivalence_issues",
    "make_executor",
    "resolve_plan",
]
