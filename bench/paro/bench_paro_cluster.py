"""PaRO on an emulated two-node cluster: 14 PaRO strategies vs DeepSpeed ZeRO-1/2/3 and FSDP2 full/hybrid shard.

    sudo .venv/bin/python bench/paro/bench_paro_cluster.py          # writes bench/results/paro_cluster.json

Set-up: two network namespaces ("nodes") x 2 ranks, gloo over TCP; the veth pair between the nodes is shaped with
``tbf`` (`hf_placement.testing.emulated_cluster`). The intra-node bandwidth (loopback inside a namespace) is measured
first and the inter-node rate is set to ``intra / ratio`` (default 1:50, the paper's 80 vs 2000 Gbit/s is 1:25 per GPU).
One GPT-2 built from a config, one global batch, ``s`` accumulation micro-steps, fp32 + AdamW everywhere.

Per bandwidth setting, ONE launch of 4 ranks (`_worker.py`) runs: a collective calibration (per-link bandwidth,
latency, reduce-scatter and all-reduce factors), a compute-only run (the compute floor), then every configuration,
each timed over ``--steps`` global steps after ``--warmup``. Throughput = global tokens per step / median step
time (the max over ranks of each step). Model-state memory = bytes of the distinct tensor storages reachable from
the model/optimizer/engine of each rank, measured after the last backward of a step (gradients live), max over
ranks. Inter-node bytes come from the veth counters, intra-node bytes from the namespaces' loopback counters.

Guideline check: `paro_zero_backend.advise` gets the model size, n, m, s, the calibrated constants and the measured
compute time, never a training-step time; its order over the 14 PaRO strategies is compared with the measured
order (normalized Kendall-tau distance and top-1 regret).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_placement.partition import VALID_STRATEGY_NAMES  # noqa: E402
from hf_placement.testing.emulated_cluster import ClusterRunError, EmulatedCluster  # noqa: E402
from paro_zero_backend import GuidelineInputs, advise, bytes_per_element  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_worker.py"
BASELINES = ["ds:1", "ds:2", "ds:3", "fsdp2:full", "fsdp2:hybrid"]
SWEEP_SUBSET = ["paro:NNG", "paro:NII", "paro:NIG", "paro:IIG", "paro:III", "paro:IGG", "paro:GGG", "ds:3"]
LABELS = {"ds:1": "DeepSpeed ZeRO-1", "ds:2": "DeepSpeed ZeRO-2", "ds:3": "DeepSpeed ZeRO-3",
          "fsdp2:full": "FSDP2 full-shard", "fsdp2:hybrid": "FSDP2 hybrid-shard", "compute": "compute only"}


def kendall_distance(pred: list[str], measured: dict[str, float], tie_rel: float = 0.0) -> tuple[float, int]:
    """Fraction of strategy pairs that the predicted order (best first) puts the other way round from the measured
    throughput. Pairs whose measured throughputs differ by less than ``tie_rel`` (relative) are measurement ties:
    they are left out (neither order is wrong). Returns (distance, pairs compared)."""
    pos = {s: k for k, s in enumerate(pred)}
    bad = total = 0
    for a, b in itertools.combinations(pred, 2):
        ta, tb = measured[a], measured[b]
        if abs(ta - tb) <= tie_rel * max(ta, tb):
            continue
        total += 1
        if (pos[a] < pos[b]) != (ta > tb):
            bad += 1
    return (bad / total if total else 0.0), total


def run_launch(cluster, configs: list[str], args, calibrate: bool) -> tuple[dict, dict, dict]:
    """Run ``configs`` in launches of ``--chunk`` configurations (process start-up is paid per launch, but a stalled
    or failed launch loses only its own configurations, which are reported as errors)."""
    results, model, calib, errors = {}, {}, {}, {}
    chunks = [configs[k:k + args.chunk] for k in range(0, len(configs), args.chunk)]
    for k, chunk in enumerate(chunks):
        argv = [sys.executable, str(WORKER), "--configs", ",".join(chunk), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--accumulation", str(args.accumulation), "--n-layer",
                str(args.n_layer), "--n-embd", str(args.n_embd), "--vocab", str(args.vocab), "--seq-len",
                str(args.seq_len), "--micro-batch", str(args.micro_batch), "--group-size", str(args.procs_per_node)]
        if calibrate and k == 0:
            argv.append("--calibrate")
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
        try:
            ranks = cluster.run(argv, env=env, timeout=args.launch_timeout)
        except ClusterRunError as exc:
            print(f"launch of {chunk} failed: {str(exc)[:500]}", flush=True)
            errors.update(dict.fromkeys(chunk, str(exc)[:2000]))
            continue
        for line in ranks[0].stdout.splitlines():
            if line.startswith("PARO_BENCH "):
                r = json.loads(line[len("PARO_BENCH "):])
                results[r["config"]] = r
                print(f"  {r['config']:<14} median step {statistics.median(r['step_times_s']):.2f} s", flush=True)
            elif line.startswith("PARO_MODEL "):
                model = json.loads(line[len("PARO_MODEL "):])
            elif line.startswith("PARO_CALIB "):
                calib = json.loads(line[len("PARO_CALIB "):])
    if errors:
        results["_errors"] = errors
    return results, model, calib


def summarize(results: dict, tokens_per_step: int) -> dict:
    out = {}
    for name, r in results.items():
        if name == "_errors":
            continue
        med = statistics.median(r["step_times_s"])
        out[name] = {"median_step_s": med, "tokens_per_s": tokens_per_step / med,
                     "model_state_mb": r["model_state_bytes_max"] / 1e6,
                     "inter_node_mb_per_step": (r["inter_node_bytes_per_step"] or 0) / 1e6,
                     "intra_node_mb_per_step": (r["intra_node_bytes_per_step"] or 0) / 1e6,
                     "median_optimizer_s": statistics.median(r["optimizer_times_s"]),
                     "step_times_s": r["step_times_s"], "losses": r["losses"]}
        if "engine_bytes_per_step" in r:
            out[name]["engine_bytes_per_step"] = r["engine_bytes_per_step"]
            out[name]["engine_memory_bytes"] = r["engine_memory_bytes"]
    return out


def set_ratio(cluster, ratio: float, intra_mb_s: float) -> dict:
    cluster.set_inter_mbit(intra_mb_s / ratio * 8)
    bw = cluster.measure_bandwidth()
    bw["inter_mbit"] = cluster.inter_mbit
    bw["target_ratio"] = ratio
    return bw


def guideline(calib: dict, compute: dict, model: dict, args, num_buckets: int, bw: dict):
    """The guideline fed only calibration figures: collective timings and the compute-only run."""
    intra, inter = calib["intra"], calib["inter"]
    n = 2 * args.procs_per_node
    opt = compute["median_optimizer_s"]
    inputs = GuidelineInputs(
        num_params=model["params"], world_size=n, group_size=args.procs_per_node,
        bandwidth_intra_gbps=intra["bandwidth_mb_s"] * 8e-3, bandwidth_inter_gbps=inter["bandwidth_mb_s"] * 8e-3,
        accumulation_steps=args.accumulation, compute_time_s=compute["median_step_s"] - opt,
        **bytes_per_element(), overlap=0.0, latency_intra_s=intra["latency_s"], latency_inter_s=inter["latency_s"],
        num_buckets=num_buckets, reduce_scatter_factor=inter["reduce_scatter_factor"],
        all_reduce_factor=inter["all_reduce_factor"], optimizer_time_s=opt)
    return advise(inputs)


def compare(table, measured: dict, tie_rel: float) -> dict:
    pred = [r.strategy for r in table.rows]
    tput = {s: measured[f"paro:{s}"]["tokens_per_s"] for s in pred}
    best = max(tput, key=tput.get)
    strict, pairs = kendall_distance(pred, tput, 0.0)
    tied, pairs_t = kendall_distance(pred, tput, tie_rel)
    return {"predicted_order": pred, "measured_order": sorted(tput, key=tput.get, reverse=True),
            "predicted_best": pred[0], "measured_best": best,
            "kendall_distance": strict, "kendall_distance_ties_excluded": tied, "pairs_compared_ties_excluded": pairs_t,
            "tie_threshold_rel": tie_rel, "top1_regret": tput[best] / tput[pred[0]] - 1,
            "predicted_step_s": {r.strategy: r.t_step_s for r in table.rows}}


def table_lines(title: str, s: dict, zero3: str = "ds:3") -> list[str]:
    ref = s[zero3]["tokens_per_s"]
    lines = [title, f"{'configuration':<22} {'tokens/s':>9} {'vs ZeRO-3':>9} {'step s':>7} {'state MB':>9} "
                    f"{'inter MB/step':>13} {'intra MB/step':>13}"]
    for name, r in sorted(s.items(), key=lambda kv: -kv[1]["tokens_per_s"]):
        label = LABELS.get(name, name.replace("paro:", "PaRO "))
        lines.append(f"{label:<22} {r['tokens_per_s']:>9.1f} {r['tokens_per_s'] / ref:>8.2f}x "
                     f"{r['median_step_s']:>7.2f} {r['model_state_mb']:>9.1f} {r['inter_node_mb_per_step']:>13.1f} "
                     f"{r['intra_node_mb_per_step']:>13.1f}")
    return lines


def breakdown(name: str, r: dict, compute: dict, bw: dict) -> dict:
    """Where one step's time goes: compute (the compute-only run), inter and intra communication (bytes over the
    link divided by the measured TCP bandwidth, per direction), and the rest (synchronisation, latency, CPU
    contention of copies)."""
    comp = compute["median_step_s"]
    # bytes are totals over the cluster; each direction/node carries about half, in parallel
    inter = r["inter_node_mb_per_step"] / 2 / bw["inter_mb_s"]
    intra = r["intra_node_mb_per_step"] / 2 / bw["intra_mb_s"]
    step = r["median_step_s"]
    return {"config": name, "step_s": step, "compute_s": comp, "inter_comm_s": inter, "intra_comm_s": intra,
            "other_s": step - comp - inter - intra}


def build_summary(report: dict, ratio: float) -> dict:
    """The `summary` object, from the runs of a report (also used by --resummarize)."""
    main_run = report["runs"][f"1:{ratio:g}"]
    s = main_run["results"]
    paro = {c: r for c, r in s.items() if c.startswith("paro:")}
    best = max(paro, key=lambda c: paro[c]["tokens_per_s"])
    summary = {"best_strategy": best.split(":")[1],
               "best_tokens_per_s": paro[best]["tokens_per_s"]}
    if "ds:3" in s:
        summary["best_vs_zero3"] = paro[best]["tokens_per_s"] / s["ds:3"]["tokens_per_s"]
        summary["ratios_vs_zero3"] = {c: r["tokens_per_s"] / s["ds:3"]["tokens_per_s"] for c, r in s.items()}
        summary["time_breakdown"] = [breakdown(best, paro[best], s["compute"], main_run["bandwidth"]),
                                     breakdown("ds:3", s["ds:3"], s["compute"], main_run["bandwidth"])]
        if "paro:GGG" in s:
            summary["time_breakdown"].append(breakdown("paro:GGG", s["paro:GGG"], s["compute"],
                                                       main_run["bandwidth"]))
    if "guideline" in main_run:
        g = main_run["guideline"]
        summary.update({k: g[k] for k in ("kendall_distance", "kendall_distance_ties_excluded", "top1_regret",
                                          "predicted_best", "measured_best")})
    bw = main_run["bandwidth"]
    summary["bandwidths"] = {"inter_mb_s": bw["inter_mb_s"], "intra_mb_s": bw["intra_mb_s"],
                             "ratio": bw["intra_over_inter"], "inter_mbit_tbf": bw["inter_mbit"]}
    summary["sweep"] = {}
    for key, run in report["runs"].items():
        rs = run["results"]
        pr = {c: r["tokens_per_s"] for c, r in rs.items() if c.startswith("paro:")}
        summary["sweep"][key] = {"inter_mb_s": run["bandwidth"]["inter_mb_s"],
                                 "order": sorted(pr, key=pr.get, reverse=True),
                                 "best_vs_zero3": max(pr.values()) / rs["ds:3"]["tokens_per_s"] if "ds:3" in rs
                                 else None,
                                 "kendall_distance": run.get("guideline", {}).get("kendall_distance")}
    for st in ("IIG", "III", "NIG"):
        if f"paro:{st}" in s and "ds:3" in s:
            summary[f"{st}_vs_zero3"] = s[f"paro:{st}"]["tokens_per_s"] / s["ds:3"]["tokens_per_s"]
    summary["targets"] = {"best_vs_zero3": ">= 2 (paper: +128% for LLaMA-7B, IIG vs ZeRO-3)",
                          "kendall_distance": "<= 0.2", "top1_regret": "<= 0.10"}
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=50.0, help="intra:inter bandwidth ratio of the main run")
    p.add_argument("--sweep", default="10,2", help="further ratios (higher inter bandwidth), comma-separated")
    p.add_argument("--sweep-configs", default=",".join(SWEEP_SUBSET))
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--tie", type=float, default=0.05, help="relative throughput gap counted as a measurement tie")
    p.add_argument("--strategies", default=",".join(VALID_STRATEGY_NAMES), help="PaRO strategies of the main run")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--launch-timeout", type=float, default=1500.0, help="seconds per launch")
    p.add_argument("--chunk", type=int, default=3, help="configurations per launch")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "paro_cluster.json"))
    p.add_argument("--resummarize", metavar="JSON", help="recompute the summary of an existing result file and exit")
    args = p.parse_args(argv)
    if args.resummarize:
        report = json.loads(Path(args.resummarize).read_text())
        report["summary"] = build_summary(report, report["settings"]["ratio"])
        Path(args.resummarize).write_text(json.dumps(report, indent=1))
        print(json.dumps(report["summary"], indent=1))
        return 0
    t_start = time.perf_counter()
    n = 2 * args.procs_per_node
    tokens_per_step = n * args.accumulation * args.micro_batch * args.seq_len
    strategies = [s.strip().upper() for s in args.strategies.split(",") if s.strip()]
    main_configs = ["compute"] + [f"paro:{s}" for s in strategies] + ([] if args.no_baselines else BASELINES)
    report: dict = {"settings": vars(args), "tokens_per_global_step": tokens_per_step, "runs": {}}
    with EmulatedCluster(nodes=2, procs_per_node=args.procs_per_node, inter_mbit=400) as cluster:
        # loopback throughput is CPU-bound and noisy on a busy machine: median of three probes
        intra = statistics.median(cluster.measure_bandwidth()["intra_mb_s"] for _ in range(3))
        print(f"intra-node bandwidth {intra:.0f} MB/s (TCP stream over loopback inside one node)", flush=True)
        sweeps = [float(x) for x in args.sweep.split(",") if x.strip()]
        for k, ratio in enumerate([args.ratio] + sweeps):
            bw = set_ratio(cluster, ratio, intra)
            configs = main_configs if k == 0 else ["compute"] + [c for c in args.sweep_configs.split(",") if c]
            print(f"\n== 1:{ratio:g}: inter {bw['inter_mb_s']:.1f} MB/s ({bw['inter_mbit']:.0f} mbit tbf), intra "
                  f"{bw['intra_mb_s']:.0f} MB/s, measured ratio 1:{bw['intra_over_inter']:.1f}; "
                  f"{len(configs)} configurations", flush=True)
            t0 = time.perf_counter()
            raw, model, calib = run_launch(cluster, configs, args, calibrate=True)
            s = summarize(raw, tokens_per_step)
            entry = {"errors": raw.get("_errors", {}), "bandwidth": bw, "calibration": calib, "model": model,
                     "results": s, "launch_wall_s": time.perf_counter() - t0}
            paro_done = [c for c in s if c.startswith("paro:")]
            if len(paro_done) >= 3 and "compute" in s:
                nb = raw[paro_done[0]]["num_buckets"]
                table = guideline(calib, s["compute"], model, args, nb, bw)
                sub = [c.split(":")[1] for c in paro_done]
                table.rows = [r for r in table.rows if r.strategy in sub]
                entry["guideline"] = compare(table, s, args.tie)
                entry["guideline"]["table"] = table.format()
            report["runs"][f"1:{ratio:g}"] = entry
            lines = table_lines(f"1:{ratio:g} inter:intra ({bw['inter_mb_s']:.1f} vs {bw['intra_mb_s']:.0f} MB/s), "
                                f"{model.get('params', 0) / 1e6:.2f}M params, {tokens_per_step} tokens/step, "
                                f"s={args.accumulation}", s) if "ds:3" in s else []
            print("\n".join(lines), flush=True)
            if "guideline" in entry:
                g = entry["guideline"]
                print(f"guideline: predicted {' > '.join(g['predicted_order'])}\n"
                      f"measured:            {' > '.join(g['measured_order'])}\n"
                      f"Kendall distance {g['kendall_distance']:.3f} (ties < {args.tie:.0%} excluded: "
                      f"{g['kendall_distance_ties_excluded']:.3f}), top-1 regret {g['top1_regret']:.1%}", flush=True)
    summary = build_summary(report, args.ratio)
    import deepspeed
    import torch
    import transformers

    report["summary"] = summary
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         "load_avg_at_end": os.getloadavg(), "note": "2-core machine, 4 ranks; shared with other "
                         "jobs unless rerun on an idle machine"}
    report["versions"] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                          "transformers": transformers.__version__}
    report["wall_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nsummary: {json.dumps({k: v for k, v in summary.items() if k not in ('sweep', 'ratios_vs_zero3')})}")
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
