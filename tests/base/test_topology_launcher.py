"""The topology takes its intra-group size from the launcher's LOCAL_WORLD_SIZE, and warns when an explicit group
size would make intra groups span the launcher's nodes (their "intra" traffic would cross the inter-node link). The
real launchers are exercised in tests/multinode; here the harness sets LOCAL_WORLD_SIZE as torchrun would."""

from __future__ import annotations

import logging

import pytest

from hf_placement import build_topology, run_distributed

pytestmark = pytest.mark.distributed


def _sizes_and_warnings(rank: int, world: int) -> dict:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("hf_placement.topology").addHandler(handler)
    out = {"default": build_topology().group_size, "warnings": {}}
    for m in (1, 2):  # 1 divides the node size 1; 2 puts both nodes in one "intra" group
        records.clear()
        build_topology(group_size=m)
        out["warnings"][m] = list(records)
    return out


def test_group_size_comes_from_local_world_size_and_node_spanning_groups_warn():
    # two nodes of one rank each, as `torchrun --nnodes 2 --nproc-per-node 1` numbers them
    results = run_distributed(_sizes_and_warnings, 2, env={"LOCAL_WORLD_SIZE": "1"}, timeout=120)
    for res in results:
        assert res["default"] == 1
        assert res["warnings"][1] == []
        (message,) = res["warnings"][2]
        assert "group_size=2 does not divide the launcher's LOCAL_WORLD_SIZE=1" in message and "[1]" in message
