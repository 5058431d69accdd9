"""Probe: the exact search stage (`similarity.blocked_topk`) at 1x and 10x YAGO-WIKI50K size, this checkout
against another revision, side by side.

`LightTEA`'s default search runs `blocked_topk` on rank-256 projections of the test rows: about 44,000 rows against
44,000 at 1x, and 440,000 against 440,000 at 10x. A whole round takes minutes to hours at 10x, so this times a
slice of the left rows (``ROWS``: two blocks of the default 2,048 rows at 1x, 1,216 rows at 10x, which were 8 of the
152-row blocks before the search took its products in column tiles) against the full right side, on random unit
rows, in the two forms a round has:

- ``round1``: no mask (the first round's pseudo-seed search is the evaluation search itself);
- ``round2``: 45% of the rows masked and 45% of the columns allowed, about the open shares after round 1 at 1x
  (24,128 pseudo seeds added of 44,172 test pairs, ``bench/results/tea_scale.json``).

Each case runs in a fresh process, and the checkouts alternate, ``--repeats`` times, so both see the same machine
state. ``--compare REV`` checks out ``REV`` in a temporary git worktree for the other side; the two sides must find
the same candidates (checked on the first repeat). The process keeps glibc's default allocator policy, as
`LightTEA` does from ``reuse_freed_memory_max_entities`` entities on (10x); at 1x `LightTEA` keeps freed memory, so
the 1x figures here include page faults a real 1x run does not pay. Writes JSON (medians, IQRs, ratios, CPU model
and flags) and prints a table. Figures: bench/tea/README.md.

    python bench/tea/probe_search_stage.py --compare 3bd47bb --out bench/results/tea_search_stage_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"1x": 44_172, "10x": 439_830}  # test pairs (both sides of the search) of make_scaled_pair(1) / (10)
ROWS = {"1x": 4096, "10x": 1216}
RANK, K, OPEN = 256, 500, 0.45


def child(tree: str, size: str, form: str, rows: int) -> dict:
    """Time one `blocked_topk` call in this process, importing ``tea_pipeline`` from ``tree``."""
    sys.path.insert(0, tree)
    import torch

    from tea_pipeline.similarity import blocked_topk

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    n = SIZES[size]
    g = torch.Generator().manual_seed(0)
    right = torch.nn.functional.normalize(torch.randn(n, RANK, generator=g), dim=1)
    left = torch.nn.functional.normalize(torch.randn(rows, RANK, generator=g), dim=1)
    masked = allowed = None
    if form == "round2":
        masked = torch.rand(rows, generator=g) < OPEN
        allowed = torch.rand(n, generator=g) < OPEN
    blocked_topk(left[:8], right, K, 2048, None if masked is None else masked[:8], allowed, K)  # warm-up, kernels
    t = time.perf_counter()
    full, found_masked = blocked_topk(left, right, K, 2048, masked, allowed, K, index_dtype=torch.int32)
    seconds = time.perf_counter() - t
    digest = int(full.index[:, :10].long().sum())
    if found_masked is not None:
        digest += int(found_masked.index[:, :10].long().sum())
    return {"seconds": seconds, "rows_per_s": rows / seconds, "digest": digest}


def cpu_info() -> dict:
    model, flags = "", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    keys = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags for f in keys}}


def run_child(tree: str, size: str, form: str, rows: int) -> dict:
    cmd = [sys.executable, __file__, "--child", tree, size, form, str(rows)]
    env = dict(os.environ)
    if Path(tree) != ROOT:  # its own kernel build folder: one shared with this checkout would rebuild in turn
        env["HF_SCALE_NATIVE_CACHE"] = str(Path(tree) / ".native_cache")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"child {cmd} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default=None, help="Git revision to time against this checkout (a worktree).")
    ap.add_argument("--sizes", default="1x,10x")
    ap.add_argument("--rows", type=int, default=None, help="Left rows timed at every size (default: ROWS).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON output (default: print only).")
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tree, size, form, rows = args.child
        print(json.dumps(child(tree, size, form, int(rows))))
        return
    trees = {"this": str(ROOT)}
    tmp = None
    if args.compare:
        tmp = tempfile.mkdtemp(prefix="tea_probe_")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tmp, args.compare], check=True,
                       capture_output=True)
        trees["base"] = tmp
    try:
        cases = [(s, f) for s in args.sizes.split(",") for f in ("round1", "round2")]
        times: dict[str, dict[str, list[float]]] = {f"{s}/{f}": {t: [] for t in trees} for s, f in cases}
        digests: dict[str, dict[str, int]] = {f"{s}/{f}": {} for s, f in cases}
        for rep in range(args.repeats):
            for size, form in cases:
                order = list(trees) if rep % 2 == 0 else list(reversed(trees))
                for name in order:
                    got = run_child(trees[name], size, form, args.rows or ROWS[size])
                    times[f"{size}/{form}"][name].append(got["seconds"])
                    digests[f"{size}/{form}"].setdefault(name, got["digest"])
                    print(f"repeat {rep} {size}/{form} {name}: {got['seconds']:.2f} s", flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], capture_output=True)
    result: dict = {"probe": "tea_search_stage", "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_info(),
                    "compare": args.compare, "rows": {s: args.rows or ROWS[s] for s in args.sizes.split(",")},
                    "rank": RANK, "k": K, "open_share": OPEN,
                    "repeats": args.repeats, "cases": {}}
    print(f"{'case':12s} " + " ".join(f"{t:>18s}" for t in trees) + ("   base/this" if "base" in trees else ""))
    for case, by_tree in times.items():
        entry = {}
        for name, secs in by_tree.items():
            q = statistics.quantiles(secs, n=4) if len(secs) > 1 else [secs[0]] * 3
            entry[name] = {"median_s": statistics.median(secs), "iqr_s": q[2] - q[0], "seconds": secs,
                           "rows_per_s": (args.rows or ROWS[case.split("/")[0]]) / statistics.median(secs)}
        if "base" in entry:
            entry["speedup"] = entry["base"]["median_s"] / entry["this"]["median_s"]
            entry["same_candidates"] = len(set(digests[case].values())) == 1
        result["cases"][case] = entry
        cols = " ".join(f"{entry[t]['median_s']:8.2f} s ±{entry[t]['iqr_s']:5.2f}" for t in trees)
        extra = f"   {entry['speedup']:.2f}x same={entry['same_candidates']}" if "base" in entry else ""
        print(f"{case:12s} {cols}{extra}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
