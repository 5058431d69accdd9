"""Probe: how fast is the exact search's block product at 10x size for each score-block height?

At 10x YAGO-WIKI50K size the right side has about 440,000 rows, so a 256 MiB score block
(`similarity.SCORE_BLOCK_BYTES`) holds only 152 rows of ``left @ right.T`` (rank 256). This times the product for
152, 379 (the 4x block), 610 and 1,220 rows on random data, interleaved, 5 repeats, and prints GFLOP/s medians and
IQRs. Figures: bench/tea/README.md.

    python bench/tea/probe_score_block.py
"""

import statistics
import time

import torch

torch.set_num_threads(2)
n, d = 439_830, 256
g = torch.Generator().manual_seed(0)
right = torch.randn(n, d, generator=g)
left = torch.randn(4096, d, generator=g)
rates: dict[int, list[float]] = {152: [], 379: [], 610: [], 1220: []}
for _ in range(5):
    for rows, got in rates.items():
        reps = max(1, 1220 // rows)
        t = time.perf_counter()
        for j in range(reps):
            scores = left[j * rows:(j + 1) * rows] @ right.T
        got.append(rows * n * d * 2 / ((time.perf_counter() - t) / reps) / 1e9)
        del scores
for rows, got in rates.items():
    q = statistics.quantiles(got, n=4)
    print(f"{rows:5d} rows ({rows * n * 4 / 2**20:6.0f} MiB): median {statistics.median(got):5.1f} GFLOP/s, "
          f"IQR {q[2] - q[0]:.1f}")
