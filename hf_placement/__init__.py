"""hf_placement: device groups, process groups and (as it lands) placement of RLHF models on them.

`hf_placement.testing.run_distributed` is the shared multi-process harness for tests, examples and benchmarks.
"""

from .testing import RankError, RankTimeoutError, find_free_port, run_distributed
from .topology import DEFAULT_GROUP_TIMEOUT_S, GroupLayout, Topology, build_topology, new_process_groups

__all__ = [
    "DEFAULT_GROUP_TIMEOUT_S",
    "GroupLayout",
    "RankError",
    "RankTimeoutError",
    "Topology",
    "build_topology",
    "find_free_port",
    "new_process_groups",
    "run_distributed",
]
