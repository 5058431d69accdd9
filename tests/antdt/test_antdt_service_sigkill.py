"""The service SIGKILLed under load from many workers, then restarted on the same state file: every sample is
acknowledged exactly once in the committed state, checked by sample id.

Real processes: the service is ``python -m antdt_callbacks serve`` (through `launch_service`), the workers are 200
simulated ranks (asyncio, in two processes) from the load generator `bench/antdt/load_worker.py`, which lease, ack
with metrics and piggybacked leases, and renew, at a quarter-second step. The service is killed once 40% of the data
is acknowledged, stays down half a second, and comes back on the same port; the clients retry through the outage.
The audit compares the ack ranges the clients were told were accepted with the rows of the state file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "antdt"))
from load_service import LoadConfig, run_load  # noqa: E402

WORKERS, BATCH, STEPS = 200, 4, 12


@pytest.mark.timeout(300)
@pytest.mark.parametrize("commit_mode", ["group", "request"])
def test_sigkill_under_load_then_restart_acknowledges_every_sample_exactly_once(tmp_path, commit_mode):
    n = WORKERS * BATCH * STEPS
    cfg = LoadConfig(workers=WORKERS, procs=2, until_end=True, dataset_size=n, step_s=0.25, batch=BATCH,
                     shard_size=8, lease_ttl_s=10.0, stall_prob=0.0, warmup_s=0.0, commit_mode=commit_mode,
                     kill_at_acked=int(0.4 * n), down_s=0.5, request_timeout_s=5.0, retry_timeout_s=60.0,
                     timeout_s=240.0)
    res = run_load(cfg, tmp_path)
    assert any("SIGKILL" in e for e in res["events"]) and res["restart_s"] is not None, res["events"]
    acked_at_kill = int(next(e for e in res["events"] if "SIGKILL" in e).split("(")[1].split()[0])
    assert 0 < acked_at_kill < n  # killed mid-load
    assert res["retries"] > 0, "no client saw the outage"
    assert res["failed_workers"] == {} and res["missing_processes"] == 0, res
    assert res["finished_workers"] == WORKERS
    assert res["errors"] == 0, res["errors_by_kind"]
    audit = res["audit"]
    # Exactly once, by sample id: no accepted ack lost by the restart, none accepted twice, nothing in the state
    # that no client consumed, and the whole dataset consumed.
    assert (audit["lost"], audit["duplicated"], audit["phantom"]) == (0, 0, 0), audit
    assert audit["acked_by_clients"] == audit["acked_in_state"] == n, audit
    assert audit["done_shards"] == audit["shards"] == n // cfg.shard_size, audit
