"""hf_placement: the topology base every package builds on, plus the RLHF placement runtime and planner wings.

The base (this package outside its wings) is small and knows no trainer:

- `build_topology` / `Topology` / `GroupLayout`: two-level (intra/inter group) layouts and their process groups,
  created once, in one order, with timeouts (`new_process_groups` is the one place that calls ``new_group``);
- `PlacementPlan`: which ranks hold which RLHF role (FlexRLHF, arXiv 2312.11819), pure validated data;
- `build_role_groups` / `RoleGroups`: a plan's process groups;
- `run_distributed` (`hf_placement.testing`): the gloo harness every test, example and benchmark uses;
- `release_process_groups` / `release_process_groups_at_exit`: destroy every group while the interpreter is alive
  (a gloo group left to interpreter exit can abort a finished worker).

Wings, imported only by those who need them:

- `hf_placement.runtime`: owner dispatch, channels, weight sync, timelines;
- `hf_placement.planner`: memory accountant, cost model, calibration and the CLI (``python -m hf_placement plan``).

Names that used to be exported here from the wings still resolve, with a `FutureWarning` naming their new place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from typing import Any

from .groups import RoleGroups, build_role_groups
from .lifecycle import release_process_groups, release_process_groups_at_exit
from .plan import BASE_ROLES, ROLES, SHADOW_ROLES, STRATEGIES, TRAINED_ROLES, PlacementPlan
from .testing import RankError, RankTimeoutError, find_free_port, run_distributed
from .topology import (
    DEFAULT_GROUP_TIMEOUT_S,
    GroupLayout,
    Topology,
    all_gather_single,
    backend_device_types,
    build_topology,
    check_collective_device,
    collective_device,
    new_process_groups,
    reduce_scatter_single,
)

__all__ = [
    "BASE_ROLES",
    "DEFAULT_GROUP_TIMEOUT_S",
    "GroupLayout",
    "PlacementPlan",
    "ROLES",
    "RankError",
    "RankTimeoutError",
    "RoleGroups",
    "SHADOW_ROLES",
    "STRATEGIES",
    "TRAINED_ROLES",
    "Topology",
    "all_gather_single",
    "backend_device_types",
    "build_role_groups",
    "build_topology",
    "check_collective_device",
    "collective_device",
    "find_free_port",
    "new_process_groups",
    "reduce_scatter_single",
    "release_process_groups",
    "release_process_groups_at_exit",
    "run_distributed",
]

_REMOVAL = "0.3.0"
_RUNTIME_NAMES = ("Channel", "ChannelError", "ChannelTimeoutError", "PhaseEvent", "RoleCall", "RoleHandle",
                  "SyncStats", "Timeline", "WeightSync", "WeightSyncError", "gather_timelines", "is_wait",
                  "plot_timeline", "resident_bytes", "run_concurrently", "select_tensors", "summarize_timelines",
                  "to_chrome_trace", "write_chrome_trace")
_PLANNER_NAMES = ("BYTES_PER_PARAM", "Calibration", "Hardware", "MemoryReport", "MemoryVerdict", "ModelSizes",
                  "PlanEstimate", "Workload", "candidate_plans", "compare_to_measured", "estimate", "model_state_bytes",
                  "rank_plans", "shard_verdict")
_MOVED_NAMES = {**dict.fromkeys(_RUNTIME_NAMES, "hf_placement.runtime"),
                **dict.fromkeys(_PLANNER_NAMES, "hf_placement.planner")}
_REMOVED_NAMES = {
    "ShardedModule": "hf_placement.ShardedModule was removed: sharding is done by the one sharding engine, "
                     "paro_zero_backend.ParoEngine (strategy 'GGG' = ZeRO-3; ParoEngine.gathered() replaces "
                     "ShardedModule.gathered()). Under PPO, list the roles in PlacementPlan(sharded_roles=...).",
}
_MOVED_MODULES = {f"hf_placement.{old}": f"hf_placement.{wing}.{old}" for wing, olds in (
    ("runtime", ("channels", "dispatch", "weight_sync", "timeline")),
    ("planner", ("cost_model", "memory", "calibrate"))) for old in olds}
_MOVED_MODULES["hf_placement.sharding"] = "paro_zero_backend.ParoEngine (ShardedModule was removed)"


def __getattr__(name: str) -> Any:
    """Old top-level names of the wings: resolve them with a warning that names the new place."""
    if name in _MOVED_NAMES:
        new = _MOVED_NAMES[name]
        warnings.warn(f"hf_placement.{name} moved to {new}.{name}; import it from {new}. The old name will be "
                      f"removed in hf-scale-plugins {_REMOVAL}.", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(new), name)
    if name in _REMOVED_NAMES:
        raise AttributeError(_REMOVED_NAMES[name])
    raise AttributeError(f"module 'hf_placement' has no attribute {name!r}")


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """``import hf_placement.channels`` (a module that moved into a wing) fails with a message naming its new place."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        new = _MOVED_MODULES.get(fullname)
        if new is not None:
            raise ModuleNotFoundError(f"{fullname} moved to {new}; import it from there (the module moved when "
                                      "hf_placement was split into its base, runtime and planner).", name=fullname)
        return None


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
