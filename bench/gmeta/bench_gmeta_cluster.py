"""G-Meta hybrid parallelism against data parallelism with replicated tables, on an emulated two-node cluster.

    sudo .venv/bin/python bench/gmeta/bench_gmeta_cluster.py          # writes bench/results/gmeta_cluster.json
    sudo .venv/bin/python bench/gmeta/bench_gmeta_cluster.py --quick --out /tmp/gmeta_cluster.json   # smoke run

Set-up: two network namespaces ("nodes") x 2 ranks, gloo over TCP; the veth pair between the nodes is shaped with
``tbf`` (`hf_placement.testing.emulated_cluster`) to ``intra / ratio`` (1:50 by default), as
``bench/paro/bench_paro_cluster.py`` does. One DLRM meta-learned with MAML (second order, 1 inner step, vmapped
tasks) whose item table has 1M rows x 16 (64 MB fp32). Every strategy (`_cluster_worker.py`) lives in the same four
processes; timed rounds interleave them after warm-up. See ``bench/gmeta/README.md`` for how to read the result.

Measured per strategy: tasks/s (global tasks per meta-step x steps / the slowest rank's round time; median and IQR
over rounds), bytes over the inter-node link (tx counters of both veth ends, read around every round: real
packets, so TCP/IP headers, gloo framing and the round's two barriers are in them), per-rank embedding bytes
(tensor storages of the rows, their gradient and their optimizer state), and the meta-parameters after the same
steps on the same tasks, compared with the hybrid run's (max abs difference, fp32 tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402
from hf_placement.testing.emulated_cluster import EmulatedCluster  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_cluster_worker.py"
HYBRID = ("hybrid", "hybrid_sparse")
REPLICATED = ("replicated_ddp_default", "replicated_ddp_tuned", "replicated_sparse")
LABELS = {"hybrid": "G-Meta hybrid (a2a shards, dense shard grad)",
          "hybrid_sparse": "G-Meta hybrid (a2a shards, sparse shard grad)",
          "replicated_ddp_default": "replicated, DDP defaults",
          "replicated_ddp_tuned": "replicated, DDP tuned (1 bucket, bucket view)",
          "replicated_sparse": "replicated, sparse table grad all-reduce"}
QUICK = {"items": 20_000, "tasks": 4, "rounds": 2, "steps": 1, "warmup": 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=50.0, help="intra:inter bandwidth ratio")
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--strategies", default=",".join(HYBRID + REPLICATED), help="hybrid must come first")
    p.add_argument("--items", type=int, default=1_000_000, help="rows of the item table")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--tasks", type=int, default=16, help="tasks per rank per meta-step")
    p.add_argument("--warmup", type=int, default=2, help="untimed meta-steps per strategy")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (strategies interleaved)")
    p.add_argument("--steps", type=int, default=4, help="meta-steps per strategy per round")
    p.add_argument("--atol", type=float, default=1e-5, help="meta-parameter equality tolerance (max abs diff)")
    p.add_argument("--probe-seconds", type=float, default=1.5, help="duration of each TCP bandwidth probe")
    p.add_argument("--launch-timeout", type=float, default=1500.0)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gmeta_cluster.json"))
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.probe_seconds = min(args.probe_seconds, 0.5)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not names or names[0] not in HYBRID or not any(n in REPLICATED for n in names):
        raise SystemExit(f"--strategies={args.strategies!r}: give a hybrid strategy first ({HYBRID}) and at least "
                         f"one replicated one ({REPLICATED})")
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1: the memory probe runs in the last warm-up step")
    return args


def set_ratio(cluster: EmulatedCluster, ratio: float, seconds: float) -> dict:
    """Shape the inter-node link to ``intra / ratio``: the intra rate (TCP over loopback inside one node) is
    CPU-bound and noisy on a shared machine, so it is the median of five probes."""
    intra = statistics.median(cluster.measure_bandwidth(seconds)["intra_mb_s"] for _ in range(5))
    cluster.set_inter_mbit(intra / ratio * 8)
    bw = cluster.measure_bandwidth(seconds)
    return {**bw, "intra_mb_s_set_from": intra, "inter_mbit": cluster.inter_mbit, "target_ratio": ratio}


def launch(cluster: EmulatedCluster, args) -> dict:
    argv = [sys.executable, str(WORKER), "--strategies", args.strategies, "--items", str(args.items), "--dim",
            str(args.dim), "--tasks", str(args.tasks), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--steps", str(args.steps), "--collective-timeout", str(min(300.0, args.launch_timeout)),
            "--profile-phases"]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "PYTHONWARNINGS": "ignore"}
    ranks = cluster.run(argv, env=env, timeout=args.launch_timeout)
    for line in ranks[0].stdout.splitlines():
        if line.startswith("GMETA_CLUSTER "):
            return json.loads(line[len("GMETA_CLUSTER "):])
    raise RuntimeError(f"rank 0 printed no GMETA_CLUSTER line; stdout tail:\n{ranks[0].stdout[-2000:]}\n"
                       f"stderr tail:\n{ranks[0].stderr[-2000:]}")


def build_summary(raw: dict, args, bw: dict) -> dict:
    """Ratios of the best hybrid strategy against the best replicated one (and against DDP's defaults); a strategy
    counts only if its meta-parameters equal the hybrid run's within ``--atol``."""
    st = raw["strategies"]
    table_bytes = raw["table_bytes"]
    diffs = raw["param_diffs"]
    ref = raw["param_diffs_vs"]

    def med(n):
        return st[n]["tasks_per_s_stats"]["median"]

    def equal(n):
        return n == ref or diffs[n]["max_abs_diff"] <= args.atol

    hybrids = [n for n in st if n in HYBRID and equal(n)]
    reps = [n for n in st if n in REPLICATED and equal(n)]
    best_h = max(hybrids, key=med)
    best_r = max(reps, key=med) if reps else None
    mem = {n: max(r["total"] for r in st[n]["embedding_bytes_per_rank"]) for n in st}
    rows = {n: max(r["rows"] for r in st[n]["embedding_bytes_per_rank"]) for n in st}
    max_diff = max((diffs[n]["max_abs_diff"] for n in diffs), default=0.0)
    summary = {
        "hybrid_vs_replicated": med(best_h) / med(best_r) if best_r else None,
        "embedding_memory_fraction": rows[ref] / table_bytes,
        "inter_bytes_ratio": (st[best_h]["inter_bytes_per_step"] / st[best_r]["inter_bytes_per_step"]
                              if best_r else None),
        "hybrid": best_h, "replicated": best_r,
        "hybrid_vs_replicated_ddp_default": (med(best_h) / med("replicated_ddp_default")
                                             if "replicated_ddp_default" in st else None),
        "hybrid_vs_replicated_ddp_tuned": (med(best_h) / med("replicated_ddp_tuned")
                                           if "replicated_ddp_tuned" in st else None),
        "hybrid_dense_grad_vs_replicated": med("hybrid") / med(best_r) if "hybrid" in st and best_r else None,
        "embedding_state_fraction": mem[best_h] / table_bytes,
        "embedding_state_fraction_replicated": mem[best_r] / table_bytes if best_r else None,
        "table": {"rows": raw["num_rows"], "dim": args.dim, "bytes": table_bytes,
                  "mb": table_bytes / 2**20},
        "meta_params_max_abs_diff": max_diff, "meta_params_equal": all(equal(n) for n in diffs),
        "meta_params_atol": args.atol, "meta_params_compared_with": ref,
        # the loopback probe is CPU-bound and noisy: the rate set (median of five probes), one probe before the
        # run and one after it
        "bandwidth_ratio": {"target": args.ratio, "set": bw["intra_mb_s_set_from"] / bw["inter_mb_s"],
                            "probe_before": bw["intra_over_inter"],
                            "probe_after": bw.get("after_run", {}).get("intra_over_inter")},
        "tasks_per_s": {n: st[n]["tasks_per_s_stats"] for n in st},
        "inter_mb_per_step": {n: st[n]["inter_bytes_per_step"] / 1e6 for n in st},
        "intra_mb_per_step": {n: st[n]["intra_bytes_per_step"] / 1e6 for n in st},
        "embedding_bytes_max_rank": {n: {"rows": rows[n], "rows_grad_state": mem[n]} for n in st},
    }
    summary["targets"] = {
        "hybrid_vs_replicated": {"value": summary["hybrid_vs_replicated"], "target": ">= 1.5",
                                 "met": None if best_r is None else summary["hybrid_vs_replicated"] >= 1.5},
        "embedding_memory_fraction": {"value": summary["embedding_memory_fraction"], "target": "<= 0.55",
                                      "met": summary["embedding_memory_fraction"] <= 0.55},
        "meta_params_equal": {"value": max_diff, "target": f"<= {args.atol:g}", "met": summary["meta_params_equal"]},
    }
    # where a step's time goes (slowest rank's median per phase, seconds)
    summary["phases_s"] = {n: st[n]["phases"] for n in st}
    return summary


def print_table(raw: dict, summary: dict) -> None:
    st = raw["strategies"]
    print(f"\n{'strategy':<48} {'tasks/s':>9} {'IQR':>7} {'inter MB/step':>14} {'emb MiB/rank':>12} "
          f"{'max|dparam|':>12}")
    for n, r in st.items():
        s = r["tasks_per_s_stats"]
        d = raw["param_diffs"].get(n, {}).get("max_abs_diff", 0.0)
        print(f"{LABELS.get(n, n):<48} {s['median']:9.1f} {s['iqr']:7.1f} {r['inter_bytes_per_step'] / 1e6:14.2f} "
              f"{summary['embedding_bytes_max_rank'][n]['rows_grad_state'] / 2**20:12.1f} {d:12.2e}")
    for n, ph in summary["phases_s"].items():
        print(f"  {n:<26} " + "  ".join(f"{k[:-2]} {v * 1000:7.1f} ms" for k, v in ph.items()))


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    with EmulatedCluster(nodes=2, procs_per_node=args.procs_per_node, inter_mbit=400) as cluster:
        bw = set_ratio(cluster, args.ratio, args.probe_seconds)
        print(f"1:{args.ratio:g}: inter {bw['inter_mb_s']:.1f} MB/s ({bw['inter_mbit']:.0f} mbit tbf), intra "
              f"{bw['intra_mb_s']:.0f} MB/s, measured 1:{bw['intra_over_inter']:.1f}", flush=True)
        t0 = time.perf_counter()
        raw = launch(cluster, args)
        launch_s = time.perf_counter() - t0
        bw["after_run"] = cluster.measure_bandwidth(args.probe_seconds)  # the same link, probed again
    load_after = os.getloadavg()
    summary = build_summary(raw, args, bw)
    import torch

    summary["load_avg"] = {"before": load_before, "after": load_after}
    summary["cpu"] = cpu_info()
    report = {
        "summary": summary,
        "config": {**vars(args), "nodes": 2, "world_size": raw["world_size"],
                   "global_tasks_per_step": raw["global_tasks_per_step"], "support": 10, "query": 10,
                   "model": "DLRM: tables [items, 64 categories] x dim, 4 dense features, bottom MLP [32], top MLP "
                            "[64, 32], dot interaction; MAML second order, 1 inner step (dense layers adapt), "
                            "tasks vmapped; Adagrad lr 0.05, initial accumulator 0.1, every strategy",
                   "unique_rows_per_rank_step": raw["unique_rows_per_rank_step"],
                   "steps_per_strategy": raw["steps_per_strategy"]},
        "bandwidth": bw,
        "strategies": raw["strategies"],
        "param_diffs": raw["param_diffs"],
        "moved_from_init": raw.get("moved_from_init"),
        "machine": {"cpu": cpu_info(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_before": load_before, "load_avg_after": load_after,
                    "note": "2 cores for 4 ranks (1 torch thread each) and the gloo transport"},
        "versions": {"torch": torch.__version__},
        "notes": {
            "inter_bytes": "tx_bytes of both veth ends (each crossing byte is tx on exactly one end), read by one "
                           "rank per node around each round: packets on the wire, so TCP/IP headers, gloo framing "
                           "and the round's two barriers are included",
            "embedding_memory": "untyped storages (distinct) of the table's rows, its gradient (sparse: indices + "
                                "values; a DDP bucket view: its bucket) and its Adagrad state, probed after "
                                "backward and before the update of the last warm-up step; max over ranks",
            "tasks_per_s": "global tasks per meta-step x steps per round / the slowest rank's round time (barrier "
                           "to barrier); median and IQR over rounds, strategies interleaved in rotated order",
        },
        "launch_s": launch_s,
        "wall_s": time.perf_counter() - t_start,
    }
    print_table(raw, summary)
    keys = ("hybrid_vs_replicated", "embedding_memory_fraction", "inter_bytes_ratio", "hybrid", "replicated",
            "hybrid_vs_replicated_ddp_default", "meta_params_max_abs_diff", "meta_params_equal")
    print("\nsummary: " + json.dumps({k: summary[k] for k in keys}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
