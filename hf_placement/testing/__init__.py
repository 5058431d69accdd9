"""Test harnesses shared by every package's tests, examples and benchmarks.

- `run_distributed`: run a function on N gloo ranks on CPU, with timeouts and the failing rank's traceback;
- `hf_placement.testing.emulated_cluster.EmulatedCluster`: several emulated nodes on one Linux machine (network
  namespaces and a shaped link), for multi-node communication tests and benchmarks (root only).
"""

from ._harness import RankError, RankTimeoutError, find_free_port, run_distributed

__all__ = ["RankError", "RankTimeoutError", "find_free_port", "run_distributed"]
