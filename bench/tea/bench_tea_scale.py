"""LightTEA at 1x, 2x, 4x and 10x the size of YAGO-WIKI50K on synthetic pairs (issue 20, "Scale").

Each (size, search) run is a fresh process: it builds `tea_pipeline.synthetic.make_scaled_pair(scale)` (entities,
facts, time stamps and seeds in YAGO-WIKI50K's proportions, alignment known) and aligns it with the default
`LightTEAConfig` except for ``candidate_search``. A sampler thread reads the process's RSS every 20 ms and keeps the
peak per engine stage (`LightTEA.current_stage`), and on glibc also the peak of the bytes the allocator holds for
live allocations (``stage_peak_live_gb``: RSS also counts freed memory kept for reuse), and records its own CPU
time (``sampler_cpu_s``, what the sampling takes from the run's two cores); the run also records
per-stage seconds, the whole wall time (generation + alignment; interpreter start and imports are reported
separately), H@1/H@10/MRR, the search used and the features' storage dtype.

The main series runs ``--search`` (default ``auto``: faiss from ``faiss_min_rows`` test pairs on, exact below; a size
run with the exact search only stands in the series with that search). At
``--exact-sizes`` the scalable search (``--scalable-search``, default faiss) and the exact one
(``candidate_search="exact"``, the quadratic PyTorch search) are both run, and ``h1_gap_vs_exact`` is the largest
(exact H@1 - scalable H@1) over them. ``time_exponent`` is the least-squares slope
of log(wall) against log(entities) over the scalable runs from 2x to 10x (over every size that ran when fewer than two
of those did: see ``time_exponent_sizes``). Each run records when it ran, from which commit and the load average
at its end (``measured``, ``load_average_end``); the summary lists the first two per size (``measured``,
``revision``), since ``--merge`` keeps runs of earlier code. Writes ``bench/results/tea_scale.json`` with a
``summary`` object.

``--isa avx2`` runs the children the way a CPU without AVX-512 or bf16 units runs them (PyTorch, oneDNN and MKL held
to their AVX2 code paths, fp32 products: `bench_lighttea.ISA_ENV`). The summary's series are the ``host`` runs;
``summary["avx2"]`` lists the AVX2 runs' sizes, wall times, peak RSS and H@1.

    python bench/tea/bench_tea_scale.py --sizes 1,2,4,10 --exact-sizes 1,2
    python bench/tea/bench_tea_scale.py --sizes 2 --exact-sizes "" --merge    # add a size to the existing file
    python bench/tea/bench_tea_scale.py --sizes "" --exact-sizes "" --merge   # recompute the summary only
    python bench/tea/bench_tea_scale.py --sizes 10 --search exact --exact-sizes "" --isa avx2 --merge

``--set key=value`` (repeatable) overrides a `LightTEAConfig` field in every run, to see which setting costs
accuracy or time at scale. Such runs are not the defaults' series, so they go to their own ``--out`` file:

    python bench/tea/bench_tea_scale.py --sizes 4 --exact-sizes "" --search exact --set candidate_dim=512 \\
        --out bench/results/tea_scale_4x_candidate_dim512.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lighttea import ISA_ENV, ISA_PRECISION  # noqa: E402

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "bench" / "results" / "tea_scale.json"
TARGET_SIZES = (1.0, 2.0, 4.0, 10.0)  # issue 20's sizes; the summary lists those without a run in not_run
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "avx512_vnni")


def rss_gb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def malloc_live_gb():
    """A function returning the bytes glibc's allocator holds for live allocations (GB), or None off glibc.

    RSS also counts freed memory the allocator keeps for reuse (`LightTEAConfig.reuse_freed_memory`); the live
    bytes say what the tensors themselves hold."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None

    def live() -> float:
        m = libc.mallinfo2()
        return (m.uordblks + m.hblkhd) / 2**30

    return live


