"""AntDT-DD vs plain DDP vs the ideal bound, 2 and 4 ranks, one rank slowed 3x, on one CPU box.

Every run is a real job: ``torchrun`` over `examples/antdt/train_worker.py` (HF Trainer). Compute is an injected
per-sample sleep (``--sample-cost-s`` per sample, times the slowdown on the slow rank): it models a slower device
without using CPU. The rest of a step (Trainer bookkeeping, autograd of the tiny model, gloo, Python) is real CPU
work, and with 4 ranks on 2 cores it is oversubscribed, so each rank's rate depends on what runs next to it.

- plain DDP: stock Trainer, DistributedSampler, equal per-device batches (``--mode plain``).
- AntDT-DD: the service + Agent, DD policy (batch sizes proportional to measured throughput, weighted gradients).
- ideal bound (the one the targets use): the sum of each rank's rate measured *while the other ranks run
  concurrently* (``world`` independent one-process jobs started together, the same one slowed, rates over the
  window where all of them run). That is "the sum of each rank's standalone rate" under the same CPU contention as
  the distributed runs, and still an upper bound: the independent jobs never wait for each other.
- ideal bound alone (reported, not the target): the sum of the rates of one process alone on the machine. With more
  ranks than cores it is not reachable by co-running ranks, whatever the policy.
- calibration: the sleep factor of the slow rank is solved from one standalone measurement so that the ratio of the
  standalone-alone rates (fast / slow) is the requested slowdown; the factor and the realised ratio are stated.

Throughput = samples / wall time between the end of step ``warmup`` and the last step (Trainer start-up excluded).
The per-rank breakdown (medians over steady-state steps) says where a DD step goes: local compute (forward start to
last gradient bucket ready), all-reduce wait (bucket ready to gradients reduced: waiting for the slowest rank), data
fetch (blocked on leases + waiting for the stop-together all-reduce + cutting and collating, including the lookahead
finished at the step's end), the Agent's ``on_step_end`` (queueing the ack, adopting a plan) and the rest (optimizer,
Trainer). RPC overhead = (time blocked on leases + the Agent's ``on_step_end``) / step time, steady state: the time
the training thread spends on the service (the requests themselves run on background threads).
Run: ``.venv/bin/python bench/antdt/bench_antdt.py`` (about 5 minutes on an idle 2-core box).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "antdt"))
sys.path.insert(0, str(ROOT))

from harness import WORKER, run_job  # noqa: E402

from antdt_callbacks import ControllerConfig, JobConfig, MonitorConfig  # noqa: E402


def rate(rep: dict, samples_per_step: list[int] | int, warmup: int) -> float:
    """Samples/s of one rank's run between the end of step `warmup` and the last step."""
    t = rep["step_times"]
    if isinstance(samples_per_step, int):
        samples_per_step = [samples_per_step] * len(t)
    return sum(samples_per_step[warmup + 1:len(t)]) / (t[-1] - t[warmup])


def job_rate(res, warmup: int, per_device: int | None) -> float:
    rep = res.reports[0]
    if per_device is None:  # AntDT: global batch per step from the Agent's history
        glob = [h["global_batch"] for h in rep["history"]]
        return rate(rep, glob, warmup)
    return rate(rep, per_device * len(res.reports), warmup)


