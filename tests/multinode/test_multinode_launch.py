"""Real multi-node launches on the emulated two-node cluster (network namespaces, root): `torchrun --nnodes 2` and
`accelerate launch --num_machines 2` agents, one per node, with c10d rendezvous on node 0.

Each run checks the launcher's view against the topology built from it (LOCAL_WORLD_SIZE -> intra groups that really
are one node, inter groups that span both) and compares the trained weights with the single-process reference on the
same global batches (fp32 tolerance). Skipped with the reason where namespaces cannot be created.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from _multinode_common import COLLECTIVE_TIMEOUT_S, sample

from hf_placement.testing import AgentResult, MultiNodeCluster, MultiNodeError, skip_unless_available
from paro_zero_backend.testing import make_batches, max_rel_diff, reference_run, tiny_gpt2

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
FP32_TOL = 1e-5
STEPS = 2


@pytest.fixture(scope="module")
def cluster():
    skip_unless_available()
    with MultiNodeCluster() as c:
        yield c
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in leftover for ns in c.namespaces), "namespaces left behind"


def _reports(agents: list[AgentResult], world: int) -> list[dict]:
    """The per-rank JSON reports of every agent's workers, indexed by global rank."""
    reports = sorted((r for a in agents for r in a.json_lines() if "rank" in r), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == list(range(world)), [a.stdout[-2000:] for a in agents]
    for agent in agents:  # a worker's report comes out of its own node's agent
        assert {r["node"] for r in agent.json_lines() if "rank" in r} == {agent.node}
    return reports


def _check_node_local_groups(reports: list[dict], nproc: int) -> None:
    """Intra groups = the ranks of one node, sized by the launcher's LOCAL_WORLD_SIZE; inter groups span the nodes."""
    for r in reports:
        assert r["world_size"] == 2 * nproc and r["local_world_size"] == nproc
        assert r["group_size"] == nproc and r["num_groups"] == 2
        assert r["intra_nodes"] == [r["node"]] * nproc, r
        assert sorted(r["inter_nodes"]) == [0, 1], r
    # the rendezvous, not our code, numbered the ranks: each node holds consecutive ones, LOCAL_RANK counts within
    for node in (0, 1):
        mine = [r for r in reports if r["node"] == node]
        assert sorted(r["local_rank"] for r in mine) == list(range(nproc))
        assert {r["rank"] // nproc for r in mine} == {mine[0]["rank"] // nproc}


def _reference(world: int) -> dict[str, torch.Tensor]:
    return reference_run(tiny_gpt2(), make_batches(STEPS, 1, world))


def test_torchrun_two_nodes_paro_engine_on_node_local_groups(cluster, tmp_path):
    nproc = 2
    out = tmp_path / "weights.pt"
    agents = cluster.torchrun(str(HERE / "paro_torchrun_worker.py"),
                              ["--strategy", "IIG", "--steps", str(STEPS), "--out", str(out)],
                              nproc_per_node=nproc, timeout=150)
    reports = _reports(agents, 2 * nproc)
    _check_node_local_groups(reports, nproc)
    assert all(r["engine_group_size"] == nproc and r["engine_on_topology"] for r in reports)
    assert max_rel_diff(torch.load(out), _reference(2 * nproc)) < FP32_TOL


@pytest.mark.parametrize("strategy, nproc", [pytest.param("IIG", 2, marks=pytest.mark.slow), ("GGG", 1)])
def test_accelerate_launch_paro_config_equals_single_node(cluster, tmp_path, strategy, nproc):
    paro = tmp_path / "paro.yaml"
    paro.write_text(f"strategy: {strategy}\n")  # no group_size: it must come from the launcher
    out = tmp_path / "weights.pt"
    agents = cluster.accelerate(str(HERE / "paro_accelerate_worker.py"), ["--steps", str(STEPS), "--out", str(out)],
                                nproc_per_node=nproc, env={"PARO_CONFIG_FILE": str(paro)}, timeout=150)
    reports = _reports(agents, 2 * nproc)
    _check_node_local_groups(reports, nproc)
    assert {r["strategy"] for r in reports} == {strategy}
    assert max_rel_diff(torch.load(out), _reference(2 * nproc)) < FP32_TOL


FAILING = """
import os, sys, time
if os.environ["HFSP_NODE"] == "1":
    sys.exit("worker on node 1 fails on purpose")
time.sleep(300)
"""


def test_failed_agent_is_named_and_everything_is_cleaned_up(cluster, tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    with pytest.raises(MultiNodeError, match=r"node 1's agent \(torchrun\) failed") as info:
        cluster.torchrun(str(script), nproc_per_node=1, timeout=60)
    assert "fails on purpose" in str(info.value)
    for ns in cluster.namespaces:  # node 0's sleeping worker was killed with its agent
        assert subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.strip() == ""


def _linear_reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """The uninterrupted single-process run of restart_worker.py: mean of the ranks' losses at every step."""
    model = torch.nn.Linear(8, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        for r in range(world):
            x, y = sample(step * world + r)
            (torch.nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_killed_node_agent_rejoins_and_the_job_reforms(cluster, tmp_path):
    """torchrun --max-restarts 1: node 1 dies mid-job (agent and workers SIGKILLed), a replacement agent joins the
    c10d rendezvous, node 0's agent restarts its failed workers and the job resumes from its last checkpoint."""
    steps, pause_after, world = 4, 2, 2
    marker, out = tmp_path / "paused", tmp_path / "weights.pt"
    run = cluster.start_torchrun(
        str(HERE / "restart_worker.py"),
        ["--steps", str(steps), "--pause-after", str(pause_after), "--ckpt", str(tmp_path / "ckpt.pt"),
         "--marker", str(marker), "--out", str(out)],
        nproc_per_node=1, max_restarts=1, agent_timeout=150)
    run.wait_for(marker, timeout=90)
    run.kill_node(1)
    # the replacement arrives after node 0's agent has seen its worker fail (as a new machine would): it joins a
    # fresh round instead of racing the dead node's heartbeat into the full, still-complete one
    run.wait_for_log(0, "failed (exitcode", timeout=COLLECTIVE_TIMEOUT_S + 15)
    run.restart_agent(1)
    agents = run.wait(timeout=150)
    (report,) = [r for a in agents for r in a.json_lines() if r.get("rank") == 0]
    # node 0's workers were restarted (by the failure restart or by the membership change, whichever the agent saw
    # first) and resumed from the checkpoint, not from scratch
    assert report["resumed_from"] == pause_after
    # every step applied exactly once, each over the samples of the whole world: nothing lost, nothing repeated
    assert [e["step"] for e in report["log"]] == list(range(steps))
    assert [e["samples"] for e in report["log"]] == [[s * world + r for r in range(world)] for s in range(steps)]
    ref = _linear_reference(steps, world)
    assert max_rel_diff(torch.load(out), ref) < FP32_TOL


def test_node_local_check_rejects_groups_that_span_nodes():
    """What a launch with ``group_size: 4`` on 2 nodes x 2 reported (recorded from a real run): the check fails."""
    spanning = [{"rank": r, "local_rank": r % 2, "local_world_size": 2, "world_size": 4, "node": r // 2,
                 "group_size": 4, "num_groups": 1, "intra_nodes": [0, 0, 1, 1], "inter_nodes": [r // 2]}
                for r in range(4)]
    with pytest.raises(AssertionError):
        _check_node_local_groups(spanning, 2)


def test_skips_with_the_reason_when_not_root(monkeypatch):
    import hf_placement.testing.multinode as multinode

    monkeypatch.setattr(multinode.os, "geteuid", lambda: 1000)
    assert "need root" in multinode.multinode_unavailable_reason()
    with pytest.raises(pytest.skip.Exception, match="need root"):
        skip_unless_available()
