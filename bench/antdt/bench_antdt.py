"""AntDT-DD vs plain DDP vs the ideal bound, 2 and 4 ranks, one rank slowed 3x, on one CPU box.

Every run is a real job: ``torchrun`` over `examples/antdt/train_worker.py` (HF Trainer). Compute is an injected
per-sample sleep (``--sample-cost-s`` per sample, times the slowdown on the slow rank): it models a slower device
without using CPU, so 4 ranks on 2 shared cores still measure the scheduling effect, not core contention.

- plain DDP: stock Trainer, DistributedSampler, equal per-device batches (``--mode plain``).
- AntDT-DD: the service + Agent, DD policy (batch sizes proportional to measured throughput, weighted gradients).
- ideal: sum over ranks of each rank's standalone rate (one process, same per-device batch, its own slowdown).
- calibration: the slowdown actually realised is the ratio of the two standalone rates (stated in the JSON).

Throughput = samples / wall time between the end of step ``warmup`` and the last step (Trainer start-up excluded).
Run: ``.venv/bin/python bench/antdt/bench_antdt.py`` (about 10 minutes on a loaded 2-core box).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "antdt"))
sys.path.insert(0, str(ROOT))

from harness import run_job  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--per-device", type=int, default=16)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sample-cost-s", type=float, default=0.004)
    ap.add_argument("--slowdown", type=float, default=3.0)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "antdt.json"))
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="antdt_bench_"))
    b = a.per_device
    cost = ["--sample-cost-s", str(a.sample_cost_s)]
    slow1 = ["--slow", f"rank=1:factor={a.slowdown}"]
    t_all = time.time()
    # Standalone rates (calibration): one process, per-device batch, fast and slowed.
    sa_steps = max(a.warmup + 12, a.steps // 2)
    sa = {}
    for name, slow in (("fast", []), ("slow", ["--slow", f"rank=0:factor={a.slowdown}"])):
        res = run_job(tmp / f"standalone_{name}", 1, JobConfig(dataset_size=b * sa_steps, world_size=1,
                      global_batch_size=b), worker_args=[*cost, *slow, "--mode", "plain", "--batch-size", str(b),
                                                         "--max-steps", str(sa_steps)], mode="plain")
        assert res.returncode == 0, res.log[-3000:]
        sa[name] = job_rate(res, a.warmup, b)
    realised = sa["fast"] / sa["slow"]
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
        r_ddp = job_rate(plain, a.warmup, b)
        r_dd = job_rate(dd, a.warmup, None)
        ideal = (world - 1) * sa["fast"] + sa["slow"]
        reps = list(dd.reports.values())
        step_s = sum(h["step_s"] for h in reps[0]["history"][1:])
        overhead = max(rep["overhead_s"] + rep["wait_s"] for rep in reps)
        steps = len(reps[0]["history"])
        reqs = sum(dd.service_stats.get("requests", {}).values())
        row = {"world": world, "ddp_samples_s": r_ddp, "dd_samples_s": r_dd, "ideal_samples_s": ideal,
               "dd_vs_ddp": r_dd / r_ddp, "dd_vs_ideal": r_dd / ideal,
               "rpc_overhead_fraction": overhead / step_s, "requests_per_step": reqs / steps,
               "requests_per_s": dd.service_stats.get("request_rate"),
               "service_busy_s_per_step": dd.service_stats.get("busy_s", 0) / steps,
               "collective_s_per_step": max(rep["collective_s"] for rep in reps) / steps,
               "final_batch_sizes": [int(statistics.median(h["batch_size"] for h in rep["history"][a.warmup:]))
                                     for rep in sorted(reps, key=lambda r: r["rank"])],
               "steps": steps, "exactly_once": bool(dd.seen is not None and all(abs(s - 1) < 1e-3 for s in dd.seen))}
        rows.append(row)
        curves[world] = {rep["rank"]: rep["history"] for rep in reps}
        runs[world] = {"ddp_wall_s": plain.wall_s, "dd_wall_s": dd.wall_s}
    print(f"standalone samples/s: fast {sa['fast']:.1f}, slow {sa['slow']:.1f} (realised slowdown {realised:.2f}x)")
    print(f"{'ranks':>5} {'DDP':>9} {'AntDT-DD':>9} {'ideal':>9} {'DD/DDP':>7} {'DD/ideal':>8} {'rpc ovh':>8} "
          f"{'req/step':>8} {'median b':>16}")
    for r in rows:
        print(f"{r['world']:>5} {r['ddp_samples_s']:>9.1f} {r['dd_samples_s']:>9.1f} {r['ideal_samples_s']:>9.1f} "
              f"{r['dd_vs_ddp']:>7.2f} {r['dd_vs_ideal']:>8.2f} {r['rpc_overhead_fraction']:>8.2%} "
              f"{r['requests_per_step']:>8.2f} {str(r['final_batch_sizes']):>16}")
    png = Path(a.out).with_suffix(".png")
    _plot(curves, png)
    import torch
    import transformers

    result = {
        "summary": {
            "dd_vs_ddp": {str(r["world"]): r["dd_vs_ddp"] for r in rows},
            "dd_vs_ideal": {str(r["world"]): r["dd_vs_ideal"] for r in rows},
            "rpc_overhead_fraction": {str(r["world"]): r["rpc_overhead_fraction"] for r in rows},
            "slowdown": {"requested": a.slowdown, "realised_standalone": realised, "slow_rank": 1},
            "dd_vs_ddp_min": min(r["dd_vs_ddp"] for r in rows),
            "dd_vs_ideal_min": min(r["dd_vs_ideal"] for r in rows),
        },
        "rows": rows, "standalone_samples_s": sa, "runs": runs,
        "config": {**{k: getattr(a, k) for k in ("per_device", "steps", "sample_cost_s", "slowdown", "warmup")},
                   "shard_size": JobConfig(dataset_size=1).shard_size, "policy": "dd", "window_steps": 3},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": __import__("os")
                    .cpu_count(), "note": "CPU shared with other engineers' jobs while measuring"},
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
        axes[1][col].set_ylim(bottom=0, top=statistics.median([h["batch_size"] / h["compute_s"] for hs in
                                                              per_rank.values() for h in hs if h["compute_s"] > 0]) * 2)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
