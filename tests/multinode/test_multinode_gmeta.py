"""G-Meta with row-sharded embedding tables on two emulated nodes (network namespaces, root): MetaTrainer under
``torchrun --nnodes 2`` (2 ranks per node, c10d rendezvous on node 0), its tables split over the four ranks of both
nodes, ends with the parameters of the single-process run of the same configuration (unsharded, fp32 tolerance),
as tests/gmeta/test_gmeta_distributed.py checks on one node; and resuming from the per-rank sharded checkpoint of
that launch ends bit-identical to the straight run. Skipped with the reason where namespaces cannot be created.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gmeta_worker import SAVE_AT, STEPS, build_trainer, state_of

from hf_placement.testing import MultiNodeCluster, skip_unless_available

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

HERE = Path(__file__).resolve().parent
NPROC = 2  # per node: a world of 4, each node holding two of the four row blocks


@pytest.fixture(scope="module")
def cluster():
    skip_unless_available()
    with MultiNodeCluster() as c:
        yield c
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in leftover for ns in c.namespaces), "namespaces left behind"


@pytest.mark.timeout(400)
def test_sharded_tables_on_two_nodes_equal_one_process_and_resume_exactly(cluster, tmp_path):
    world = 2 * NPROC
    out = tmp_path / "result.pt"
    agents = cluster.torchrun(str(HERE / "gmeta_worker.py"), ["--root", str(tmp_path / "job"), "--out", str(out)],
                              nproc_per_node=NPROC, timeout=300)
    reports = sorted((r for a in agents for r in a.json_lines() if "rank" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(world)), [a.stdout[-2000:] for a in agents]
    for agent in agents:  # a worker's report comes out of its own node's agent
        assert {r["node"] for r in agent.json_lines() if "rank" in r} == {agent.node}
    # the row blocks tile the table, and both nodes hold some of them (lookups cross the inter-node link)
    blocks = [tuple(r["rows"]) for r in reports]
    assert blocks[0][0] == 0 and blocks[-1][1] == reports[0]["num_rows"]
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(blocks, blocks[1:]))
    assert {r["node"] for r in reports} == {0, 1}
    # the checkpoint of the 2-node launch: one shard file per rank, from both nodes
    index = json.loads((tmp_path / "job" / "straight" / f"checkpoint-{SAVE_AT}" / "gmeta_shards" / "index.json")
                       .read_text())
    assert index["world_size"] == world, index
    assert all(r["resumed_step"] == STEPS for r in reports)

    result = torch.load(out)
    reference = build_trainer(str(tmp_path / "one"), 1, shard=False)
    start = state_of(reference)
    reference.train()
    ref = state_of(reference)
    for name, value in ref.items():
        assert not torch.allclose(value, start[name]), f"{name} did not train"
        np.testing.assert_allclose(result["straight"][name].numpy(), value.numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"two nodes vs one process: {name}")
        torch.testing.assert_close(result["resumed"][name], result["straight"][name], rtol=0, atol=0,
                                   msg=f"resumed from the sharded checkpoint vs straight: {name}")
