"""Tour part: the topology layer and the multi-process harness (2 gloo ranks as 1 node x 2, then 2 nodes x 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_placement import build_topology, run_distributed

COMPONENT = "hf_placement"
DESCRIPTION = "2 gloo ranks: topology groups + hierarchical all-reduce"


def _two_level_all_reduce(rank: int, world: int) -> float:
    # All-reduce done as intra-group then inter-group steps equals the flat all-reduce.
    topo = build_topology(group_size=1)
    x = torch.tensor([float(rank + 1)])
    flat = x.clone()
    dist.all_reduce(flat)
    dist.all_reduce(x, group=topo.intra_group)
    dist.all_reduce(x, group=topo.inter_group)
    assert torch.equal(x, flat)
    return x.item()


def run() -> str:
    values = run_distributed(_two_level_all_reduce, 2, timeout=120)
    return f"hierarchical == flat all-reduce on every rank ({values})"
