"""The emulated two-node cluster used by the PaRO benchmarks: shaped link, rank env, failure naming, clean-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hf_placement.testing.emulated_cluster import ClusterRunError, EmulatedCluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="the emulated cluster needs root and iproute2 (ip, tc) to create network namespaces",
    ),
]

WORKER = """
import datetime, json, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
x = torch.full((250_000,), float(dist.get_rank()))
dist.all_reduce(x)
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    raise SystemExit("rank failed on purpose")
print(json.dumps({"rank": dist.get_rank(), "node": os.environ["NODE_RANK"], "value": x[0].item()}))
dist.destroy_process_group()
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_shaped_link_ranks_and_failures(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with EmulatedCluster(nodes=2, procs_per_node=2, inter_mbit=200) as cluster:
        names = list(cluster.namespaces)
        assert all(n in _namespaces() for n in names)
        bw = cluster.measure_bandwidth(seconds=0.5)
        # tbf at 200 Mbit/s is 25 MB/s; loopback inside a namespace is far faster.
        assert 10 < bw["inter_mb_s"] < 30
        assert bw["intra_mb_s"] > 3 * bw["inter_mb_s"]

        before = cluster.inter_node_bytes()
        results = cluster.run([sys.executable, str(worker)], timeout=120)
        crossed = cluster.inter_node_bytes() - before
        assert [r.last_json()["value"] for r in results] == [6.0] * 4  # 0+1+2+3 on every rank
        assert [r.last_json()["node"] for r in results] == ["0", "0", "1", "1"]
        assert crossed > 1_000_000  # the 1 MB all-reduce had to cross the link

        with pytest.raises(ClusterRunError, match="rank 3 failed"):
            cluster.run([sys.executable, str(worker)], env={"FAIL_RANK": "3"}, timeout=120)
    assert not any(n in _namespaces() for n in names)


def test_bad_arguments():
    with pytest.raises(ValueError, match="only two emulated nodes"):
        EmulatedCluster(nodes=3)
    with pytest.raises(ValueError, match="inter_mbit"):
        EmulatedCluster(inter_mbit=0)
