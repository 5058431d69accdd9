"""The RLHF placement runtime: what moves between ranks once a `PlacementPlan` has placed the models.

- `RoleHandle` / `run_concurrently`: owner dispatch (inputs to the owners of a role, outputs back; roles on disjoint
  owners run concurrently);
- `Channel`: typed point-to-point transfers with timeouts;
- `WeightSync`: versioned, bit-exact trainer -> shadow weight sync (broadcast or bucketed point-to-point);
- `Timeline`: per-rank phases -> Chrome trace, PNG, idle summary;
- `resident_bytes`: model-state bytes a process holds right now (the measured side of the memory accountant).

Executors that schedule a training algorithm on these pieces live with the trainer (`trl_trainers.placement`).
"""

from .channels import Channel, ChannelError, ChannelTimeoutError
from .dispatch import RoleCall, RoleHandle, run_concurrently
from .resident import resident_bytes
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
from .weight_sync import SyncStats, WeightSync, WeightSyncError, select_tensors

__all__ = [
    "Channel",
    "ChannelError",
    "ChannelTimeoutError",
    "PhaseEvent",
    "RoleCall",
    "RoleHandle",
    "SyncStats",
    "Timeline",
    "WeightSync",
    "WeightSyncError",
    "gather_timelines",
    "is_wait",
    "plot_timeline",
    "resident_bytes",
    "run_concurrently",
    "select_tensors",
    "summarize_timelines",
    "to_chrome_trace",
    "write_chrome_trace",
]
