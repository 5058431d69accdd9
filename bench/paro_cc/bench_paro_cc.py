"""PaRO-CC inside FSDP2 full-shard and DeepSpeed ZeRO-3 on an emulated two-node cluster (2 ranks per node).

For each engine, the same model and batch run with the engine's own flat collectives and with PaRO-CC (hierarchical
all-gather / reduce-scatter). Reported per configuration: median step time, throughput (samples/s), bytes through
the inter-node link per step (read from the veth counters, so a collective that bypassed the shaped link, such as a
shared-memory path, would show up as missing bytes), and PaRO-CC's own counters. The inter-node rate is set to
1/50 of the measured intra-node TCP bandwidth.

Run (root, iproute2)::

    .venv/bin/python bench/paro_cc/bench_paro_cc.py            # writes bench/results/paro_cc.json

Runtime: 650 s on the shared 2-core machine (intra TCP only 263 MB/s there, so the link was shaped to 5 MB/s);
idle, with ~2.4 GB/s intra (~48 MB/s inter), about 3-4 minutes (4 runs of 4 ranks, 8 steps each, plus start-up).

Where the time goes: the steps are inter-link bound. Flat FSDP2 moves 6 model-sizes through the link per step (two
ring all-gathers at 1.5X each, gloo's reduce-scatter as a ring all-reduce at 3X), PaRO-CC 4 (inter-group parts only:
1X, 1X, 2X), so bytes drop 1.5x and step time follows. ZeRO-3's PaRO-CC collectives run synchronously (the flat
baseline's all-gathers are asynchronous and overlap the little compute there is), so its speed-up is below 1.5x.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
from hf_placement.testing.emulated_cluster import EmulatedCluster  # noqa: E402


def _versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        out["deepspeed"] = "missing"
    return out


def run_config(cluster: EmulatedCluster, engine: str, cc: bool, args) -> dict:
    argv = [sys.executable, str(HERE / "_worker.py"), "--engine", engine, "--cc", str(int(cc)),
            "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--group-size", str(args.procs_per_node)]
    env = {"PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "TRANSFORMERS_VERBOSITY": "error"}
    before = cluster.inter_node_bytes()
    t0 = time.perf_counter()
    results = cluster.run(argv, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    total_bytes = cluster.inter_node_bytes() - before
    reports = [r.last_json() for r in results]
    # A step ends when the slowest rank finishes it: per step, the max over ranks.
    steps = [max(r["step_s"][k] for r in reports) for k in range(args.steps)]
    median = statistics.median(steps)
    node_tx = sum(r["node_tx_bytes"] for r in reports if r["node_tx_bytes"] is not None)
    global_batch = args.batch * len(reports)
    return {
        "engine": engine, "paro_cc": cc, "median_step_s": median, "step_s": steps,
        "samples_per_s": global_batch / median, "inter_bytes_per_step": node_tx / args.steps,
        "inter_bytes_whole_run": total_bytes, "run_wall_s": wall,
        "cpu_s_per_step_rank0": reports[0]["cpu_s"] / args.steps,
        "paro_cc_bytes_per_step_rank0": ({k: v / args.steps for k, v in reports[0]["paro_cc_bytes"].items()}
                                         if reports[0]["paro_cc_bytes"] else None),
        "params": reports[0]["params"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=float, default=50.0, help="intra:inter bandwidth ratio to emulate")
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--engines", default="fsdp2,zero3")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "paro_cc.json"))
    args = p.parse_args()

    start = time.perf_counter()
    with EmulatedCluster(nodes=2, procs_per_node=args.procs_per_node, inter_mbit=1000) as cluster:
        intra = cluster.measure_bandwidth()["intra_mb_s"]
        cluster.set_inter_mbit(intra * 8 / args.ratio)
        bw = cluster.measure_bandwidth()
        # tbf's rate and a TCP stream's goodput differ a little: one correction towards the target ratio.
        cluster.set_inter_mbit(cluster.inter_mbit * bw["intra_over_inter"] / args.ratio)
        bw = cluster.measure_bandwidth()
        print(f"bandwidth: intra {bw['intra_mb_s']:.0f} MB/s, inter {bw['inter_mb_s']:.1f} MB/s "
              f"(ratio {bw['intra_over_inter']:.1f}), inter link shaped to {cluster.inter_mbit:.0f} Mbit/s")
        rows = []
        for engine in args.engines.split(","):
            for cc in (False, True):
                row = run_config(cluster, engine, cc, args)
                rows.append(row)
                print(f"  {engine:6s} paro_cc={cc!s:5s} median step {row['median_step_s']:.3f} s, "
                      f"{row['samples_per_s']:.1f} samples/s, {row['inter_bytes_per_step'] / 1e6:.1f} MB/step "
                      f"inter-node", flush=True)

    def pair(engine):
        flat = next(r for r in rows if r["engine"] == engine and not r["paro_cc"])
        cc = next(r for r in rows if r["engine"] == engine and r["paro_cc"])
        return flat, cc

    summary = {}
    print(f"\n{'engine':8s} {'collectives':12s} {'step s':>8s} {'samples/s':>10s} {'inter MB/step':>14s}")
    for engine in args.engines.split(","):
        flat, cc = pair(engine)
        for r in (flat, cc):
            print(f"{engine:8s} {'PaRO-CC' if r['paro_cc'] else 'flat':12s} {r['median_step_s']:8.3f} "
                  f"{r['samples_per_s']:10.1f} {r['inter_bytes_per_step'] / 1e6:14.2f}")
        summary[f"{engine}_cc_speedup"] = cc["samples_per_s"] / flat["samples_per_s"]
        summary[f"{engine}_inter_bytes_ratio"] = flat["inter_bytes_per_step"] / max(cc["inter_bytes_per_step"], 1)
        summary[f"{engine}_median_step_s"] = {"flat": flat["median_step_s"], "paro_cc": cc["median_step_s"]}
        summary[f"{engine}_inter_bytes_per_step"] = {"flat": flat["inter_bytes_per_step"],
                                                     "paro_cc": cc["inter_bytes_per_step"]}
    summary.update({
        "bandwidth_intra_mb_s": bw["intra_mb_s"], "bandwidth_inter_mb_s": bw["inter_mb_s"],
        "bandwidth_ratio": bw["intra_over_inter"], "inter_mbit": cluster.inter_mbit,
        "model": {"kind": "MLP", "width": args.width, "layers": args.layers, "params": rows[0]["params"],
                  "micro_batch_per_rank": args.batch, "ranks": 2 * args.procs_per_node,
                  "ranks_per_node": args.procs_per_node},
    })
    print("\n" + "  ".join(f"{k}={summary[k]:.2f}" for k in summary if k.endswith(("speedup", "bytes_ratio"))))
    out = {"summary": summary, "rows": rows, "config": vars(args), "versions": _versions(),
           "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count()},
           "wall_s": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
