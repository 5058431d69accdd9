"""Approximate candidate search with faiss (optional): an inverted-file index over the principal subspace.

`ivf_topk` has the interface of `similarity.lowrank_topk` and the same three steps, with the exact blocked search of
the middle step replaced by faiss's ``IndexIVFFlat`` (inner product): the right rows are clustered into ``nlist``
lists by k-means, and each left row scans only the ``nprobe`` lists whose centroids score best. Its cost per row grows
with ``nlist + nprobe * n / nlist`` instead of ``n``, so the search is no longer quadratic in the entities. The leading
``rescore`` candidates are re-scored in full width as before. faiss is optional (``pip install
hf-scale-plugins[scale]``): `faiss_available` says whether it imports, and the engine falls back to the exact
PyTorch search when it does not.

Inverted lists partition the space by k-means, so they find a row's best match only when it falls in one of the
``nprobe`` lists whose centroids score best for that row; on features without cluster structure that needs a large
share of the lists. Set ``LightTEAConfig.candidate_check_rows`` to measure the recall on your data; the figures
measured on the synthetic YAGO-WIKI50K-sized pairs are in bench/tea/README.md ("Scale").
"""

from __future__ import annotations

import math
from importlib import import_module
from types import ModuleType

import numpy as np
import torch

from .similarity import TopK, principal_basis, project_rows, rescore_topk, work_dtype

__all__ = ["default_nlist", "faiss_available", "ivf_topk"]

PAD_SCORE = -2.0  # below any inner product of unit rows: a padded candidate takes no Sinkhorn mass


def _faiss() -> ModuleType | None:
    try:
        return import_module("faiss")
    except ImportError:
        return None


def faiss_available() -> bool:
    """Whether ``import faiss`` works (faiss-cpu or faiss-gpu installed)."""
    return _faiss() is not None


def default_nlist(n: int) -> int:
    """Inverted lists for ``n`` indexed rows: about ``4 sqrt(n)``, with at least ~40 rows per list to train on."""
    return max(1, min(int(4 * math.sqrt(n)), n // 40))


def _search(index, queries: np.ndarray, k: int, block: int) -> tuple[TopK, torch.Tensor]:
    values = np.empty((len(queries), k), dtype=np.float32)
    ids = np.empty((len(queries), k), dtype=np.int64)
    for r0 in range(0, len(queries), block):
        values[r0:r0 + block], ids[r0:r0 + block] = index.search(queries[r0:r0 + block], k)
    # A row whose probed lists hold fewer than k rows gets -1 ids: point them at the row's best candidate with a score
    # that takes no Sinkhorn mass, so every index stays valid.
    missing = ids < 0
    if missing.any():
        ids = np.where(missing, ids[:, :1], ids)
        values[missing] = PAD_SCORE
    return TopK(torch.from_numpy(values), torch.from_numpy(ids)), torch.from_numpy(missing)


def _rescore(left: torch.Tensor, right: torch.Tensor, top: TopK, missing: torch.Tensor, rescore: int,
             rows: torch.Tensor | None = None) -> TopK:
    """`similarity.rescore_topk` that leaves padded candidates (``missing``) at `PAD_SCORE`."""
    # the search result is this call's own (from faiss's numpy output): re-scored in place
    return rescore_topk(left, right, TopK(top.values.to(work_dtype(left)), top.index), rescore, rows, keep=missing,
                        inplace=True)


def ivf_topk(left: torch.Tensor, right: torch.Tensor, k: int, block_rows: int, rank: int | None, rescore: int,
             generator: torch.Generator, masked_rows: torch.Tensor | None = None,
             allowed_cols: torch.Tensor | None = None, masked_k: int = 0, matmul_dtype: torch.dtype | None = None,
             nlist: int | None = None, nprobe: int = 32) -> tuple[TopK, TopK | None]:
    """Top-k candidates of ``left @ right.T`` from a faiss IVF index over the rank-``rank`` principal subspace.

    Same interface and result layout as `similarity.lowrank_topk` (``rank=None``: the full width is indexed). The
    masked search (``masked_rows`` over ``allowed_cols`` only, for pseudo seeds) uses a second index over the
    allowed columns that shares the trained centroids. ``nlist`` defaults to `default_nlist`; ``nprobe`` lists are
    scanned per row (more: closer to exact, slower). k-means training uses a seeded sample of the right rows, so
    results are reproducible for a fixed faiss build and thread count. Raises ImportError when faiss is missing.
    """
    faiss = _faiss()
    if faiss is None:
        raise ImportError("ivf_topk needs faiss: pip install 'hf-scale-plugins[scale]' (or faiss-cpu).")
    device = left.device  # faiss-cpu searches host memory; the result goes back to the caller's device
    if device.type != "cpu":
        left, right = left.cpu(), right.cpu()
        masked_rows = None if masked_rows is None else masked_rows.cpu()
        allowed_cols = None if allowed_cols is None else allowed_cols.cpu()
    faiss.omp_set_num_threads(torch.get_num_threads())
    dim = left.shape[1]
    low = matmul_dtype is not None and matmul_dtype != left.dtype
    if rank is not None and rank < dim:
        basis = principal_basis(left, right, rank, generator, matmul_dtype=matmul_dtype)
    else:
        basis = torch.eye(dim, dtype=work_dtype(left))
    # faiss reads contiguous fp32 numpy rows
    pl, pr = (project_rows(x, basis, matmul_dtype if low else basis.dtype, block_rows, torch.float32).cpu().numpy()
              for x in (left, right))
    n_right, width = pr.shape
    k = min(k, n_right)
    nlist = min(nlist or default_nlist(n_right), n_right)
    quantizer = faiss.IndexFlatIP(width)
    index = faiss.IndexIVFFlat(quantizer, width, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = int(torch.randint(0, 2**30, (1,), generator=generator))
    sample = min(n_right, 64 * nlist)
    take = torch.randperm(n_right, generator=generator)[:sample].sort().values.numpy()
    index.cp.max_points_per_centroid = max(1, math.ceil(sample / nlist))  # train on exactly our seeded sample
    index.train(np.ascontiguousarray(pr[take]))
    index.add(pr)
    index.nprobe = min(nprobe, nlist)
    full, full_missing = _search(index, pl, k, block_rows)
    masked = None
    if masked_rows is not None:
        cols = torch.nonzero(allowed_cols)[:, 0].numpy()
        masked_k = min(masked_k, len(cols))
        sub = faiss.IndexIVFFlat(quantizer, width, nlist, faiss.METRIC_INNER_PRODUCT)
        sub.add_with_ids(np.ascontiguousarray(pr[cols]), cols.astype(np.int64))
        sub.nprobe = index.nprobe
        queries = np.ascontiguousarray(pl[torch.nonzero(masked_rows)[:, 0].numpy()])
        masked, masked_missing = _search(sub, queries, masked_k, block_rows)
        del sub
    del index, pl, pr
    stored = right.to(torch.float16) if low and rescore > 0 else right
    full = _rescore(left, stored, full, full_missing, rescore)
    if masked is not None:
        masked = _rescore(left, stored, masked, masked_missing, rescore, rows=torch.nonzero(masked_rows)[:, 0])
    if device.type != "cpu":
        full = TopK(full.values.to(device), full.index.to(device))
        masked = None if masked is None else TopK(masked.values.to(device), masked.index.to(device))
    return full, masked
