"""Test harnesses shared by every package's tests, examples and benchmarks.

- `run_distributed`: run a function on N gloo ranks on CPU, with timeouts and the failing rank's traceback
  (`set_start_method` lets a process that starts many runs fork its ranks from a server with the imports done);
- `hf_placement.testing.emulated_cluster.EmulatedCluster`: several emulated nodes on one Linux machine (network
  namespaces and a shaped link), for multi-node communication tests and benchmarks (root only);
- `MultiNodeCluster` (`hf_placement.testing.multinode`): the same nodes, each running a real launcher agent
  (`torchrun --nnodes 2` with c10d rendezvous, `accelerate launch --num_machines 2`), for tests of the multi-node
  launch path; `skip_unless_available()` skips a test with the reason where namespaces cannot be made.
"""

from ._harness import RankError, RankTimeoutError, find_free_port, run_distributed, set_start_method
from .multinode import AgentResult, MultiNodeCluster, MultiNodeError, MultiNodeRun, skip_unless_available

__all__ = ["AgentResult", "MultiNodeCluster", "MultiNodeError", "MultiNodeRun", "RankError", "RankTimeoutError",
           "find_free_port", "run_distributed", "set_start_method", "skip_unless_available"]
