"""A CPU-quota emulated node (examples/antdt/elastic_cluster.py `NodeCgroup`): every process started in the node, and
every process those start, runs in the node's cgroup; a quota change applies to the processes already running; the
group is removed with whatever was left in it. Skipped with the reason when the cgroup v1 cpu controller is not
mounted writable (not root, or cgroup v2 only)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "examples" / "antdt"
sys.path.insert(0, str(HERE))
from elastic_cluster import (  # noqa: E402
    CGROUP_CPU,
    ElasticJob,
    Node,
    NodeCgroup,
    cgroup_unavailable,
    free_port,
    host_cpus,
)

# prints the cpu cgroup of itself and of a child it starts, then a work rate per 0.3 s slice, 8 slices
_PROBE = """
import subprocess, sys, time
def cg(pid):
    return [l.split(':', 2)[2].strip() for l in open(f'/proc/{pid}/cgroup') if 'cpu' in l.split(':')[1].split(',')]
kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(5)'])
print('self', cg('self')[0], flush=True)
print('child', cg(kid.pid)[0], flush=True)
kid.kill()
for _ in range(8):
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        sum(range(2000))
        n += 1
    print('rate', n / 0.3, flush=True)
"""


def _need_cgroup() -> None:
    why = cgroup_unavailable()
    if why is not None:
        pytest.skip(why)


def _name() -> str:
    return f"antdt_test{free_port()}"


def test_a_process_started_in_the_node_and_its_children_run_in_its_cgroup_and_quota_changes_apply():
    _need_cgroup()
    with NodeCgroup(_name(), 0.1, period_us=20_000) as node:
        assert abs(node.quota_cores() - 0.1) < 1e-9
        proc = subprocess.Popen(node.wrap([sys.executable, "-c", _PROBE]), stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        me = "/" + node.path.name
        assert proc.stdout.readline().split() == ["self", me]
        assert proc.stdout.readline().split() == ["child", me]
        assert proc.pid in node.pids()
        rates = [float(proc.stdout.readline().split()[1]) for _ in range(3)]
        node.set_quota(0.6)  # the node gets faster while the process runs
        assert abs(node.quota_cores() - 0.6) < 1e-9
        proc.stdout.readline()  # the slice the change fell in
        rates += [float(proc.stdout.readline().split()[1]) for _ in range(4)]
        proc.wait(timeout=30)
        slow, fast = sorted(rates[:3])[1], sorted(rates[3:])[2]
        print(f"work rate at 0.1 core {rates[:3]}, after raising the quota to 0.6 core {rates[3:]}")
        assert fast / slow > 2.5, rates
        assert node.stat().get("nr_throttled", 0) > 0
    assert not node.path.exists()


def test_remove_kills_what_is_left_in_the_node():
    _need_cgroup()
    node = NodeCgroup(_name(), 0.5)
    proc = subprocess.Popen(node.wrap(["sh", "-c", "sleep 60 & sleep 60"]), start_new_session=True)
    deadline = time.monotonic() + 10
    while len(node.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(node.pids()) >= 2
    node.remove()
    assert proc.wait(timeout=10) != 0 and not node.path.exists()


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(RuntimeError, match="not a cgroup v1 cpu controller.*mount -t cgroup -o cpu"):
        NodeCgroup("x", 0.5, root=tmp_path)
    _need_cgroup()
    with NodeCgroup(_name(), 0.5) as node, pytest.raises(ValueError, match="below the kernel's 1000 us floor"):
        node.set_quota(0.005)


@pytest.mark.timeout(120)
def test_a_workers_agent_and_the_workers_it_starts_run_in_their_nodes_cgroup(tmp_path):
    """One torchrun agent per node (gang-started); the worker a quota node's agent starts is in that node's cgroup,
    and the groups are gone after the job."""
    _need_cgroup()
    if not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip(f"torchrun is not installed next to {sys.executable}")
    script = tmp_path / "where.py"
    script.write_text("import os\nfrom pathlib import Path\n"
                      "cg = [l.split(':', 2)[2].strip() for l in open('/proc/self/cgroup')\n"
                      "      if 'cpu' in l.split(':')[1].split(',')][0]\n"
                      "Path(os.environ['OUT'], os.environ['ANTDT_NODE_ID']).write_text(cg)\n")
    cpus = host_cpus()
    nodes = [Node("n0", cpus, cpu_quota=1.0), Node("n1", cpus, cpu_quota=0.5)]
    job = ElasticJob(tmp_path, nodes, [], min_nodes=2, max_nodes=2, max_restarts=0, script=script,
                     env={"OUT": str(tmp_path)}, gang_start=True)
    try:
        job.start()
        groups = {n: cg.path.name for n, cg in job.cgroups.items()}
        assert job.wait(90), {n: r.log[-2000:] for n, r in job.results().items()}
        assert all(r.returncode == 0 for r in job.results().values()), {n: r.log for n, r in job.results().items()}
    finally:
        job.stop()
    assert {n: (tmp_path / n).read_text() for n in ("n0", "n1")} == {n: "/" + g for n, g in groups.items()}
    assert job.gang_s > 0 and set(job.cgroup_stats) == {"n0", "n1"}
    assert not any((CGROUP_CPU / g).exists() for g in groups.values())
