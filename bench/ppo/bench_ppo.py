"""Benchmark: seconds per PPO iteration (generation / experience / training) and peak memory, trl_trainers vs TRL
1.12.0's ``trl.experimental.ppo.PPOTrainer``, on the same tiny models and settings, in the same run, in two settings:

- ``single``: one process (``<side venv>/bin/python bench/ppo/_run_one.py --impl ours|trl ...``);
- ``zero3``: 2 ranks under DeepSpeed ZeRO-3 through Accelerate, the same accelerate config for both implementations
  (``<side venv>/bin/accelerate launch --config_file examples/ppo/deepspeed_zero3.yaml --num_processes 2
  bench/ppo/_run_one.py --impl ours|trl ...``). Every rank gets the same per-device PPOConfig as the one process (what
  launching the same script on more processes does), so each rank rolls out and trains on ``batch`` sequences per
  iteration and the global batch is ``2 x batch``.

Each measurement is a fresh process (or a fresh launch), so peak RSS is per implementation. Both implementations run
with the side environment's interpreter (``bench/.venv-trl112``: torch 2.13.0 CPU, TRL 1.12.0, the same transformers,
accelerate and deepspeed as the main venv), so library versions and import footprints are identical and only the
trainer differs. Runs alternate per setting (ours, trl, trl, ours, ...) to cancel drift on a shared machine; the first
iteration of every run is warm-up and is dropped; figures are medians (and quartiles) over all remaining iterations of
all repeats. Under ZeRO-3 every rank times its own iterations and reports its own peak RSS; an iteration's time is
the max over ranks (the slowest rank sets the pace), and peak RSS per rank is the max over ranks.

Usage: ``python bench/ppo/bench_ppo.py`` (defaults: 3 repeats x 5 timed iterations per setting and implementation;
``--settings single`` or ``--settings zero3`` runs one setting only). Writes ``bench/results/ppo.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402

SIDE_VENV = ROOT / "bench" / ".venv-trl112"
SIDE_PYTHON = SIDE_VENV / "bin" / "python"
SIDE_ACCELERATE = SIDE_VENV / "bin" / "accelerate"
# The commands that made the side venv (run from the repository root). torch first: 2.13.0 is the CPU wheel on disk;
# naming it again in the second command keeps pip from replacing it with a CUDA build.
SIDE_SETUP = (
    "python3.11 -m venv bench/.venv-trl112 && bench/.venv-trl112/bin/pip install torch==2.13.0 && "
    "bench/.venv-trl112/bin/pip install torch==2.13.0 trl==1.12.0 'transformers==5.24.*' 'accelerate==1.16.*' "
    "deepspeed==0.19.8 datasets peft && bench/.venv-trl112/bin/pip list | grep -E '^(torch|trl) '"
)
ZERO3_CONFIG = ROOT / "examples" / "ppo" / "deepspeed_zero3.yaml"
SETTINGS = ("single", "zero3")
IMPLS = ("ours", "trl")
# What TRL 1.12 needs to train under the DeepSpeed launch on a CPU host. Without use_cpu=True and without
# ddp_backend, TrainingArguments sets up a non-distributed state, Accelerate fills DeepSpeed's "auto" batch size for
# one process and DeepSpeed stops at accelerator.prepare: "train_batch_size is not equal to micro_batch_per_gpu *
# gradient_acc_step * world_size". use_cpu=True (passed in both settings, as in one process) or ddp_backend="gloo"
# each fixes it; the benchmark passes both to TRL. Ours resolves ddp_backend to "gloo" itself on CPU-only launches.
TRL_ZERO3_ARGS = ["--ddp-backend", "gloo"]
TRL_ZERO3_NEEDS = (
    "TRL 1.12 under the ZeRO-3 accelerate launch on CPU: needs use_cpu=True or ddp_backend='gloo' in PPOConfig "
    "(with neither, accelerator.prepare fails with DeepSpeed's 'train_batch_size is not equal to micro_batch_per_gpu "
    "* gradient_acc_step * world_size' because TrainingArguments set up a one-process state). The benchmark passes "
    "use_cpu=True to both implementations in both settings and ddp_backend='gloo' to TRL under ZeRO-3; ours resolves "
    "ddp_backend to 'gloo' by itself on CPU-only multi-process launches. Nothing else was needed (no change to the "
    "accelerate config: its use_cpu: false is left as is; DeepSpeed selects its CPU accelerator by itself)."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # TORCH_EXTENSIONS_DIR: DeepSpeed JIT-builds its CPU shm_comm op at every launch whose cached build came from
    # another environment (about a minute on 2 cores); the main venv's DeepSpeed uses the same default cache, so the
    # side venv gets a cache of its own (built once, by the first ZeRO-3 launch) instead of rebuilding after every test
    # run of the main venv, or racing one.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
            "TORCH_EXTENSIONS_DIR": str(SIDE_VENV / "torch_extensions")}


def _command(setting: str, impl: str, opts: list[str], result_dir: str, nproc: int, zero3_config: Path) -> list[str]:
    script = [str(HERE / "_run_one.py"), "--impl", impl, *opts, "--result-dir", result_dir]
    if setting == "single":
        return [str(SIDE_PYTHON), *script]
    extra = TRL_ZERO3_ARGS if impl == "trl" else []
    return [str(SIDE_ACCELERATE), "launch", "--config_file", str(zero3_config), "--num_processes", str(nproc),
            "--main_process_port", str(_free_port()), *script, *extra]


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def _run(setting: str, impl: str, opts: list[str], nproc: int, zero3_config: Path, timeout: float) -> dict:
    """One run (a process, or a launch of ``nproc`` ranks); the per-rank records merged: an iteration's time and
    each phase's time are the max over ranks, peak RSS the max over ranks (per rank in ``peak_rss_mb_per_rank``)."""
    with tempfile.TemporaryDirectory(prefix=f"bench_ppo_{setting}_{impl}_") as result_dir:
        cmd = _command(setting, impl, [*opts, "--out", os.path.join(result_dir, "out")], result_dir, nproc,
                       zero3_config)
        load_before, t0 = _loadavg(), time.perf_counter()
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        world = 1 if setting == "single" else nproc
        files = sorted(Path(result_dir).glob(f"{impl}.rank*.json"))
        if proc.returncode != 0 or len(files) != world:
            raise RuntimeError(f"{setting}/{impl} run failed (exit {proc.returncode}, {len(files)} of {world} rank "
                               f"results): {shlex.join(cmd)}\n{proc.stderr[-6000:]}")
        ranks = sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])
    n_iter = min(len(r["iteration_s"]) for r in ranks)
    if any(len(r["iteration_s"]) != n_iter for r in ranks):
        print(f"[bench] warning: {setting}/{impl}: ranks timed different iteration counts "
              f"{[len(r['iteration_s']) for r in ranks]}", file=sys.stderr)
    n_phase = min(len(r["phases"]) for r in ranks)
    phase_keys = sorted(set.intersection(*(set(p) for r in ranks for p in r["phases"][:n_phase])) if n_phase else [])
    first = ranks[0]
    return {
        "setting": setting,
        "impl": impl,
        "world_size": world,
        "command": shlex.join(cmd),
        "wall_s": wall,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "iteration_s": [max(r["iteration_s"][i] for r in ranks) for i in range(n_iter)],
        "phases": [{k: max(r["phases"][i][k] for r in ranks) for k in phase_keys} for i in range(n_phase)],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks],
        "peak_rss_above_models_mb": max(r["peak_rss_mb"] - r["rss_before_train_mb"] for r in ranks),
        "ddp_backend": first.get("ddp_backend"),
        "process_group_backend": first.get("process_group_backend"),
        "distributed_type": first.get("distributed_type"),
        "engine": first.get("engine"),
        "versions": {k: first.get(k) for k in ("torch", "transformers", "trl", "accelerate", "deepspeed")},
        "ranks": ranks,
    }


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, statistics.median(xs), q3


