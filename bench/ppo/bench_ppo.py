"""Benchmark: seconds per PPO iteration (generation / experience / training) and peak memory, trl_trainers vs TRL
1.12.0's ``trl.experimental.ppo.PPOTrainer``, on the same tiny models and settings, in the same run.

Each measurement is a fresh subprocess (``_run_one.py``) so peak RSS is per implementation. Both implementations run
with the side environment's interpreter (``bench/.venv-trl112``: torch 2.13.0 CPU, TRL 1.12.0, the same transformers as
the main venv), so library versions and import footprints are identical and only the trainer differs. Runs alternate
(ours, trl, trl, ours, ...) to cancel drift on a shared machine; the first iteration of every run is warm-up and is
dropped; figures are medians over all remaining iterations of all repeats.

Usage: ``python bench/ppo/bench_ppo.py [--repeats 2 --iters 4 --batch 16 --response-length 24]``
Writes ``bench/results/ppo.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SIDE_PYTHON = ROOT / "bench" / ".venv-trl112" / "bin" / "python"
SIDE_SETUP = (
    "python3.11 -m venv bench/.venv-trl112 && bench/.venv-trl112/bin/pip install torch==2.13.0 && "
    "bench/.venv-trl112/bin/pip install torch==2.13.0 trl==1.12.0 'transformers==5.24.*' accelerate datasets peft"
)


def _run(impl: str, opts: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(SIDE_PYTHON), str(HERE / "_run_one.py"), "--impl", impl, *opts], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} run failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "n/a"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="runs per implementation (alternating order)")
    p.add_argument("--iters", type=int, default=4, help="timed iterations per run (after 1 warm-up)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--response-length", type=int, default=24)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="model vocabulary size (LM-like)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--output", default=str(ROOT / "bench" / "results" / "ppo.json"))
    a = p.parse_args()
    if not SIDE_PYTHON.exists():
        print(f"TRL 1.12.0 side environment missing: create it with\n  {SIDE_SETUP}", file=sys.stderr)
        return 2
    opts = ["--iters", str(a.iters), "--batch", str(a.batch), "--response-length", str(a.response_length),
            "--layers", str(a.layers), "--hidden", str(a.hidden), "--epochs", str(a.epochs), "--vocab", str(a.vocab),
            "--mini-batches", str(a.mini_batches)]
    order = []
    for r in range(a.repeats):
        order += ["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    load_before = _loadavg()
    for impl in order:
        print(f"[bench] {impl} ...", flush=True)
        runs[impl].append(_run(impl, opts))
    load_after = _loadavg()

    def agg(impl: str) -> dict:
        its = [t for run in runs[impl] for t in run["iteration_s"][1:]]
        phases = [ph for run in runs[impl] for ph in run["phases"][1:]]
        return {
            "sec_per_iter_median": statistics.median(its),
            "sec_per_iter_iqr": (statistics.quantiles(its, n=4)[0], statistics.quantiles(its, n=4)[2])
            if len(its) >= 2 else None,
            "generation_s": statistics.median(ph["generation"] for ph in phases),
            "experience_s": statistics.median(ph["experience"] for ph in phases),
            "training_s": statistics.median(ph["training"] for ph in phases),
            "peak_rss_mb_max": max(run["peak_rss_mb"] for run in runs[impl]),
            "peak_rss_above_models_mb": max(run["peak_rss_mb"] - run["rss_before_train_mb"] for run in runs[impl]),
            "iterations_timed": len(its),
        }

    ours, trl = agg("ours"), agg("trl")
    summary = {
        "sec_per_iter_ours": ours["sec_per_iter_median"],
        "sec_per_iter_trl": trl["sec_per_iter_median"],
        "trl_vs_ours": trl["sec_per_iter_median"] / ours["sec_per_iter_median"],
        "peak_rss_mb_ours": ours["peak_rss_mb_max"],
        "peak_rss_mb_trl": trl["peak_rss_mb_max"],
        "peak_rss_above_models_mb_ours": ours["peak_rss_above_models_mb"],
        "peak_rss_above_models_mb_trl": trl["peak_rss_above_models_mb"],
        "phases_ours_s": {k: ours[f"{k}_s"] for k in ("generation", "experience", "training")},
        "phases_trl_s": {k: trl[f"{k}_s"] for k in ("generation", "experience", "training")},
    }
    result = {
        "summary": summary,
        "ours": ours,
        "trl": trl,
        "config": {"batch": a.batch, "response_length": a.response_length, "layers": a.layers, "hidden": a.hidden,
                   "vocab": a.vocab,
                   "ppo_epochs": a.epochs, "mini_batches": a.mini_batches, "iters_timed_per_run": a.iters,
                   "repeats": a.repeats, "order": order, "threads_per_process": 1, "precision": "fp32",
                   "models": "GPT-2 policy/ref + GPT-2 seq-cls value/reward from config (random init), char tokenizer "
                             "(44 tokens) for the prompts, model vocabulary `vocab`"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": load_after,
                    "note": "shared 2-core CPU machine; other engineers ran tests concurrently"},
        "versions": {"torch": runs["trl"][0]["torch"], "transformers": runs["trl"][0]["transformers"],
                     "trl_baseline": runs["trl"][0]["trl"]},
        "raw": runs,
    }
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))

    rows = [("", "ours", "TRL 1.12.0")]
    for key, label in (("sec_per_iter_median", "s / iteration"), ("generation_s", "  generation"),
                       ("experience_s", "  experience"), ("training_s", "  training"),
                       ("peak_rss_mb_max", "peak RSS (MB)"), ("peak_rss_above_models_mb", "  above models (MB)")):
        rows.append((label, f"{ours[key]:.2f}", f"{trl[key]:.2f}"))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)))
    print(f"TRL time / our time = {summary['trl_vs_ours']:.2f}; wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
