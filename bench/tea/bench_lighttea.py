"""Benchmark: LightTEA (tea_pipeline defaults) on YAGO-WIKI20K with 400 seeds, the whole run timed.

Targets (issue 3): H@1 >= 0.68, H@10 >= 0.72, MRR >= 0.69 after 3 rounds; loading + alignment <= 60 s wall;
peak RSS < 8 GB on a 2-core CPU. TEA-GNN reports H@1 0.512 / H@10 0.630 / MRR 0.553 on this split; the reference
LightTEA code needs ~550 s + 457 s of simt pre-computation and 18.2 GB on the same kind of machine
(shared/docs/lighttea.md section 8).

Usage: ``python bench/tea/bench_lighttea.py [--data DIR] [--seeds 400] [--threads 2] [--exact] [--check-rows 512]
[--repeats 3] [--output bench/results/tea.json]``. Each timed run is a fresh ``python`` process (interpreter start,
imports, loading and alignment all inside the wall time) running the default configuration; ``summary.wall_s`` is
the median of ``--repeats`` runs (all runs listed, their metrics must be identical). The recall of the candidate
search is measured afterwards in one more, untimed run with ``candidate_check_rows`` (it adds an exact top-k on the
sampled rows, which is not part of what a user runs). Writes a JSON file with per-stage times, per-round metrics,
the recall and a ``summary`` object, and prints a table.

Where the time goes (stage timers of the median run, 54 s, 2 threads; py-spy at 20 Hz for the split inside a stage):
the top-500 candidate search 45% (block products in a 512-dim principal subspace, bf16 on AMX; then `torch.topk`
with k=500 per row, about 8 s of its 24 s, where a sampled-threshold selection we tried was 2.7x slower; then re-
scoring the 64 leading candidates of every row in the full 2720-wide space, a memory-bound gather that reads the
candidate rows as fp16), the triple view 24% (the bf16 ``tails x 1024 x 2720`` product and 170 CSR products per
aspect), label propagation 7% (CSR products), imports 7%, Sinkhorn 5% (in place, ``take`` for the column gather).
Steps from the previous 86 s (idle, same machine, one run per step, ``--check-rows 0``): bf16 search and projections
+ in-place row normalisation + the round-1 pseudo-seed search reusing the evaluation search (nothing is masked yet)
86 -> 66 s; in-place Sinkhorn (bit-identical; 1.73 -> 1.13 s per 19,500 x 500 call) + CSR propagation + a bf16 Gram
matrix for the basis 66 -> 56 s; a sort-based unique in the graph build (graph stage 3.1 -> 0.75 s; NumPy 2.3's
hash-based ``np.unique`` took 2.4 s) + a CSR tuple product; then re-scoring 64 instead of 32 candidates (H@10 0.7203
-> 0.7221), paid for by reading the candidate rows as fp16 (the gather is memory-bound: 2.2-2.5 s per call vs
1.9-5.7 s in fp32 on this host; max abs score error 4e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = Path(os.environ.get("HF_SCALE_SHARED_DATA", ROOT.parent / "shared" / "data")) / "tea" / "YAGO-WIKI20K"
TARGETS = {"hits@1": 0.68, "hits@10": 0.72, "mrr": 0.69, "wall_s": 60.0, "peak_rss_gb": 8.0}
REFERENCE = {"TEA-GNN (paper, Table 4)": {"hits@1": 0.512, "hits@10": 0.630, "mrr": 0.553},
             "LightTEA reference code, 2-core CPU (doc section 8)": {"hits@1": 0.677, "hits@10": 0.716,
                                                                    "mrr": 0.692, "wall_s": 560 + 457,
                                                                    "peak_rss_gb": 18.2}}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    """Run ``--repeats`` timed child processes and one untimed diagnostics child; merge them into one record."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        return run_once(args)
    if not Path(args.data).is_dir():
        print(f"data folder {args.data} not found (set HF_SCALE_SHARED_DATA or --data)", file=sys.stderr)
        return 2
    import statistics  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    base = [sys.executable, __file__, "--child", "--data", args.data, "--seeds", str(args.seeds), "--threads",
            str(args.threads), "--device", args.device] + (["--reference-compat"] if args.reference_compat else []) \
        + (["--exact"] if args.exact else [])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats + (1 if args.check_rows else 0)):
            diag = i == args.repeats
            out = Path(tmp) / f"run{i}.json"
            t0 = time.perf_counter()
            subprocess.run(base + ["--check-rows", str(args.check_rows if diag else 0), "--output", str(out)],
                           check=True)
            record = json.loads(out.read_text())
            record["external_wall_s"] = round(time.perf_counter() - t0, 2)
            runs.append(record)
    timed, diag = runs[:args.repeats], (runs[args.repeats] if args.check_rows else None)
    finals = {json.dumps({k: record["summary"][k] for k in ("hits@1", "hits@10", "mrr")}) for record in runs}
    walls = [record["summary"]["wall_s"] for record in timed]
    median = statistics.median(walls)
    record = min(timed, key=lambda rec: abs(rec["summary"]["wall_s"] - median))  # the median run's stages
    summary = record["summary"]
    summary["wall_s"] = round(median, 2)
    summary["wall_s_runs"] = walls
    summary["external_wall_s_runs"] = [rec["external_wall_s"] for rec in timed]
    summary["deterministic"] = len(finals) == 1
    summary["meets"]["wall_s"] = median <= TARGETS["wall_s"]
    summary["peak_rss_gb"] = max(rec["summary"]["peak_rss_gb"] for rec in timed)
    summary["candidate_recall"] = diag["summary"]["candidate_recall"] if diag else None
    record["diagnostics_run"] = ({"what": "untimed run with candidate_check_rows", "check_rows": args.check_rows,
                                  "rounds": diag["rounds"], "wall_s": diag["summary"]["wall_s"]} if diag else None)
    record.pop("external_wall_s", None)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\n{args.repeats} timed runs (fresh processes): wall {walls} s, median {median:.1f} s "
          f"(target {TARGETS['wall_s']:.0f} s); identical metrics: {summary['deterministic']}")
    if diag:
        for r in diag["rounds"]:
            c = r.get("candidate_recall")
            if c:
                print(f"round {r['round']}: subspace candidates vs exact top-k on {c['rows']} rows: recall "
                      f"{c['recall']:.4f}, same best candidate {c['top1']:.4f}, identical set {c['same_set']:.3f}")
    print(f"wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reference-compat", action="store_true")
    parser.add_argument("--exact", action="store_true", help="exact full-space top-k search (candidate_dim=None)")
    parser.add_argument("--check-rows", type=int, default=512,
                        help="rows per round whose candidates are compared with the exact top-k (0: off)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "tea.json"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs, each a fresh process (median reported)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_once(args: argparse.Namespace) -> int:
    """One run in this process (the child): timed from interpreter start, written to ``--output``."""
    load_before = os.getloadavg()

    import datasets  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import tea_pipeline  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    import_s = time.perf_counter() - START
    t0 = time.perf_counter()
    pair = tea_pipeline.load_tkg_pair(args.data, args.seeds)
    load_s = time.perf_counter() - t0
    extra = {"candidate_dim": None} if args.exact else {}
    config = tea_pipeline.LightTEAConfig(device=args.device, reference_compat=args.reference_compat,
                                         candidate_check_rows=args.check_rows, **extra)
    result = tea_pipeline.LightTEA(config).fit(pair)
    fit_s = time.perf_counter() - t0 - load_s
    wall_s = time.perf_counter() - START
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak_rss_gb = usage.ru_maxrss / 1024**2
    cpu_s = usage.ru_utime + usage.ru_stime
    load_after = os.getloadavg()

    stages = {"python_imports": import_s, "load": load_s, **result.timings}
    accounted = sum(stages.values())
    stages["other"] = max(0.0, wall_s - accounted)
    share = {k: round(v / wall_s, 4) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])}
    final = result.final
    summary = {
        **{k: round(v, 4) for k, v in final.items()},
        "wall_s": round(wall_s, 2),
        "fit_s": round(fit_s, 2),
        "load_s": round(load_s, 2),
        "peak_rss_gb": round(peak_rss_gb, 3),
        "time_share": share,
        "threads": torch.get_num_threads(),
        "candidate_recall": [r.candidate_recall for r in result.rounds],
        "where_time_goes": ", ".join(f"{k} {100 * v:.0f}%" for k, v in list(share.items())[:4]),
        "targets": TARGETS,
        "meets": {"hits@1": final["hits@1"] >= TARGETS["hits@1"], "hits@10": final["hits@10"] >= TARGETS["hits@10"],
                  "mrr": final["mrr"] >= TARGETS["mrr"], "wall_s": wall_s <= TARGETS["wall_s"],
                  "peak_rss_gb": peak_rss_gb < TARGETS["peak_rss_gb"]},
        "contention": {"loadavg_1min_before": round(load_before[0], 2), "loadavg_1min_after": round(load_after[0], 2),
                       "cpus": os.cpu_count(), "process_cpu_s": round(cpu_s, 1),
                       "cpu_per_wall": round(cpu_s / wall_s, 2),
                       "note": "load average above the CPU count means other processes shared the cores; "
                               "cpu_per_wall well below the thread count means this run waited for a core"},
    }
    record = {
        "benchmark": "LightTEA on YAGO-WIKI20K",
        "summary": summary,
        "stages_s": {k: round(v, 3) for k, v in stages.items()},
        "rounds": [r.as_dict() for r in result.rounds],
        "reference_numbers": REFERENCE,
        "config": result.config,
        "data": result.data_summary | {"folder": str(args.data)},
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "datasets": datasets.__version__,
                     "numpy": __import__("numpy").__version__, "tea_pipeline": "0 (this checkout)"},
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")

    print(f"\nLightTEA on {pair.name}, {args.seeds} seeds, {torch.get_num_threads()} threads, device {result.device}")
    print(f"{'round':>5} | {'H@1':>6} | {'H@10':>6} | {'MRR':>6} | {'pseudo':>6} | {'prec':>5} | {'s':>6}")
    for r in result.rounds:
        prec = "-" if r.pseudo_seed_precision is None else f"{r.pseudo_seed_precision:.3f}"
        print(f"{r.round:>5} | {r.hits_at_1:6.4f} | {r.hits_at_10:6.4f} | {r.mrr:6.4f} | {r.pseudo_seeds_added:>6} | "
              f"{prec:>5} | {r.seconds:6.1f}")
    for r in result.rounds:
        if r.candidate_recall:
            c = r.candidate_recall
            print(f"round {r.round}: subspace candidates vs exact top-{config.top_k} on {c['rows']} rows: recall "
                  f"{c['recall']:.4f}, same best candidate {c['top1']:.4f}, identical set {c['same_set']:.3f}")
    print(f"\n{'stage':<22} | {'seconds':>8} | share")
    for k, v in sorted(stages.items(), key=lambda kv: -kv[1]):
        print(f"{k:<22} | {v:8.2f} | {100 * v / wall_s:4.0f}%")
    print(f"\nfinal H@1 {final['hits@1']:.4f} H@10 {final['hits@10']:.4f} MRR {final['mrr']:.4f}; wall {wall_s:.1f}s "
          f"(load {load_s:.1f}s); peak RSS {peak_rss_gb:.2f} GB; load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f} on {os.cpu_count()} CPUs; process CPU time {cpu_s:.1f}s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