def corunning_rates(out: Path, world: int, b: int, steps: int, warmup: int, cost: list[str], slowdown: float,
                    timeout_s: float = 600) -> list[float]:
    """Rates of ``world`` independent one-process jobs started together (job 1 slowed), each measured over the
    window in which all of them are past warm-up and still running: the same CPU contention as ``world`` ranks."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = []
    start = out / "start"
    for i in range(world):
        d = out / f"p{i}"
        slow = ["--slow", f"rank=0:factor={slowdown}"] if i == 1 else []
        n_steps = steps // 2 if i == 1 else steps  # the slow one still outlives the others
        argv = [sys.executable, str(WORKER), "--mode", "plain", "--out", str(d), "--dataset-size",
                str(b * n_steps), "--batch-size", str(b), "--max-steps", str(n_steps), "--start-file", str(start),
                *cost, *slow]
        d.mkdir(parents=True, exist_ok=True)
        log = open(d / "log.txt", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)), log, d))
    # Start barrier: the jobs start up at very different speeds on a loaded box; they train only once all are built.
    deadline = time.monotonic() + timeout_s
    while len(list(out.glob("start.ready.*"))) < world:
        for p, _, d in procs:
            assert p.poll() is None, (d / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "co-running jobs did not start"
        time.sleep(0.1)
    start.touch()
    reps = []
    for p, log, d in procs:
        rc = p.wait(timeout=timeout_s)
        log.close()
        assert rc == 0, (d / "log.txt").read_text()[-3000:]
        reps.append(json.loads((d / "report_rank0_inc0.json").read_text()))
    w0 = max(r["step_times"][warmup] for r in reps)
    w1 = min(r["step_times"][-1] for r in reps)
    rates = []
    for r in reps:
        t = [x for x in r["step_times"] if w0 <= x <= w1]
        assert len(t) >= 3, f"co-running window too short ({w1 - w0:.2f} s): raise --steps"
        rates.append((len(t) - 1) * b / (t[-1] - t[0]))
    return rates


def breakdown(rep: dict, warmup: int) -> dict:
    """Median per-step times (ms) of one AntDT rank over steady-state steps, and CPU per step."""
    hist = rep["history"][warmup + 1:]

    def med(key):
        return 1e3 * statistics.median(h[key] for h in hist)

    out = {k: med(k) for k in ("step_s", "compute_s", "sync_wait_s", "fetch_s", "data_wait_s", "collective_s",
                               "agent_s")}
    # The lookahead batch is finished (all-reduce waited, collated) inside the Agent's on_step_end: data path.
    out["fetch_s"] += med("settle_s")
    out["other_s"] = out["step_s"] - sum(out[k] for k in ("compute_s", "sync_wait_s", "fetch_s", "agent_s"))
    cpu = rep["step_cpu"]
    out["cpu_per_step_ms"] = 1e3 * (cpu[-1] - cpu[warmup]) / (len(cpu) - 1 - warmup)
    out["batch_size"] = statistics.median(h["batch_size"] for h in hist)
    return {k.replace("_s", "_ms") if k.endswith("_s") else k: v for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--per-device", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--corun-steps", type=int, default=60, help="steps of each fast co-running standalone job")
    ap.add_argument("--sample-cost-s", type=float, default=0.004)
    ap.add_argument("--slowdown", type=float, default=3.0, help="slowdown of rank 1 to realise (standalone rates)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="use --slowdown as the sleep factor as is (it then realises less: fixed per-step overhead)")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "antdt.json"))
    ap.add_argument("--machine-note", default="CPU shared with other engineers' jobs while measuring",
                    help="how loaded the machine was (stored in the JSON with the load averages)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="antdt_bench_"))
    b = a.per_device
    cost = ["--sample-cost-s", str(a.sample_cost_s)]
    t_all = time.time()
    load0 = list(os.getloadavg())
    # Standalone rates (calibration): one process, per-device batch, fast and slowed. A step is the injected sleep
    # (c per sample, times the factor f on the slow rank) plus a fixed overhead o, so a factor f realises
    # (c f + o) / (c + o) < f. One measurement at f = slowdown gives o; the factor used is the one that realises
    # the requested slowdown, and its realised ratio is measured again and stated.
    sa_steps = max(a.warmup + 12, a.steps // 2)
    sa = {}

    def standalone(name: str, factor: float | None) -> float:
        slow = ["--slow", f"rank=0:factor={factor}"] if factor else []
        res = run_job(tmp / f"standalone_{name}", 1, JobConfig(dataset_size=b * sa_steps, world_size=1,
                      global_batch_size=b), worker_args=[*cost, *slow, "--mode", "plain", "--batch-size", str(b),
                                                         "--max-steps", str(sa_steps)], mode="plain")
        assert res.returncode == 0, res.log[-3000:]
        return job_rate(res, a.warmup, b)

    sa["fast"] = standalone("fast", None)
    factor = a.slowdown
    first = sa["fast"] / standalone("slow_uncalibrated", factor)
    if a.calibrate and 1.0 < first < factor:
        per_step = b / sa["fast"]  # c + o, seconds per step of the fast process
        overhead = per_step - b * a.sample_cost_s
        factor = round((a.slowdown * per_step - overhead) / (b * a.sample_cost_s), 3)
    sa["slow"] = standalone("slow", factor)
    realised = sa["fast"] / sa["slow"]
    slow1 = ["--slow", f"rank=1:factor={factor}"]
    rows, runs, curves = [], {}, {}
    for world in [int(w) for w in a.worlds.split(",")]:
        n = b * world * a.steps
        plain = run_job(tmp / f"ddp{world}", world, JobConfig(dataset_size=n, world_size=world,
                        global_batch_size=b * world),
                        worker_args=[*cost, *slow1, "--mode", "plain", "--batch-size", str(b), "--max-steps",
                                     str(a.steps)], mode="plain")
        assert plain.returncode == 0, plain.log[-3000:]
        job = JobConfig(dataset_size=n, world_size=world, global_batch_size=b * world, shuffle=True)  # default shards
        dd = run_job(tmp / f"dd{world}", world, job, MonitorConfig(window_steps=3),
                     ControllerConfig(policy="dd", min_gain=0.05), worker_args=[*cost, *slow1])
        assert dd.returncode == 0, dd.log[-3000:]
        corun = corunning_rates(tmp / f"corun{world}", world, b, a.corun_steps, a.warmup, cost, factor)
        r_ddp = job_rate(plain, a.warmup, b)
        r_dd = job_rate(dd, a.warmup, None)
        ideal = sum(corun)
        ideal_alone = (world - 1) * sa["fast"] + sa["slow"]
        reps = sorted(dd.reports.values(), key=lambda r: r["rank"])
        steps = len(reps[0]["history"])
        # RPC overhead per steady-state step: what the training thread spends on the service (blocked on a lease,
        # the Agent's on_step_end), over the step time; the worst rank.
        ovh = max(sum(h["data_wait_s"] + h["agent_s"] for h in rep["history"][a.warmup + 1:])
                  / sum(h["step_s"] for h in rep["history"][a.warmup + 1:]) for rep in reps)
        # The same with medians: robust to the training thread being preempted inside those short regions on a
        # loaded box (the mean above counts every preemption as overhead).
        ovh_med = max(statistics.median(h["data_wait_s"] + h["agent_s"] for h in rep["history"][a.warmup + 1:])
                      / statistics.median(h["step_s"] for h in rep["history"][a.warmup + 1:]) for rep in reps)
        lat = sorted(x for rep in reps for x in rep["rpc_latencies"])
        reqs = sum(dd.service_stats.get("requests", {}).values())
        row = {"world": world, "ddp_samples_s": r_ddp, "dd_samples_s": r_dd, "ideal_samples_s": ideal,
               "ideal_alone_samples_s": ideal_alone, "corunning_rank_samples_s": corun,
               "dd_vs_ddp": r_dd / r_ddp, "dd_vs_ideal": r_dd / ideal, "dd_vs_ideal_alone": r_dd / ideal_alone,
               "rpc_overhead_fraction": ovh, "rpc_overhead_fraction_median": ovh_med,
               "requests_per_step": reqs / steps,
               "requests_per_s": dd.service_stats.get("request_rate"),
               "rpc_latency_ms": {"p50": 1e3 * lat[len(lat) // 2], "p99": 1e3 * lat[int(len(lat) * 0.99)]},
               "breakdown_ms": {str(rep["rank"]): breakdown(rep, a.warmup) for rep in reps},
               "final_batch_sizes": [int(statistics.median(h["batch_size"] for h in rep["history"][a.warmup:]))
                                     for rep in reps],
               "steps": steps, "exactly_once": bool(dd.seen is not None and all(abs(s - 1) < 1e-3 for s in dd.seen))}
        rows.append(row)
        curves[world] = {rep["rank"]: rep["history"] for rep in reps}
        runs[world] = {"ddp_wall_s": plain.wall_s, "dd_wall_s": dd.wall_s}
    print(f"standalone samples/s: fast {sa['fast']:.1f}, slow {sa['slow']:.1f} (realised slowdown {realised:.2f}x "
          f"with sleep factor {factor}; factor {a.slowdown} realised {first:.2f}x)")
    print(f"{'ranks':>5} {'DDP':>8} {'AntDT-DD':>8} {'ideal':>8} {'alone':>8} {'DD/DDP':>7} {'DD/ideal':>8} "
          f"{'DD/alone':>8} {'rpc ovh':>8} {'req/step':>8} {'median b':>16}")
    for r in rows:
        print(f"{r['world']:>5} {r['ddp_samples_s']:>8.1f} {r['dd_samples_s']:>8.1f} {r['ideal_samples_s']:>8.1f} "
              f"{r['ideal_alone_samples_s']:>8.1f} {r['dd_vs_ddp']:>7.2f} {r['dd_vs_ideal']:>8.2f} "
              f"{r['dd_vs_ideal_alone']:>8.2f} {r['rpc_overhead_fraction']:>8.2%} {r['requests_per_step']:>8.2f} "
              f"{str(r['final_batch_sizes']):>16}")
    cols = ("batch_size", "step_ms", "compute_ms", "sync_wait_ms", "fetch_ms", "data_wait_ms", "collective_ms",
            "agent_ms", "other_ms", "cpu_per_step_ms")
    print("\nAntDT-DD per-rank step breakdown (median ms over steady-state steps; cpu = process CPU per step)")
    print(f"{'ranks':>5} {'rank':>4} " + " ".join(f"{c.replace('_ms', ''):>11}" for c in cols))
    for r in rows:
        for rank, bd in r["breakdown_ms"].items():
            print(f"{r['world']:>5} {rank:>4} " + " ".join(f"{bd[c]:>11.1f}" for c in cols))
    png = Path(a.out).with_suffix(".png")
    _plot(curves, png)
    import torch
    import transformers

    result = {
        "summary": {
            "dd_vs_ddp": {str(r["world"]): r["dd_vs_ddp"] for r in rows},
            "dd_vs_ideal": {str(r["world"]): r["dd_vs_ideal"] for r in rows},
            "rpc_overhead_fraction": {str(r["world"]): r["rpc_overhead_fraction"] for r in rows},
            "slowdown": {"requested": a.slowdown, "realised_standalone": realised, "slow_rank": 1,
                         "sleep_factor_used": factor, "realised_with_requested_factor": first,
                         "model": f"per-sample sleep of {a.sample_cost_s} s x factor (no CPU used); the factor "
                                  "is calibrated so that the standalone rates differ by the requested slowdown"},
            "dd_vs_ddp_min": min(r["dd_vs_ddp"] for r in rows),
            "dd_vs_ideal_min": min(r["dd_vs_ideal"] for r in rows),
            "ideal_bound": "sum of per-rank rates of independent one-process jobs co-running on the machine "
                           "(same contention); dd_vs_ideal_alone uses rates measured alone",
            "dd_vs_ideal_alone": {str(r["world"]): r["dd_vs_ideal_alone"] for r in rows},
            "rpc_latency_ms": {str(r["world"]): r["rpc_latency_ms"] for r in rows},
            "requests_per_step": {str(r["world"]): r["requests_per_step"] for r in rows},
            "rpc_overhead_fraction_median": {str(r["world"]): r["rpc_overhead_fraction_median"] for r in rows},
        },
        "rows": rows, "standalone_samples_s": sa, "runs": runs,
        "config": {**{k: getattr(a, k) for k in ("per_device", "steps", "corun_steps", "sample_cost_s", "slowdown",
                                                 "warmup")},
                   "shard_size": JobConfig(dataset_size=1).shard_size, "policy": "dd", "window_steps": 3},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": __import__("os")
                    .cpu_count(), "note": a.machine_note,
                    "loadavg_start": load0, "loadavg_end": list(os.getloadavg())},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "plot": png.name, "total_wall_s": time.time() - t_all,
    }
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out} and {png}")
    return 0


def _plot(curves: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(6 * len(curves), 7), squeeze=False)
    for col, (world, per_rank) in enumerate(sorted(curves.items())):
        for rank, hist in sorted(per_rank.items()):
            steps = [h["step"] for h in hist]
            label = f"rank {rank}" + (" (3x slow)" if rank == 1 else "")
            axes[0][col].plot(steps, [h["batch_size"] for h in hist], label=label)
            thr = [h["batch_size"] / h["compute_s"] if h["compute_s"] > 0 else float("nan") for h in hist]
            axes[1][col].plot(steps, thr, label=label)
        axes[0][col].set_title(f"AntDT-DD, {world} ranks: per-rank batch size")
        axes[1][col].set_title("per-rank throughput (samples / local compute s)")
        axes[1][col].set_xlabel("step")
        axes[0][col].legend()
        top = max(statistics.median([h["batch_size"] / h["compute_s"] for h in hs if h["compute_s"] > 0] or [1.0])
                  for hs in per_rank.values())
        axes[1][col].set_ylim(bottom=0, top=1.5 * top)  # the fastest rank's median, with room for noise
    fig.tight_layout()
    fig.savefig(png, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
