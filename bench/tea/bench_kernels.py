"""Benchmark: each native kernel of csrc/tea_kernels.cpp against its PyTorch path, at YAGO-WIKI20K's shapes.

Usage: ``python bench/tea/bench_kernels.py [--threads 2] [--repeats 5] [--output bench/results/tea_kernels.json]``.

The inputs are generated with the shapes one LightTEA round has on YAGO-WIKI20K with 400 seeds (38,124 output rows,
329,968 tuples over 34,994 tails, 170 projections of width 16; 19,062 test pairs, 2,720-wide features, 64 re-scored
candidates per row; 2,048-row blocks of a 19,062-column score matrix, top 500; 500 candidates per row in Sinkhorn
and in the Dice of about 6 time stamps per entity out of 400; and, for the search's column tiles, one later
31,417-column tile of a 10x-size search merged into 2,048 lists of 500; and one pass of the triple view's sums at
4x YAGO-WIKI50K size with the default widths, native with its row prefetch 4 tuples ahead and without (the default):
``summary``'s ``segment_sum_prefetch_gain_4x``), so the figures are per call of the stage each kernel replaces.
Both paths run alternately ``--repeats`` times in one process; the table gives medians, IQRs and the speed-up, and
the JSON records the CPU model and flags and whether the kernels were native.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402
from tea_pipeline.kernels import (  # noqa: E402
    dice_candidates,
    gathered_dot,
    native_kernels,
    sinkhorn_,
    topk_merge_,
    topk_rows,
    weighted_segment_sum,
)


def _segment_sum_operands(gen: torch.Generator, n_out: int, tails: int, tuples: int, d: int, m: int) -> tuple:
    """``(crow, col, w, z, m, out)`` of one `weighted_segment_sum` call: ``tuples`` spread at random over ``n_out``
    output rows, each naming a random one of ``tails`` rows of ``z`` (``d`` projections of width ``m``)."""
    degrees = torch.multinomial(torch.ones(n_out), tuples, replacement=True, generator=gen).bincount(minlength=n_out)
    crow = torch.zeros(n_out + 1, dtype=torch.long)
    crow[1:] = degrees.cumsum(0)
    col = torch.randint(0, tails, (tuples,), generator=gen)
    w = torch.randn(tuples, d, generator=gen)
    z = torch.randn(tails, d * m, generator=gen)
    return crow, col, w, z, m, torch.empty(n_out, d * m)


def _cases(gen: torch.Generator) -> dict:
    sums_20k = _segment_sum_operands(gen, 38_124, 34_994, 329_968, 170, 16)
    n, width = 19_062, 2_720
    left = torch.nn.functional.normalize(torch.randn(n, width, generator=gen), dim=1)
    right = torch.nn.functional.normalize(torch.randn(n, width, generator=gen), dim=1)
    index = torch.randint(0, n, (n, 64), generator=gen)
    sims = torch.randn(2_048, 512, generator=gen) @ torch.randn(512, n, generator=gen)
    cand = torch.randint(0, n, (n, 500), generator=gen)
    weights = torch.exp(torch.rand(n, 500, generator=gen) / 0.02)
    times, entities = 400, 2 * n
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        counts = ((torch.rand(entities, times, generator=gen) < 6 / times).float()).to_sparse_csr()
    crow_t, col_t, val_t = counts.crow_indices(), counts.col_indices(), counts.values()
    totals = counts.to_dense().sum(1)
    right_dense = counts.to_dense()[n:].contiguous()
    left_ids = torch.arange(n)
    # the exact search at 10x YAGO-WIKI50K size: 2,048-row blocks over 439,830 columns in 14 tiles of 31,417 (256 MiB);
    # a later tile merged into lists already holding 500 candidates
    tile_cols = 31_417
    tile_a = torch.randn(2_048, 256, generator=gen) @ torch.randn(256, 2 * tile_cols, generator=gen)
    held_v, held_i = topk_rows(tile_a[:, :tile_cols], 500)
    tile_b = tile_a[:, tile_cols:].contiguous()
    tile_b16 = tile_b.bfloat16()  # the same tile from a bf16 search (matmul_precision bf16: CPUs with bf16 units)
    # one pass of the triple view's sums at 4x YAGO-WIKI50K size with the default widths: 3,853,631 tuples over
    # 393,726 tails into 353,376 rows, a block of 10 projections of width 8 (z is 126 MB: its rows come from memory)
    sums_4x = _segment_sum_operands(gen, 353_376, 393_726, 3_853_631, 10, 8)

    def merge_later_tile(native: bool) -> None:
        topk_merge_(tile_b, tile_cols, held_v.clone(), held_i.clone(), native=native)

    def merge_later_bf16_tile(native: bool) -> None:
        topk_merge_(tile_b16, tile_cols, held_v.clone(), held_i.clone(), native=native)

    return {
        "triple_view_sums (weighted_segment_sum)": lambda native: weighted_segment_sum(*sums_20k, native=native),
        "triple_view_sums, one 4x-size pass (weighted_segment_sum)": lambda native: weighted_segment_sum(
            *sums_4x, native=native, prefetch=4),
        "the same pass, native without prefetch": lambda native: weighted_segment_sum(*sums_4x, native=native,
                                                                                      prefetch=0),
        "rescore fp32 rows (gathered_dot)": lambda native: gathered_dot(left, right, index, native=native),
        "rescore fp16 rows (gathered_dot)": lambda native: gathered_dot(left, right.half(), index, native=native),
        "top-500 of a 2048-row block (topk_rows)": lambda native: topk_rows(sims, 500, native=native),
        "a later 31,417-column tile into 2048 top-500 lists (topk_merge_)": merge_later_tile,
        "the same tile in bf16 (topk_merge_)": merge_later_bf16_tile,
        "Sinkhorn, 15 iterations (sinkhorn_)": lambda native: sinkhorn_(weights.clone(), cand, n, 15, native=native),
        "time-stamp Dice of 500 candidates (dice_candidates)": lambda native: dice_candidates(
            crow_t, col_t, val_t, totals, left_ids, cand, right_dense, totals[n:], native=native),
    }


def _quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "iqr": round(q[2] - q[0], 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "tea_kernels.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = native_kernels()["tea_kernels"]
    if path != "native":
        print(f"native kernels unavailable ({path}); nothing to compare", file=sys.stderr)
        return 2
    rows = {}
    for name, run in _cases(torch.Generator().manual_seed(0)).items():
        run(True), run(False)  # warm-up: page faults, thread pools
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for native in (True, False):
                t0 = time.perf_counter()
                run(native)
                times[native].append(time.perf_counter() - t0)
        ours, torch_path = _quartiles(times[True]), _quartiles(times[False])
        rows[name] = {"native_s": ours, "pytorch_s": torch_path,
                      "speedup": round(torch_path["median"] / ours["median"], 2),
                      "iqr_overlap": not (ours["q3"] < torch_path["q1"] or torch_path["q3"] < ours["q1"])}
    pf, no_pf = (rows["triple_view_sums, one 4x-size pass (weighted_segment_sum)"],
                 rows["the same pass, native without prefetch"])
    record = {"benchmark": "tea_pipeline native kernels vs PyTorch paths (per call; YAGO-WIKI20K shapes "
                           "unless a line names another size)",
              "summary": {"speedup": {k: v["speedup"] for k, v in rows.items()},
                          "all_at_least_1_5x": all(v["speedup"] >= 1.5 for v in rows.values()),
                          # the row prefetch of weighted_segment_sum: the same kernel with it off / on
                          "segment_sum_prefetch_gain_4x": round(no_pf["native_s"]["median"]
                                                                / pf["native_s"]["median"], 2)},
              "kernels": rows, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "machine": {"cpu": cpu_info(), "torch": torch.__version__}}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'stage (kernel)':<52} | {'native s':>14} | {'PyTorch s':>14} | speed-up")
    for name, row in rows.items():
        n, p = row["native_s"], row["pytorch_s"]
        print(f"{name:<52} | {n['median']:7.3f} ±{n['iqr']:5.3f} | {p['median']:7.3f} ±{p['iqr']:5.3f} | "
              f"{row['speedup']:5.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
