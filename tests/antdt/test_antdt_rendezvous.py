"""``torchrun --rdzv-backend antdt``: a blacklisted node leaves before it joins the rendezvous; any other node runs
as under c10d. Real torchrun agents (one node each) against a real shard service."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from antdt_callbacks import AgentConfig, ControllerConfig, JobConfig, ServeConfig, ShardingClient, ShardingService
from antdt_callbacks.rendezvous import BACKEND, BlacklistGate

pytestmark = [pytest.mark.distributed]

TORCHRUN = Path(sys.executable).with_name("torchrun")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path: Path, node: str, url: str, marker: Path, port: int | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nopen(sys.argv[1], 'w').write(os.environ['RANK'])\n")
    env = {k: v for k, v in os.environ.items() if k != "ANTDT_SERVICE_URL"}
    env.update(ANTDT_NODE_ID=node, OMP_NUM_THREADS="1")
    return subprocess.run([str(TORCHRUN), "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", BACKEND,
                           "--rdzv-endpoint", f"127.0.0.1:{port or _port()}", "--rdzv-id", "gate",
                           "--rdzv-conf", f"antdt_url={url},join_timeout=60,last_call_timeout=1",
                           "--max-restarts", "0", str(script), str(marker)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.fixture
def service(tmp_path):
    svc = ShardingService(ServeConfig(db=str(tmp_path / "s.sqlite")),
                          JobConfig(dataset_size=64, shard_size=8, world_size=2, global_batch_size=4),
                          controller=ControllerConfig(policy="nd", max_evictions=1, min_nodes=1)).start()
    client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=5))
    client.reform(2, ["good", "evicted"], 0)
    client.evict("evicted", reason="3x slower than its peers for 4 windows")
    yield svc
    svc.stop()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this interpreter")
def test_a_blacklisted_node_leaves_before_joining_and_another_node_runs(tmp_path, service):
    # One rendezvous store for both agents, held by this process as a job's would be by its host: were the refused
    # agent to close the rendezvous on its way out, the next node could not join this run id.
    port = _port()
    rdzv_store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True)
    refused = _agent(tmp_path, "evicted", service.url, tmp_path / "evicted.ran", port)
    log = refused.stdout + refused.stderr
    assert refused.returncode == 0, log[-3000:]  # a graceful exit: the node is not retried as a failure
    assert "node evicted is blacklisted by the job's shard service (3x slower" in log, log[-3000:]
    assert not (tmp_path / "evicted.ran").exists(), "the blacklisted node started a worker"
    ran = _agent(tmp_path, "good", service.url, tmp_path / "good.ran", port)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    assert (tmp_path / "good.ran").read_text() == "0"
    del rdzv_store
    assert list(ShardingClient(service.url).status()["blacklist"]) == ["evicted"]  # nothing changed in the job


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this interpreter")
def test_without_a_reachable_service_the_node_joins_and_says_why(tmp_path):
    dead = f"http://127.0.0.1:{_port()}"  # nothing listens there
    ran = _agent(tmp_path, "evicted", dead, tmp_path / "ran")
    log = ran.stdout + ran.stderr
    assert ran.returncode == 0, log[-3000:]
    assert "could not read the blacklist" in log and (tmp_path / "ran").exists(), log[-3000:]


def test_the_gate_delegates_everything_but_the_check():
    class Inner:
        use_agent_store = True

        def __getattr__(self, name):
            return lambda *a: name

    gate = BlacklistGate(Inner(), None, "n0")
    assert gate.get_backend() == "antdt" and gate.use_agent_store is True
    assert [gate.next_rendezvous(), gate.is_closed(), gate.num_nodes_waiting(), gate.get_run_id(),
            gate.shutdown()] == ["next_rendezvous", "is_closed", "num_nodes_waiting", "get_run_id", "shutdown"]
