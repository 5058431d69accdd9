"""What the multi-node worker scripts share: how a rank learns which emulated node it is on, and checks that the
groups it trains on match the nodes (the launcher's view, not ours)."""

from __future__ import annotations

import json
import os
import sys

import torch

from hf_placement import Topology, all_gather_single

COLLECTIVE_TIMEOUT_S = 60.0  # every group and collective of the workers: a lost peer is an error, not a hang


def emit(report: dict) -> None:
    """Print ``report`` as one JSON line in a single write: the ranks of a node share their agent's stdout."""
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


def node_of_rank() -> int:
    """The emulated node this process runs on (``HFSP_NODE``, set on its launcher agent by `MultiNodeCluster`)."""
    return int(os.environ["HFSP_NODE"])


def nodes_in(group, size: int) -> list[int]:
    """The node of every member of ``group``, in member order (one all-gather over the group)."""
    mine = torch.tensor([node_of_rank()], dtype=torch.int64)
    out = torch.empty(size, dtype=torch.int64)
    all_gather_single(out, mine, group=group)
    return [int(x) for x in out]


def topology_report(topo: Topology) -> dict:
    """The launcher's variables next to the topology built from them, with the nodes its groups really span."""
    return {
        "rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "world_size": int(os.environ["WORLD_SIZE"]),
        "node": node_of_rank(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "group_size": topo.group_size, "num_groups": topo.num_groups,
        "intra_nodes": nodes_in(topo.intra_group, topo.group_size),
        "inter_nodes": nodes_in(topo.inter_group, topo.num_groups),
    }


def sample(sample_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``sample_id`` of the re-formation test's regression data: ``x`` in R^8, ``y`` a fixed linear map."""
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(sample_id))
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.5
