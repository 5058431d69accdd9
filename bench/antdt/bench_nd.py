"""AntDT-ND vs plain DDP vs dynamic sharding alone, on emulated nodes with one node slowed by real contention.

Every run is a real elastic job: one ``torchrun --nnodes N-1:N --rdzv-backend c10d`` agent per emulated node
(examples/antdt/elastic_cluster.py), gang-started (every agent imports torchrun on its node, then they join the
rendezvous together). The worker's step is real CPU work: a part per step whatever the batch (``--step-work``) and a
part per sample (``--sample-work``). World size = nodes (one worker per node); torchrun's MIN and the Controller's
``min_nodes`` are N-1, so one eviction is allowed and leaves N-1 nodes.

What makes a node slow (``--slow-by``):

- ``quota`` (default; 3 or 4 nodes on any number of cores): each node's agent, and so every worker it starts or
  restarts, runs in a cgroup of its own (cgroup v1 ``cpu`` controller, CFS bandwidth). Fast nodes get ``--quota``
  cores, the slow node ``--quota / --slowdown``. Calibrated: the CPU work rate inside each node's cgroup, all nodes
  probing at once. Needs a writable /sys/fs/cgroup/cpu (root).
- ``cotenants`` (the first version, 2 nodes): each node pinned to its own core, the slow node's core shared with
  ``--hogs`` busy co-tenant processes (its slowdown on CPU work calibrated alone vs with them).

Modes, each with the same worker, service, settings and launch:

- plain DDP, two ways: ``ddp_stock``, the stock Trainer (``--mode plain``: DistributedSampler, equal per-device
  batches, no service in the loop), and ``ddp``, the AntDT worker with the Controller off (``policy="off"``: every
  rank gets an equal, fixed share of each global batch, so each synchronous step waits for the slow node as plain DDP
  does; the per-step service overhead is ~0.2% of a step, bench/results/antdt.json, DD section). The ratios use the
  faster of the two (``ddp_baseline_*`` says which); ``*_vs_ddp_off_*`` and ``*_vs_ddp_stock_*`` give each.
- dynamic sharding alone: the service + Agent, ND policy without evictions (the straggler is absorbed).
- AntDT-ND: the same, evictions allowed: the Controller evicts the node when the break-even says so, the job
  re-forms through the elastic rendezvous on the remaining nodes.

Straggler kinds: ``persistent`` (slow for the whole run) and ``transient`` (the slow node's quota is raised back to
``--quota``, or its co-tenants stop, half way through the first plain-DDP persistent run's wall time). Throughput =
samples / end-to-end wall time of the job (agents started to last agent exited), so start-up, checkpoints and the
re-formation are all paid for. Each row also splits its wall time (start-up to the first step, training, the
eviction's re-formation, the tail) from the workers' step clocks.

Run: ``.venv/bin/python bench/antdt/bench_nd.py`` (3 nodes, CPU quotas, about 16 minutes on 2 idle cores;
``--repeats 2`` for medians of two;
``--nodes 4``; ``--slow-by cotenants --nodes 2`` for the first version). It merges an ``nd`` section and the
``nd_vs_ddp_persistent``, ``nd_vs_ddp_transient``, ``nd_evictions``, ``sharding_vs_ddp_*`` summary fields into
bench/results/antdt.json, leaving the DD results as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "antdt"))
sys.path.insert(0, str(ROOT))

from elastic_cluster import Node, calibrate, calibrate_quota, cgroup_unavailable, host_cpus  # noqa: E402
from harness import run_elastic_job  # noqa: E402

from antdt_callbacks import ControllerConfig, JobConfig, MonitorConfig  # noqa: E402
from bench.machine import cpu_info  # noqa: E402

MODES = ("ddp", "ddp_stock", "sharding", "nd")
KINDS = ("persistent", "transient")


def make_nodes(a, cpus: list[int], kind: str, half: float | None) -> list[Node]:
    """The emulated nodes of one run; the last one is the slow one."""
    until = half if kind == "transient" else None
    if a.slow_by == "cotenants":
        return [Node("n0", [cpus[0]]), Node("n1", [cpus[1]], hogs=a.hogs, hogs_for_s=until)]
    slow = a.quota / a.slowdown
    nodes = [Node(f"n{i}", cpus, cpu_quota=a.quota, period_us=a.period_us) for i in range(a.nodes - 1)]
    nodes.append(Node(f"n{a.nodes - 1}", cpus, cpu_quota=slow, period_us=a.period_us, quota_for_s=until,
                      quota_after=a.quota if until is not None else None))
    return nodes


def time_split(res, wall: float) -> dict:
    """Where the wall time went, from the workers' step clocks (perf_counter: one clock for every process here):
    start-up to the first step, training steps, the eviction (evicted node's agent gone -> first step of the re-formed
    job) and the tail (last step -> every agent exited: final save, exit)."""
    if not res.reports:
        return {}
    first = [r["step_times"][0] - res.t0_perf for r in res.reports if r.get("step_times")]
    last = [r["step_times"][-1] - res.t0_perf for r in res.reports if r.get("step_times")]
    if not first:
        return {}
    out = {"gang_start_s": res.gang_s, "tail_s": wall - max(last), "final_round_steps":
           max(len(r["step_times"]) for r in res.reports), "final_round_first_step_s": min(first)}
    gone = [a.ended_s for n, a in res.agents.items() if n in res.status.get("blacklist", {}) and a.ended_s]
    if gone:
        out["evicted_agent_gone_s"] = min(gone)
        out["reform_s"] = min(first) - min(gone)  # checkpoint done -> re-rendezvous, restart, resume, first step
    else:
        out["startup_s"] = min(first)
    steps = [r["step_times"] for r in res.reports if len(r.get("step_times", [])) > 2]
    if steps:
        gaps = [b - a for s in steps for a, b in zip(s, s[1:])]
        out["final_round_step_s_median"] = statistics.median(gaps)
    return out


def run_one(out: Path, mode: str, kind: str, a, cpus: list[int], half: float | None) -> dict:
    nodes = make_nodes(a, cpus, kind, half)
    n = len(nodes)
    min_nodes = max(1, n - 1)
    job = JobConfig(dataset_size=a.samples, shard_size=16, world_size=n, global_batch_size=a.global_batch,
                    lease_ttl_s=10.0)
    mcfg = MonitorConfig(window_steps=2, consecutive_windows=1, persistent_windows=a.persistent_windows,
                         straggler_threshold=0.25, severe_ratio=0.7)
    ccfg = ControllerConfig(policy="off" if mode == "ddp" else "nd", cooldown_windows=0,
                            max_evictions=1 if mode == "nd" else 0, evict_cost_s=a.evict_cost_s, min_nodes=min_nodes)
    work = ["--step-work", str(a.step_work), "--sample-work", str(a.sample_work)]
    steps = -(-a.samples // a.global_batch)
    if mode == "ddp_stock":  # the stock Trainer: DistributedSampler, equal per-device batches, no service in the loop
        work += ["--mode", "plain", "--batch-size", str(a.global_batch // n), "--max-steps", str(steps)]
    load = os.getloadavg()
    t0 = time.perf_counter()
    res = run_elastic_job(out, nodes, job, mcfg, ccfg, work, min_nodes=min_nodes, max_restarts=2,
                          timeout_s=a.timeout_s, gang_start=True)
    wall = time.perf_counter() - t0
    ok = res.finished and all(r.returncode == 0 for n, r in res.agents.items() if n not in res.status["blacklist"])
    row = {"mode": mode, "kind": kind, "nodes": n, "wall_s": res.wall_s, "harness_s": wall, "ok": ok,
           "samples_s": a.samples / res.wall_s, "evictions": res.status.get("evictions", 0),
           "blacklist": sorted(res.status.get("blacklist", {})), "load_avg_start": list(load),
           "slow_until_s": half if kind == "transient" else None, "time_split": time_split(res, res.wall_s),
           "node_cpu_stat": res.node_stats}
    if res.seen is not None and mode != "ddp_stock":
        row["exactly_once"] = all(abs(x - 1.0) < 1e-3 for x in res.seen)
    elif res.seen is not None:  # a sampler's epoch: every sample at most once, ``steps`` global batches in all
        row["at_most_once"] = max(res.seen) < 1 + 1e-3 and abs(sum(res.seen) - steps * a.global_batch) < 1e-2 * steps
    notes = [x for h in res.history for x in h.get("eviction", []) if x.get("choice") == "evict"]
    if notes:
        row["eviction_note"] = notes[0]
    if res.history:
        row["first_window_rates"] = res.history[0]["rates"]
    if not ok:
        row["log_tail"] = res.log()[-3000:]
    split = row["time_split"]
    print(f"{kind:10s} {mode:9s} wall {res.wall_s:6.1f} s  {row['samples_s']:6.1f} samples/s  evictions "
          f"{row['evictions']}  ok {ok}  load {load[0]:.2f}  split {json.dumps(split)}", flush=True)
    return row


def median_rate(rows: list[dict], kind: str, mode: str) -> float:
    return statistics.median(r["samples_s"] for r in rows if (r["kind"], r["mode"]) == (kind, mode))


def summarize(rows: list[dict], a, cal: dict) -> dict:
    kinds = sorted({r["kind"] for r in rows}, key=KINDS.index)
    summary: dict = {}
    for k in kinds:
        have = {m for r in rows if r["kind"] == k for m in [r["mode"]]}
        # the baseline is the faster of the two plain-DDP runs (Controller off / stock Trainer) when both ran
        ddp = max(median_rate(rows, k, m) for m in ("ddp", "ddp_stock") if m in have)
        summary[f"ddp_baseline_{k}"] = max((m for m in ("ddp", "ddp_stock") if m in have),
                                           key=lambda m: median_rate(rows, k, m))
        for mode in ("nd", "sharding"):
            if mode in have:
                summary[f"{mode}_vs_ddp_{k}"] = median_rate(rows, k, mode) / ddp
                summary[f"{mode}_vs_ddp_off_{k}"] = median_rate(rows, k, mode) / median_rate(rows, k, "ddp")
                if "ddp_stock" in have:
                    summary[f"{mode}_vs_ddp_stock_{k}"] = median_rate(rows, k, mode) / median_rate(rows, k, "ddp_stock")
    summary["nd_evictions"] = {k: statistics.median(r["evictions"] for r in rows if (r["kind"], r["mode"]) == (k, "nd"))
                               for k in kinds if any((r["kind"], r["mode"]) == (k, "nd") for r in rows)}
    first = [r["first_window_rates"] for r in rows if r["mode"] == "ddp" and r.get("first_window_rates")]
    if a.slow_by == "quota":
        model = (f"CPU quota per node (cgroup v1 cpu controller, CFS bandwidth, period {a.period_us} us): fast nodes "
                 f"{a.quota} core, the slow node {a.quota / a.slowdown:.3f} core")
    else:
        model = "co-tenant busy processes pinned to the slow node's core (CFS share)"
    summary["nd_slowdown"] = {"model": model, "calibrated_cpu_slowdown": cal["slowdown"],
                              "requested": a.slowdown if a.slow_by == "quota" else None,
                              "co_tenants": a.hogs if a.slow_by == "cotenants" else None,
                              # samples per compute second in the first Controller window of the DDP runs (equal
                              # batches): the slowdown the training itself sees, fixed per-step part included
                              "training_rate_slowdown": statistics.median(
                                  statistics.median(x) / min(x) for x in first) if first else None}
    summary["nd_nodes"] = rows[0]["nodes"]
    summary["nd_repeats"] = a.repeats
    return summary


def measure(a, cpus: list[int], kinds: list[str], modes: list[str], load0, t_start: float) -> tuple[dict, list]:
    """Calibrate, then run every (repeat, kind, mode) cell in that order."""
    if a.slow_by == "quota":
        cal = calibrate_quota([a.quota] * (a.nodes - 1) + [a.quota / a.slowdown], a.period_us)
    else:
        cal = calibrate([cpus[1]], a.hogs)
    print(f"calibration: {cal}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="antdt_nd_") as tmp:
        half = None
        for rep in range(a.repeats):
            for kind in kinds:
                for mode in modes:
                    if kind == "transient" and half is None:
                        raise SystemExit("the transient straggler's length comes from the persistent DDP run: "
                                         "include persistent in --kinds")
                    row = run_one(Path(tmp) / f"r{rep}_{kind}_{mode}", mode, kind, a, cpus, half)
                    row["repeat"] = rep
                    rows.append(row)
                    if (rep, kind, mode) == (0, "persistent", "ddp"):
                        # the transient straggler ends half way through the first plain-DDP persistent run
                        half = row["wall_s"] / 2
                    if a.rows_out:
                        Path(a.rows_out).write_text(json.dumps(
                            {"calibration": cal, "rows": rows, "load_avg_start": list(load0),
                             "wall_s": time.perf_counter() - t_start}, indent=1))
    return cal, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3, help="emulated nodes (world size); 2 with --slow-by cotenants")
    ap.add_argument("--slow-by", choices=("quota", "cotenants"), default="quota")
    ap.add_argument("--quota", type=float, default=None, help="cores per fast node (quota mode; default: the "
                    "nodes' quotas add up to 70%% of the host's cores, at most 1 core each: 0.6 for 3 nodes on 2 "
                    "cores, 0.42 for 4)")
    ap.add_argument("--slowdown", type=float, default=3.0, help="the slow node gets --quota / --slowdown cores")
    ap.add_argument("--period-us", type=int, default=100_000, help="CFS bandwidth period (quota mode)")
    ap.add_argument("--hogs", type=int, default=2, help="co-tenants on the slow node's core (cotenants mode)")
    ap.add_argument("--samples", type=int, default=10800, help="600 global batches of 18 (3 nodes)")
    ap.add_argument("--global-batch", type=int, default=None, help="default: 6 per node")
    ap.add_argument("--step-work", type=int, default=2000)
    ap.add_argument("--sample-work", type=int, default=40)
    ap.add_argument("--persistent-windows", type=int, default=4)
    ap.add_argument("--evict-cost-s", type=float, default=10.0, help="the Controller's estimate of an eviction's cost")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (kind, mode) cell, interleaved; medians reported")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--modes", default=",".join(MODES), help="ddp is required (the ratios' denominator)")
    ap.add_argument("--timeout-s", type=float, default=900.0)  # a 3x-slowed DDP run took 311 s on a slower CPU
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "antdt.json"))
    ap.add_argument("--machine-note", default="")
    ap.add_argument("--rows-out", default=None, help="also write the calibration and the rows so far after each run "
                    "(a run cut short by a time limit keeps what it measured)")
    ap.add_argument("--from-rows", default=None, help="summarise and merge a --rows-out file instead of running")
    a = ap.parse_args()
    kinds = [k for k in a.kinds.split(",") if k]
    if set(kinds) - set(KINDS) or not kinds:
        raise SystemExit(f"--kinds {a.kinds!r}: choose from {','.join(KINDS)}")
    modes = [m for m in MODES if m in a.modes.split(",")]
    if set(a.modes.split(",")) - set(MODES) or "ddp" not in modes:
        raise SystemExit(f"--modes {a.modes!r}: choose from {','.join(MODES)}, ddp included")
    a.global_batch = a.global_batch or 6 * a.nodes
    if a.global_batch % a.nodes:
        raise SystemExit(f"--global-batch {a.global_batch} does not split equally over {a.nodes} nodes (the stock "
                         "DDP baseline needs equal per-device batches); use a multiple of --nodes.")
    # a SIGTERM (e.g. `timeout`) must still run the harness's clean-up: torchrun workers outlive their agents
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cpus = host_cpus()
    if a.slow_by == "cotenants":
        if a.nodes != 2 or len(cpus) < 2:
            raise SystemExit(f"--slow-by cotenants pins each node to a core of its own and runs 2 nodes on 2 cores "
                             f"(got --nodes {a.nodes}, cores {cpus}); use --slow-by quota for more nodes.")
    else:
        if a.nodes < 3:
            raise SystemExit(f"--nodes {a.nodes}: quota mode needs 3 or more nodes (an eviction leaves nodes-1 >= 2).")
        why = cgroup_unavailable()
        if why is not None:
            raise SystemExit(why)
        share = a.nodes - 1 + 1 / a.slowdown  # the nodes' quotas in units of a fast node's
        if a.quota is None:
            a.quota = round(min(1.0, 0.7 * len(cpus) / share), 3)
        if a.quota * share > 0.9 * len(cpus):
            raise SystemExit(f"--quota {a.quota} x {share:.2f} fast-node shares = {a.quota * share:.2f} cores, more "
                             f"than 90% of the {len(cpus)} cores this process may use: the nodes would slow each other "
                             "(and the service) by contention, not by their quotas. Lower --quota.")
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    if a.from_rows:
        saved = json.loads(Path(a.from_rows).read_text())
        cal, rows, load0 = saved["calibration"], saved["rows"], saved["load_avg_start"]
        t_start -= saved["wall_s"]
    else:
        cal, rows = measure(a, cpus, kinds, modes, load0, t_start)
    summary = summarize(rows, a, cal)
    import torch
    import transformers

    nd = {"summary": summary, "rows": rows, "calibration": cal, "config": vars(a),
          "machine": {**cpu_info(), "platform": platform.platform(), "python": platform.python_version(),
                      "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg()), "note": a.machine_note},
          "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
          "wall_s": time.perf_counter() - t_start}
    out = Path(a.out)
    data = json.loads(out.read_text()) if out.exists() else {"summary": {}}
    data["nd"] = nd
    top = [f"{m}_vs_ddp_{k}" for m in ("nd", "sharding") for k in KINDS] + ["nd_evictions"]
    data.setdefault("summary", {}).update({k: summary[k] for k in top if k in summary})
    out.write_text(json.dumps(data, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