def cpu_info() -> dict:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in FLAGS},
            "bf16_units": "avx512_bf16" in flags or "amx_bf16" in flags, "amx": "amx_tile" in flags}


def parse_override(item: str) -> tuple[str, object]:
    """``key=value`` of ``--set``: the value read as JSON (numbers, true/false, null) or ``None``, else as a string."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {item!r}: expected key=value, e.g. --set candidate_dim=512")
    if text == "None":
        return key, None
    try:
        return key, json.loads(text)
    except json.JSONDecodeError:
        return key, text


def child(scale: float, search: str, seed: int, rounds: int, nprobe: int | None, precision: str,
          overrides: dict) -> dict:
    """One run in this process; returns its record."""
    t_import = time.perf_counter()
    import torch

    from tea_pipeline import LightTEA, LightTEAConfig
    from tea_pipeline.precision import matmul_dtype
    from tea_pipeline.synthetic import make_scaled_pair

    imports_s = time.perf_counter() - t_import
    peaks: dict[str, float] = {}
    live_peaks: dict[str, float] = {}
    live = malloc_live_gb()
    state = {"stage": "generate", "stop": False}

    def sample() -> None:
        while not state["stop"]:
            stage = state["stage"] if state["stage"] != "fit" else (model.current_stage or "other")
            peaks[stage] = max(peaks.get(stage, 0.0), rss_gb())
            if live is not None:
                live_peaks[stage] = max(live_peaks.get(stage, 0.0), live())
            time.sleep(0.02)
        state["sampler_cpu_s"] = time.thread_time()  # this thread's own CPU time: the sampling's cost to the run

    model = None
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    pair = make_scaled_pair(scale, seed=seed)
    gen_s = time.perf_counter() - t0
    kw = {"candidate_search": search, "rounds": rounds, "matmul_precision": precision}
    if nprobe is not None:
        kw["faiss_nprobe"] = nprobe
    kw |= overrides
    model = LightTEA(LightTEAConfig(**kw))
    state["stage"] = "fit"
    t1 = time.perf_counter()
    result = model.fit(pair)
    fit_s = time.perf_counter() - t1
    state["stop"] = True
    sampler.join()
    return {
        "scale": scale, "search": result.config["candidate_search_used"], "requested_search": search,
        "data": pair.summary(), "entities": pair.num_entities,
        "wall_s": round(gen_s + fit_s, 2), "generate_s": round(gen_s, 2), "fit_s": round(fit_s, 2),
        "imports_s": round(imports_s, 2), "process_s": round(time.perf_counter() - T_START, 2),
        "stage_s": result.timings, "stage_peak_rss_gb": {k: round(v, 3) for k, v in peaks.items()},
        "stage_peak_live_gb": {k: round(v, 3) for k, v in live_peaks.items()},
        "feature_dtype": result.config["feature_dtype_used"],
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "final": result.final, "rounds": [r.as_dict() for r in result.rounds],
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "faiss_nprobe": result.config["faiss_nprobe"], "matmul_precision": precision,
        "products": str(matmul_dtype(precision, torch.device("cpu"))).removeprefix("torch."),
        "overrides": overrides, "sampler_cpu_s": round(state["sampler_cpu_s"], 2),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def code_revision() -> str | None:
    """The checkout's commit, with ``+changes`` when tracked files differ from it: a merged file can hold runs of
    several revisions, and the summary says which run came from which."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+changes" if dirty else "")