def _aggregate(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    its = [t for run in runs for t in run["iteration_s"][1:]]
    phases = [ph for run in runs for ph in run["phases"][1:]]
    if not its:
        raise RuntimeError("no timed iterations: every run's first iteration is warm-up; use --iters >= 1")
    q1, med, q3 = _quartiles(its)
    keys = sorted(set.intersection(*(set(p) for p in phases))) if phases else []
    n_ranks = max(len(run["peak_rss_mb_per_rank"]) for run in runs)
    return {
        "sec_per_iter_median": med,
        "sec_per_iter_q1": q1,
        "sec_per_iter_q3": q3,
        "sec_per_iter_iqr": q3 - q1,
        "phases_median_s": {k: statistics.median(ph[k] for ph in phases) for k in keys},
        "peak_rss_mb_max": max(run["peak_rss_mb"] for run in runs),
        "peak_rss_mb_per_rank": [max(run["peak_rss_mb_per_rank"][i] for run in runs
                                     if i < len(run["peak_rss_mb_per_rank"])) for i in range(n_ranks)],
        "peak_rss_above_models_mb": max(run["peak_rss_above_models_mb"] for run in runs),
        "iterations_timed": len(its),
        "runs": len(runs),
        "launch_wall_s_median": statistics.median(run["wall_s"] for run in runs),
    }


def _iqr_overlap(a: dict | None, b: dict | None) -> bool | None:
    if a is None or b is None:
        return None
    return not (a["sec_per_iter_q3"] < b["sec_per_iter_q1"] or b["sec_per_iter_q3"] < a["sec_per_iter_q1"])


def _git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "dirty_paths": [line[3:] for line in git("status", "--porcelain").splitlines()
                                if line[3:].startswith(("trl_trainers/", "bench/ppo/"))]}
    except OSError:
        return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="runs per implementation and setting (alternating order)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per run (after 1 warm-up iteration)")
    p.add_argument("--batch", type=int, default=16, help="rollout batch per rank and iteration")
    p.add_argument("--response-length", type=int, default=24)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="model vocabulary size (LM-like)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of single,zero3")
    p.add_argument("--num-processes", type=int, default=2, help="ranks of the zero3 setting")
    p.add_argument("--zero3-config", default=str(ZERO3_CONFIG), help="accelerate config of the zero3 setting")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--output", default=str(ROOT / "bench" / "results" / "ppo.json"))
    a = p.parse_args()
    settings = [s for s in a.settings.split(",") if s]
    if not settings or any(s not in SETTINGS for s in settings):
        p.error(f"--settings takes a comma-separated subset of {','.join(SETTINGS)}")
    if a.batch % a.mini_batches:
        p.error("--batch must be a multiple of --mini-batches")
    if not SIDE_PYTHON.exists() or not SIDE_ACCELERATE.exists():
        print(f"TRL 1.12.0 side environment missing: create it (from {ROOT}) with\n  {SIDE_SETUP}", file=sys.stderr)
        return 2
    zero3_config = Path(a.zero3_config).resolve()
    opts = ["--iters", str(a.iters), "--batch", str(a.batch), "--response-length", str(a.response_length),
            "--layers", str(a.layers), "--hidden", str(a.hidden), "--epochs", str(a.epochs), "--vocab", str(a.vocab),
            "--mini-batches", str(a.mini_batches)]
    order: list[tuple[str, str]] = []
    for r in range(a.repeats):
        pair = IMPLS if r % 2 == 0 else IMPLS[::-1]
        order += [(setting, impl) for setting in settings for impl in pair]
    runs: dict[str, dict[str, list[dict]]] = {s: {i: [] for i in IMPLS} for s in settings}
    machine = {**cpu_info(), "platform": platform.platform(), "python": platform.python_version(),
               "loadavg_before": _loadavg()}
    t_start = time.perf_counter()
    for n, (setting, impl) in enumerate(order, 1):
        print(f"[bench] {n}/{len(order)} {setting} {impl} ...", flush=True)
        run = _run(setting, impl, opts, a.num_processes, zero3_config, a.timeout)
        print(f"[bench]   {run['wall_s']:.1f} s wall, iterations "
              f"{', '.join(f'{t:.2f}' for t in run['iteration_s'])} s", flush=True)
        runs[setting][impl].append(run)
    machine["loadavg_after"] = _loadavg()
    machine["bench_wall_s"] = time.perf_counter() - t_start

    agg = {s: {i: _aggregate(runs[s][i]) for i in IMPLS} for s in SETTINGS if s in runs}
    get = lambda s, i: agg.get(s, {}).get(i)  # noqa: E731

    def ratio(s: str) -> float | None:
        o, t = get(s, "ours"), get(s, "trl")
        return t["sec_per_iter_median"] / o["sec_per_iter_median"] if o and t else None

    def field(s: str, i: str, key: str):
        x = get(s, i)
        return x[key] if x else None

    overlap = {s: _iqr_overlap(get(s, "ours"), get(s, "trl")) for s in SETTINGS}
    measured = [v for v in overlap.values() if v is not None]
    summary = {
        "trl_vs_ours": ratio("single"),
        "trl_vs_ours_zero3": ratio("zero3"),
        # false only when, in every measured setting, the IQRs of ours and TRL are apart
        "iqr_overlap": any(measured) if measured else None,
        "iqr_overlap_single": overlap["single"],
        "iqr_overlap_zero3": overlap["zero3"],
        "peak_rss_mb_ours": max((x["peak_rss_mb_max"] for s in agg if (x := get(s, "ours"))), default=None),
        "peak_rss_mb_trl": max((x["peak_rss_mb_max"] for s in agg if (x := get(s, "trl"))), default=None),
    }
    for s in SETTINGS:
        suffix = "" if s == "single" else f"_{s}"
        for i in IMPLS:
            summary[f"sec_per_iter_{i}{suffix}"] = field(s, i, "sec_per_iter_median")
            summary[f"sec_per_iter_q1_{i}{suffix}"] = field(s, i, "sec_per_iter_q1")
            summary[f"sec_per_iter_q3_{i}{suffix}"] = field(s, i, "sec_per_iter_q3")
            summary[f"phases_{i}{suffix}_s"] = field(s, i, "phases_median_s")
            summary[f"peak_rss_mb_{i}_{s}"] = field(s, i, "peak_rss_mb_max")
            summary[f"peak_rss_mb_per_rank_{i}_{s}"] = field(s, i, "peak_rss_mb_per_rank")
            summary[f"peak_rss_above_models_mb_{i}_{s}"] = field(s, i, "peak_rss_above_models_mb")

    any_trl = next(run for s in runs for run in runs[s]["trl"])
    config_rel = str(zero3_config.relative_to(ROOT)) if zero3_config.is_relative_to(ROOT) else str(zero3_config)
    result = {
        "summary": summary,
        "settings": agg,
        "config": {
            "settings": settings,
            "batch_per_rank": a.batch, "global_batch": {"single": a.batch, "zero3": a.batch * a.num_processes},
            "per_device_train_batch_size": a.batch // a.mini_batches, "gradient_accumulation_steps": a.mini_batches,
            "num_mini_batches": a.mini_batches, "ppo_epochs": a.epochs, "response_length": a.response_length,
            "layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "n_positions": 128,
            "iters_timed_per_run": a.iters, "warmup_iters_dropped_per_run": 1, "repeats": a.repeats,
            "order": [f"{s}:{i}" for s, i in order], "threads_per_process": 1, "precision": "fp32",
            "zero3_num_processes": a.num_processes, "zero3_accelerate_config": config_rel,
            "use_cpu": True, "trl_zero3_extra_args": TRL_ZERO3_ARGS, "trl_zero3_needed": TRL_ZERO3_NEEDS,
            "aggregation": "per run: an iteration's time (and each phase's) is the max over ranks, peak RSS the max "
                           "over ranks; per setting and implementation: median / quartiles over all timed "
                           "iterations of all repeats (first iteration of each run dropped)",
            "models": "GPT-2 policy/ref + GPT-2 seq-cls value/reward from config (random init, same seeds on every "
                      "rank), char tokenizer (44 tokens) for the prompts, model vocabulary `vocab`",
            "invocation": shlex.join([sys.executable, *sys.argv]),
            "commands": {
                "single": f"PYTHONPATH=<repo> OMP_NUM_THREADS=1 {SIDE_PYTHON.relative_to(ROOT)} "
                          f"bench/ppo/_run_one.py --impl ours|trl {' '.join(opts)} --result-dir <tmp>",
                "zero3": f"PYTHONPATH=<repo> OMP_NUM_THREADS=1 {SIDE_ACCELERATE.relative_to(ROOT)} launch "
                         f"--config_file {config_rel} "
                         f"--num_processes {a.num_processes} --main_process_port <free> bench/ppo/_run_one.py "
                         f"--impl ours|trl {' '.join(opts)} --result-dir <tmp> [trl: {' '.join(TRL_ZERO3_ARGS)}]",
                "side_venv_setup": SIDE_SETUP,
            },
            "env": {k: _env()[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HUB_OFFLINE",
                                           "TOKENIZERS_PARALLELISM", "TORCH_EXTENSIONS_DIR")},
        },
        "machine": machine,
        "versions": {**any_trl["versions"], "python_side_venv": None},
        "repo": _git_commit(),
        "raw": runs,
    }
    try:
        result["versions"]["python_side_venv"] = subprocess.run(
            [str(SIDE_PYTHON), "-c", "import platform; print(platform.python_version())"], capture_output=True,
            text=True).stdout.strip()
    except OSError:
        pass
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=2))

    header = ("setting", "impl", "s/iter median", "IQR [q1, q3]", "gen / exp / train / other s",
              "peak RSS MB (per rank)")
    rows = [header]
    for s in settings:
        for i in IMPLS:
            x = agg[s][i]
            ph = x["phases_median_s"]
            rows.append((s if s == "single" else f"zero3 x{a.num_processes}", "ours" if i == "ours" else "TRL 1.12.0",
                         f"{x['sec_per_iter_median']:.3f}",
                         f"{x['sec_per_iter_iqr']:.3f} [{x['sec_per_iter_q1']:.3f}, {x['sec_per_iter_q3']:.3f}]",
                         " / ".join(f"{ph[k]:.2f}" if k in ph else "-" for k in ("generation", "experience",
                                                                                    "training", "other")),
                         f"{x['peak_rss_mb_max']:.0f} ({', '.join(f'{m:.0f}' for m in x['peak_rss_mb_per_rank'])})"))
    width = [max(len(r[c]) for r in rows) for c in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)))
    for s, key in (("single", "trl_vs_ours"), ("zero3", "trl_vs_ours_zero3")):
        if summary[key] is not None:
            print(f"{s}: TRL time / our time = {summary[key]:.2f}, IQRs overlap: {overlap[s]}")
    print(f"iqr_overlap = {summary['iqr_overlap']}; loadavg {machine['loadavg_before']} -> "
          f"{machine['loadavg_after']}; {machine['bench_wall_s']:.0f} s; wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
