"""Probe: would a product-quantized scan make LightTEA's quadratic candidate search cheaper at equal accuracy?

Runs LightTEA on `make_scaled_pair(scale)` with `similarity.lowrank_topk` replaced (in the engine only) by faiss's
``IndexPQFastScan``: ``PQ_M`` sub-quantizers of 4 bits over the same rank-256 principal projections, an exhaustive
scan of the codes, then ``IndexRefineFlat`` re-scores the ``PQ_KF x k`` best codes exactly in the subspace and
`similarity.rescore_topk` the leading ``rescore_top`` in full width, as `lowrank_topk` does. ``MODE=exact`` runs
the unpatched engine as the baseline. Needs faiss-cpu. Prints one JSON record; figures: bench/tea/README.md.

    MODE=exact python bench/tea/probe_pq_search.py 1
    MODE=pq PQ_M=128 python bench/tea/probe_pq_search.py 1
"""

import json
import os
import resource
import sys
import time

import faiss
import numpy as np
import torch

import tea_pipeline.engine as E  # noqa: N812
from tea_pipeline import LightTEA, LightTEAConfig
from tea_pipeline.similarity import TopK, principal_basis, project_rows, rescore_topk
from tea_pipeline.synthetic import make_scaled_pair

M = int(os.environ.get("PQ_M", 64))
KF = float(os.environ.get("PQ_KF", 1))
MODE = os.environ.get("MODE", "pq")
stats = {"pq_train_s": 0.0, "pq_add_s": 0.0, "pq_search_s": 0.0, "project_s": 0.0, "rescore_s": 0.0}


def pq_topk(left, right, k, block_rows, rank, rescore, generator, masked_rows=None, allowed_cols=None, masked_k=0,
            matmul_dtype=None, index_dtype=torch.long):
    faiss.omp_set_num_threads(torch.get_num_threads())
    t = time.perf_counter()
    basis = principal_basis(left, right, rank, generator, matmul_dtype=matmul_dtype)
    pl, pr = (project_rows(x, basis, torch.float32, block_rows, torch.float32).numpy() for x in (left, right))
    stats["project_s"] += time.perf_counter() - t
    t = time.perf_counter()
    trained = faiss.IndexPQFastScan(pr.shape[1], M, 4, faiss.METRIC_INNER_PRODUCT)
    n = len(pr)
    take = torch.randperm(n, generator=generator)[:min(n, 65536)].sort().values.numpy()
    trained.train(np.ascontiguousarray(pr[take]))
    stats["pq_train_s"] += time.perf_counter() - t

    def run(queries, cols, kk):
        t = time.perf_counter()
        base = faiss.clone_index(trained)
        idx = faiss.IndexRefineFlat(base)
        idx.k_factor = KF
        idx.add(pr if cols is None else np.ascontiguousarray(pr[cols]))
        stats["pq_add_s"] += time.perf_counter() - t
        t = time.perf_counter()
        scores = np.empty((len(queries), kk), np.float32)
        ids = np.empty((len(queries), kk), np.int64)
        for r0 in range(0, len(queries), 4096):
            scores[r0:r0 + 4096], ids[r0:r0 + 4096] = idx.search(queries[r0:r0 + 4096], kk)
        stats["pq_search_s"] += time.perf_counter() - t
        assert (ids >= 0).all()
        if cols is not None:
            ids = cols[ids]
        return TopK(torch.from_numpy(np.ascontiguousarray(scores)), torch.from_numpy(np.ascontiguousarray(ids)))

    full = run(pl, None, min(k, n))
    masked = rows = None
    if masked_rows is not None:
        cols = torch.nonzero(allowed_cols)[:, 0].numpy()
        rows = torch.nonzero(masked_rows)[:, 0]
        masked = run(np.ascontiguousarray(pl[rows.numpy()]), cols, min(masked_k, len(cols)))
    t = time.perf_counter()
    full = rescore_topk(left, right, full, rescore, inplace=True)
    if masked is not None:
        masked = rescore_topk(left, right, masked, rescore, rows=rows, inplace=True)
    stats["rescore_s"] += time.perf_counter() - t
    def conv(r):
        return None if r is None else TopK(r.values, r.index.to(index_dtype))

    return conv(full), conv(masked)


if MODE == "pq":
    E.lowrank_topk = pq_topk
torch.set_num_threads(2)
scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
t0 = time.perf_counter()
pair = make_scaled_pair(scale, seed=0)
gen = time.perf_counter() - t0
cfg = LightTEAConfig(candidate_search="exact")
res = LightTEA(cfg).fit(pair)
rec = {"mode": MODE, "M": M, "k_factor": KF, "scale": scale,
       "wall_s": round(time.perf_counter() - t0, 1), "generate_s": round(gen, 1), "final": res.final,
       "stage_s": res.timings, "pq": {k: round(v, 2) for k, v in stats.items()},
       "rounds": [r.as_dict() for r in res.rounds],
       "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
print(json.dumps(rec, default=str), flush=True)
