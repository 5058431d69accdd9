"""The placement planner: which plan to run for a job on given hardware (``python -m hf_placement plan``).

- `model_state_bytes` / `shard_verdict`: analytic model-state memory per rank of a plan (sharded roles priced with
  the PaRO engine's memory formula, the engine that shards them);
- `estimate` / `rank_plans` / `candidate_plans`: a pure cost model of one PPO iteration per plan, and the ranking;
- `Calibration` and `hf_placement.planner.calibrate`: measured inputs (phase times, link speeds, contention);
- `compare_to_measured`: score predictions against measured iteration times.
"""

from .cost_model import (
    Calibration,
    Hardware,
    PlanEstimate,
    Workload,
    candidate_plans,
    compare_to_measured,
    estimate,
    rank_plans,
)
from .memory import BYTES_PER_PARAM, MemoryReport, MemoryVerdict, ModelSizes, model_state_bytes, shard_verdict

__all__ = [
    "BYTES_PER_PARAM",
    "Calibration",
    "Hardware",
    "MemoryReport",
    "MemoryVerdict",
    "ModelSizes",
    "PlanEstimate",
    "Workload",
    "candidate_plans",
    "compare_to_measured",
    "estimate",
    "model_state_bytes",
    "rank_plans",
    "shard_verdict",
]