def fit_exponent(runs: list[dict], lo: float, hi: float) -> tuple[float | None, list[float]]:
    pts = [(math.log(r["entities"]), math.log(r["wall_s"])) for r in runs if lo <= r["scale"] <= hi]
    if len(pts) < 2:
        return None, []
    mx, my = sum(p[0] for p in pts) / len(pts), sum(p[1] for p in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return round(slope, 3), sorted(r["scale"] for r in runs if lo <= r["scale"] <= hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,10", help="Multiples of YAGO-WIKI50K run with the scalable search.")
    ap.add_argument("--exact-sizes", default="1,2", help="Sizes also run with the exact search (h1 gap).")
    ap.add_argument("--search", default="auto", help="candidate_search of the scalable runs (auto: faiss above "
                                                     "faiss_min_rows test pairs).")
    ap.add_argument("--scalable-search", default="faiss", help="candidate_search of the scalable runs at sizes "
                                                               "where they are compared with the exact one.")
    ap.add_argument("--nprobe", type=int, default=None, help="faiss_nprobe (default: the config's).")
    ap.add_argument("--isa", default="host", choices=sorted(ISA_ENV),
                    help="Instruction sets the runs may use (avx2: as on a CPU without AVX-512 or bf16 units).")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="Seconds per run before it is abandoned.")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--merge", action="store_true", help="Keep runs of the existing output not re-run now.")
    ap.add_argument("--set", dest="overrides", action="append", type=parse_override, default=[],
                    metavar="KEY=VALUE", help="Override a LightTEAConfig field in every run (repeatable); needs "
                                              "its own --out file.")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    overrides = dict(args.overrides)
    if args.child:
        scale, search = args.child.split(":")
        rec = child(float(scale), search, args.seed, args.rounds, args.nprobe, ISA_PRECISION.get(args.isa, "auto"),
                    overrides)
        print("RESULT " + json.dumps(rec | {"isa": args.isa, "isa_env": ISA_ENV[args.isa]}), flush=True)
        return
    if overrides:
        from tea_pipeline import LightTEAConfig  # noqa: PLC0415 (the parent needs it only to check the overrides)

        flagged = {"candidate_search": "--search / --scalable-search / --exact-sizes", "rounds": "--rounds",
                   "matmul_precision": "--isa", "faiss_nprobe": "--nprobe"}
        for key in overrides.keys() & flagged.keys():
            ap.error(f"--set {key}=...: use {flagged[key]} instead (the records and the summary read those flags).")
        try:
            LightTEAConfig(**overrides)
        except (TypeError, ValueError) as err:
            ap.error(f"--set {overrides}: {err}")
        if Path(args.out).resolve() == RESULT.resolve() or args.merge:
            ap.error("--set runs are not the defaults' series: write them to their own --out file, without --merge.")
    sizes = [float(s) for s in args.sizes.split(",") if s]
    exact_sizes = [float(s) for s in args.exact_sizes.split(",") if s]
    plan = [(s, args.search) for s in sizes]
    for s in exact_sizes:  # the scalable search against the exact one at the sizes where the exact one fits
        plan += [(s, args.scalable_search), (s, "exact")]
    plan = list(dict.fromkeys(plan))
    out = Path(args.out)
    runs: list[dict] = []
    if args.merge and out.exists():
        runs = [r for r in json.loads(out.read_text()).get("runs", [])
                if (r["scale"], r["requested_search"], r.get("isa", "host")) not in {(*p, args.isa) for p in plan}]
    revision = code_revision()
    for scale, search in plan:
        started = utc_now()
        cmd = [sys.executable, __file__, "--child", f"{scale}:{search}", "--seed", str(args.seed),
               "--rounds", str(args.rounds), "--isa", args.isa]
        cmd += ["--nprobe", str(args.nprobe)] if args.nprobe else []
        cmd += [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                                  env=dict(os.environ, **ISA_ENV[args.isa]))
        except subprocess.TimeoutExpired:
            print(f"{scale:g}x {search}: abandoned after {args.timeout:.0f} s", flush=True)
            runs.append({"scale": scale, "requested_search": search, "isa": args.isa,
                         "error": f"timeout {args.timeout:.0f} s"})
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{scale:g}x {search}: failed (rc {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            runs.append({"scale": scale, "requested_search": search, "isa": args.isa, "error": proc.stderr[-500:],
                         "returncode": proc.returncode})
            continue
        rec = json.loads(line[7:])
        rec["process_wall_s"] = round(time.perf_counter() - t, 2)
        rec["measured"] = {"start": started, "end": utc_now(), "revision": revision}
        runs.append(rec)
        print(f"{scale:g}x {rec['search']:5s} {args.isa:4s} entities {rec['entities']:>9,d} "
              f"wall {rec['wall_s']:8.1f} s peak {rec['peak_rss_gb']:6.2f} GB H@1 {rec['final']['hits@1']:.4f}",
              flush=True)
    ok = [r for r in runs if "error" not in r and r.get("isa", "host") == "host"]
    avx2 = sorted((r for r in runs if "error" not in r and r.get("isa") == "avx2"), key=lambda r: r["scale"])
    exact = {r["scale"]: r for r in ok if r["requested_search"] == "exact"}
    compared = {r["scale"]: r for r in ok if r["requested_search"] == args.scalable_search}
    gaps = {f"{s:g}x": round(exact[s]["final"]["hits@1"] - compared[s]["final"]["hits@1"], 4)
            for s in exact if s in compared and compared[s]["search"] != "exact"}
    # The series of the summary: the `--search` runs. Where that is "auto" and a size has no auto run, its exact run
    # stands for it: below faiss_min_rows that is the same computation; above it, it is the run whose accuracy the
    # scalable search is measured against (the summary's `search` names which one each size ran).
    scalable = {r["scale"]: r for r in ok if r["requested_search"] == "exact"} if args.search == "auto" else {}
    scalable.update({r["scale"]: r for r in ok if r["requested_search"] == args.search})
    exponent, exp_sizes = fit_exponent(list(scalable.values()), 2, 10)
    if exponent is None:  # not enough of 2x..10x ran: fit over what did, and say so in time_exponent_sizes
        exponent, exp_sizes = fit_exponent(list(scalable.values()), 0, math.inf)
    order = sorted(scalable)
    summary = {
        "sizes": [f"{s:g}x" for s in order],
        "entities": [scalable[s]["entities"] for s in order],
        "search": [scalable[s]["search"] for s in order],
        "wall_s": [scalable[s]["wall_s"] for s in order],
        "peak_rss_gb": [scalable[s]["peak_rss_gb"] for s in order],
        "hits@1": [round(scalable[s]["final"]["hits@1"], 4) for s in order],
        "time_exponent": exponent,
        "time_exponent_sizes": [f"{s:g}x" for s in exp_sizes],
        "h1_gap_vs_exact": max(gaps.values()) if gaps else None,
        "h1_gap_by_size": gaps,
        "not_run": [f"{s:g}x" for s in sorted(set(sizes) | set(TARGET_SIZES)) if s not in scalable],
        # when and from which code each size's run came (a --merge file can mix them; older runs lack the record)
        "measured": [scalable[s].get("measured", {}).get("end") for s in order],
        "revision": [scalable[s].get("measured", {}).get("revision") for s in order],
        "avx2": {"sizes": [f"{r['scale']:g}x" for r in avx2], "search": [r["search"] for r in avx2],
                 "wall_s": [r["wall_s"] for r in avx2], "peak_rss_gb": [r["peak_rss_gb"] for r in avx2],
                 "hits@1": [round(r["final"]["hits@1"], 4) for r in avx2]},
    }
    doc = {"benchmark": "tea_scale", "date": utc_now(),
           "machine": {"cpu": cpu_info(), "python": platform.python_version(),
                       "load_average": os.getloadavg(), "memory_gb": round(os.sysconf("SC_PHYS_PAGES")
                                                                           * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)},
           "config": {"rounds": args.rounds, "seed": args.seed, "search": args.search, "nprobe": args.nprobe,
                      "overrides": overrides,
                      "proportions": "YAGO-WIKI50K: entities 49,629 / 49,222, relations 11 / 30, times 245, facts "
                                     "221,050 / 317,814 (TEA-GNN Table 1), pairs 49,172, seeds 5,000"},
           "summary": summary, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
