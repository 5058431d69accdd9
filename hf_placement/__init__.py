"""hf_placement: device groups, process groups and placement of RLHF models on them.

- `PlacementPlan`: roles (actor, critic, ref, reward, rollout, value) -> ranks, with the paper's strategies
  (co-located, interleaved, disaggregated; FlexRLHF, arXiv 2312.11819) as constructors;
- `build_role_groups`: the plan's process groups, created once in one order on every rank;
- `RoleHandle` / `run_concurrently`: owner dispatch (inputs to owners, outputs back; disjoint owners run concurrently);
- `Channel`: typed point-to-point transfers with timeouts; `WeightSync`: versioned, bit-exact trainer -> shadow sync;
- `Timeline`: per-rank phases -> Chrome trace, PNG, idle summary;
- `model_state_bytes` / `shard_verdict`: analytic memory per rank; `rank_plans`: the planner's cost model
  (``python -m hf_placement plan``).

`hf_placement.testing.run_distributed` is the shared multi-process harness for tests, examples and benchmarks.
"""

from .channels import Channel, ChannelError, ChannelTimeoutError
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
from .dispatch import RoleCall, RoleHandle, run_concurrently
from .groups import RoleGroups, build_role_groups
from .memory import BYTES_PER_PARAM, MemoryReport, MemoryVerdict, ModelSizes, model_state_bytes, shard_verdict
from .plan import BASE_ROLES, ROLES, SHADOW_ROLES, STRATEGIES, TRAINED_ROLES, PlacementPlan
from .sharding import ShardedModule, resident_bytes
from .testing import RankError, RankTimeoutError, find_free_port, run_distributed
from .timeline import (
    PhaseEvent,
    Timeline,
    gather_timelines,
    is_wait,
    plot_timeline,
    summarize_timelines,
    to_chrome_trace,
    write_chrome_trace,
)
from .topology import DEFAULT_GROUP_TIMEOUT_S, GroupLayout, Topology, build_topology, new_process_groups
from .weight_sync import SyncStats, WeightSync, WeightSyncError, select_tensors

__all__ = [
    "BASE_ROLES",
    "BYTES_PER_PARAM",
    "Calibration",
    "Channel",
    "ChannelError",
    "ChannelTimeoutError",
    "DEFAULT_GROUP_TIMEOUT_S",
    "GroupLayout",
    "Hardware",
    "MemoryReport",
    "MemoryVerdict",
    "ModelSizes",
    "PhaseEvent",
    "PlacementPlan",
    "PlanEstimate",
    "ROLES",
    "RankError",
    "RankTimeoutError",
    "RoleCall",
    "RoleGroups",
    "RoleHandle",
    "SHADOW_ROLES",
    "STRATEGIES",
    "ShardedModule",
    "SyncStats",
    "TRAINED_ROLES",
    "Timeline",
    "Topology",
    "WeightSync",
    "WeightSyncError",
    "Workload",
    "build_role_groups",
    "build_topology",
    "candidate_plans",
    "compare_to_measured",
    "estimate",
    "find_free_port",
    "gather_timelines",
    "is_wait",
    "model_state_bytes",
    "new_process_groups",
    "plot_timeline",
    "rank_plans",
    "run_concurrently",
    "run_distributed",
    "resident_bytes",
    "select_tensors",
    "shard_verdict",
    "summarize_timelines",
    "to_chrome_trace",
    "write_chrome_trace",
]
