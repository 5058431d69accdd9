"""Sparse similarity with temporal constraints (reference: ``alignment.sparse_sims`` and ``cal_simt``).

The structural similarity is an exact top-k inner product search done in row blocks (no |P| x |P| matrix is ever
held); the temporal similarity (multiset Dice of the entities' time stamps) is computed only for those top-k
candidate pairs, which is all the reference ever reads from its dense |P| x |P| ``simt`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import csr_entries, dice_candidates, gathered_dot, topk_merge_


def work_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype scores of ``x``'s rows are computed and returned in: fp32 for fp16 storage (CPUs multiply fp16
    slowly), else ``x``'s own."""
    return torch.float32 if x.dtype == torch.float16 else x.dtype


def project_rows(x: torch.Tensor, basis: torch.Tensor, dtype: torch.dtype, block: int = 16384,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ basis`` with both operands in ``dtype``, ``block`` rows at a time (no full-width converted copy of
    ``x``); the result is in ``out_dtype`` (default ``dtype``), written block by block."""
    b = basis.to(dtype)
    out = torch.empty(x.shape[0], basis.shape[1], dtype=out_dtype or dtype, device=x.device)
    for r0 in range(0, x.shape[0], block):
        rows = x[r0:r0 + block].to(dtype)
        if out.dtype == dtype:
            torch.matmul(rows, b, out=out[r0:r0 + block])
        else:
            out[r0:r0 + block] = rows @ b
    return out


def quantize_rows(x: torch.Tensor, block: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows of ``x`` and their fp32 scales: ``x[i] ~= q[i] * scale[i]``, each row's largest magnitude
    mapped to 127 (a zero row gets scale 1 and stays zero). Converted ``block`` rows at a time."""
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for r0 in range(0, x.shape[0], block):
        rows = x[r0:r0 + block].float()
        s = rows.abs().amax(dim=1).div_(127.0)
        s[s == 0] = 1.0
        q[r0:r0 + block] = (rows / s[:, None]).round_().clamp_(-127, 127)  # not in place: rows may be x itself
        scale[r0:r0 + block] = s
    return q, scale


SCORE_BLOCK_BYTES = 1 << 28  # most bytes of scores one tile of `blocked_topk` holds


@dataclass
class TopK:
    values: torch.Tensor  # rows x k
    index: torch.Tensor  # rows x k, positions into the candidate (right) list


def score_tiles(rows: int, cols: int, block_rows: int, block_bytes: int, score_bytes: int) -> tuple[int, int]:
    """(rows, columns) of `blocked_topk`'s score tile: ``block_rows`` rows (at most ``rows``), and the columns split
    into equal tiles of at most ``block_bytes`` of scores (one tile of every column when they fit)."""
    tile_rows = max(1, min(block_rows, rows))
    most = max(1, block_bytes // (tile_rows * score_bytes))
    tiles = max(1, -(-cols // most))
    return tile_rows, max(1, -(-cols // tiles))


def blocked_topk(left: torch.Tensor, right: torch.Tensor, k: int, block_rows: int,
                 masked_rows: torch.Tensor | None = None, allowed_cols: torch.Tensor | None = None,
                 masked_k: int = 0, matmul_dtype: torch.dtype | None = None,
                 block_bytes: int = SCORE_BLOCK_BYTES,
                 index_dtype: torch.dtype = torch.long) -> tuple[TopK, TopK | None]:
    """Exact top-k of ``left @ right.T`` per row, in blocks of ``block_rows`` rows.

    A block's scores are computed in column tiles of at most ``block_bytes`` (`score_tiles`), each merged into the
    block's running top-k lists (`kernels.topk_merge_`) before the next is computed: the score tile is the search's
    largest temporary, and at a million entities 2,048 full rows of scores are gigabytes. Splitting the columns, not
    the rows, keeps the product's shape at any size: a product of a few hundred rows runs markedly slower than one
    of 2,048 (bench/tea/README.md), and once a row holds k candidates, a later tile costs its merge one comparison
    per score. The tile is allocated once and written in place: a fresh tile of hundreds of megabytes per product
    would fault its pages in again each time when freed memory goes back to the OS
    (`LightTEAConfig.reuse_freed_memory_max_entities`). Each row's result depends on its own scores only; only the
    BLAS's summation order may differ with the tile's shape (fp32 rounding).

    With ``masked_rows`` (bool, rows) and ``allowed_cols`` (bool, columns), the same tiles also give the
    top-``masked_k`` of the masked rows over the allowed columns only, so the pseudo-seed search of a round costs no
    second matrix product. With ``matmul_dtype`` (e.g. bf16) the products and the top-k selection run in that
    dtype (exact only up to its rounding; the returned values are in `work_dtype` of ``left``: its own dtype, fp32
    for fp16 storage). With ``torch.int8`` both sides are quantized per row (`quantize_rows`), the products
    accumulate in int32 (``torch._int_mm``) and are scaled back to fp32 before the selection: the right rows' scales
    per column first, the left row's scale, which does not change a row's order, only on the selected values.

    ``index_dtype`` is the dtype of the returned indices: ``torch.int32`` halves them (at a million entities and
    ``k = 500`` the two results' int64 indices are the search's largest allocations next to the features).
    """
    if index_dtype not in (torch.int32, torch.long) or (index_dtype == torch.int32 and right.shape[0] >= 2**31):
        raise ValueError(f"index_dtype={index_dtype} for {right.shape[0]} columns: use torch.long, or torch.int32 "
                         "below 2**31 columns.")
    out_dtype = work_dtype(left)
    if matmul_dtype is None and left.dtype != out_dtype:  # fp16 storage: multiply in fp32
        matmul_dtype = out_dtype
    quantized = matmul_dtype == torch.int8
    if quantized:
        (left, left_scale), (right, right_scale) = quantize_rows(left), quantize_rows(right)
    elif matmul_dtype is not None and matmul_dtype != left.dtype:
        left, right = left.to(matmul_dtype), right.to(matmul_dtype)
    n, cols = left.shape[0], right.shape[0]
    k = min(k, cols)
    dev = left.device
    vals = torch.empty(n, k, dtype=out_dtype, device=dev)
    idx = torch.empty(n, k, dtype=index_dtype, device=dev)
    want_masked = masked_rows is not None
    if want_masked:
        masked_pos = torch.full((n,), -1, dtype=torch.long, device=dev)
        n_masked = int(masked_rows.sum())
        masked_pos[masked_rows] = torch.arange(n_masked, device=dev)
        masked_k = min(masked_k, int(allowed_cols.sum()))
        mvals = torch.empty(n_masked, masked_k, dtype=out_dtype, device=dev)
        midx = torch.empty(n_masked, masked_k, dtype=index_dtype, device=dev)
        allowed = allowed_cols.to(torch.bool).contiguous()
    score_dtype = torch.float32 if quantized else right.dtype
    tile_rows, tile_cols = score_tiles(n, cols, block_rows, block_bytes, torch.finfo(score_dtype).bits // 8)
    scores = torch.empty(tile_rows, tile_cols, dtype=score_dtype, device=dev)
    # the running lists of one block: fp32 values (the native merge's; fp64 scores keep fp64), int64 columns
    run_dtype = torch.float64 if score_dtype == torch.float64 else torch.float32
    run_v = torch.empty(tile_rows, k, dtype=run_dtype, device=dev)
    run_i = torch.empty(tile_rows, k, dtype=torch.long, device=dev)
    for r0 in range(0, n, tile_rows):
        r1 = min(r0 + tile_rows, n)
        bv, bi = run_v[: r1 - r0].fill_(float("-inf")), run_i[: r1 - r0].fill_(-1)
        if want_masked:
            sel = masked_rows[r0:r1]
            picked = torch.nonzero(sel)[:, 0]
            mv = torch.full((len(picked), masked_k), float("-inf"), dtype=run_dtype, device=dev)
            mi = torch.full((len(picked), masked_k), -1, dtype=torch.long, device=dev)
        for c0 in range(0, cols, tile_cols):
            c1 = min(c0 + tile_cols, cols)
            # a contiguous view of the buffer, also for a short last block or the narrower last tile
            sims = scores.view(-1)[: (r1 - r0) * (c1 - c0)].view(r1 - r0, c1 - c0)
            if quantized:
                torch.mul(torch._int_mm(left[r0:r1], right[c0:c1].T), right_scale[c0:c1], out=sims)
            else:
                torch.mm(left[r0:r1], right[c0:c1].T, out=sims)
            if k:
                topk_merge_(sims, c0, bv, bi)
            if want_masked and len(picked) and masked_k:
                topk_merge_(sims, c0, mv, mi, rows=picked, allowed=allowed)
        if quantized:
            bv.mul_(left_scale[r0:r1, None])
        vals[r0:r1], idx[r0:r1] = bv, bi
        if want_masked and len(picked):
            if quantized:
                mv.mul_(left_scale[r0:r1][picked][:, None])
            pos = masked_pos[r0:r1][picked]
            mvals[pos], midx[pos] = mv.to(out_dtype), mi.to(index_dtype)
    return TopK(vals, idx), (TopK(mvals, midx) if want_masked else None)


class TemporalSimilarity:
    """Multiset Dice of time stamps, ``2 * sum_tau min(c1[tau], c2[tau]) / (|c1| + |c2|)`` (0 when both empty).

    ``counts`` is the N x T sparse count matrix of `graph.time_counts`; ``right_entities`` are the candidate
    entities (the positions used by `TopK.index`), whose rows are kept dense so that each left row's few non-zeros
    are looked up for all its k candidates at once.
    """

    def __init__(self, counts: torch.Tensor, right_entities: torch.Tensor) -> None:
        counts = counts.coalesce()
        rows, self.col = counts.indices()
        self.val = counts.values()
        n = counts.shape[0]
        self.crow = torch.zeros(n + 1, dtype=torch.long, device=rows.device)
        self.crow[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
        self.totals = torch.zeros(n, device=self.val.device).index_add_(0, rows, self.val)
        self.num_times = counts.shape[1]
        row, taus, cnts = self._entries(right_entities)
        self.right_dense = torch.zeros(len(right_entities), self.num_times, device=self.val.device)
        self.right_dense[row, taus] = cnts
        self.right_totals = self.totals[right_entities]

    def _entries(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(local row, time id, count) of the non-zeros of the given CSR rows."""
        return csr_entries(self.crow, self.col, self.val, rows)

    def __call__(self, left_entities: torch.Tensor, candidates: torch.Tensor,
                 max_entries: int = 1 << 22) -> torch.Tensor:
        """Dice of ``left_entities[i]`` (entity ids) against right positions ``candidates[i, :]``: rows x k.

        Each left row's few non-zeros are looked up in its candidates' dense rows (`kernels.dice_candidates`).
        """
        return dice_candidates(self.crow, self.col, self.val, self.totals, left_entities, candidates,
                               self.right_dense, self.right_totals, max_entries)


def principal_basis(left: torch.Tensor, right: torch.Tensor, rank: int, generator: torch.Generator,
                    sample_rows: int = 2048, iterations: int = 3,
                    matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Orthonormal ``D x rank`` basis of the leading principal directions of the (uncentred) rows of both sides.

    Estimated from a seeded sample of ``sample_rows`` rows of each side by randomized subspace iteration on their
    ``D x D`` Gram matrix (no full eigendecomposition), so it costs a few ``D x D x rank`` products. With
    ``matmul_dtype`` the Gram product (the one large product here) takes inputs in that dtype.
    """
    dim = left.shape[1]
    work = work_dtype(left)
    if rank >= dim:
        return torch.eye(dim, dtype=work, device=left.device)
    picks = []
    for side in (left, right):
        n = side.shape[0]
        take = torch.randperm(n, generator=generator)[: min(n, sample_rows)].to(side.device)
        picks.append(side[take])
    sample = torch.cat(picks).to(matmul_dtype or work)
    gram = (sample.T @ sample).to(work)
    width = min(dim, rank + 16)
    basis = torch.linalg.qr(gram @ torch.randn(dim, width, generator=generator).to(gram)).Q
    for _ in range(iterations):
        basis = torch.linalg.qr(gram @ basis).Q
    evals, evecs = torch.linalg.eigh(basis.T @ gram @ basis)
    top = torch.argsort(evals, descending=True)[:rank]
    return (basis @ evecs[:, top]).contiguous()


def exact_scores(left: torch.Tensor, right: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None,
                 gather_rows: int = 512) -> torch.Tensor:
    """``left[rows[i]] . right[index[i, c]]`` in the full space (rows default: all), see `kernels.gathered_dot`.

    The gather is memory-bound: ``right`` may be stored in a narrower dtype (fp16 halves the bytes); its rows are
    widened to ``left``'s dtype for the product, so only ``right``'s storage rounding enters the scores. The PyTorch
    path gathers about ``gather_rows`` candidate rows at a time (larger chunks fall out of cache and run several
    times slower, see bench/tea/README.md).
    """
    return gathered_dot(left, right, index, rows, gather_rows)


def rescore_topk(left: torch.Tensor, right: torch.Tensor, approx: TopK, rescore: int,
                 rows: torch.Tensor | None = None, keep: torch.Tensor | None = None, inplace: bool = False,
                 chunk_rows: int = 16384) -> TopK:
    """Replace the scores of each row's first ``rescore`` candidates by their exact values and re-sort the row.

    The candidates (index set) are those of ``approx``; only the scores of the leading ones, which carry almost all
    of the Sinkhorn mass at a low temperature, are recomputed in the full space. ``keep`` (bool, like the leading
    ``rescore`` columns) marks candidates whose approximate score stays (padding). Rows are re-scored and re-sorted
    ``chunk_rows`` at a time, so the sort's order and the gathered index exist for one chunk only instead of as
    full-height int64 copies; with ``inplace`` the result is written into ``approx``'s own tensors (the caller's
    fresh search result), otherwise into copies.
    """
    m = min(rescore, approx.values.shape[1])
    if m == 0:
        return approx
    values, index = (approx.values, approx.index) if inplace else (approx.values.clone(), approx.index.clone())
    n = values.shape[0]
    for r0 in range(0, n, chunk_rows):
        part = slice(r0, min(r0 + chunk_rows, n))
        left_rows = torch.arange(part.start, part.stop, device=index.device) if rows is None else rows[part]
        exact = exact_scores(left, right, index[part, :m].to(torch.long, memory_format=torch.contiguous_format),
                             left_rows)
        if keep is not None:
            exact = torch.where(keep[part, :m], values[part, :m], exact)
        values[part, :m] = exact
        sorted_values, order = torch.sort(values[part], dim=1, descending=True, stable=True)
        values[part] = sorted_values
        index[part] = index[part].gather(1, order)
    return TopK(values, index)


def lowrank_topk(left: torch.Tensor, right: torch.Tensor, k: int, block_rows: int, rank: int, rescore: int,
                 generator: torch.Generator, masked_rows: torch.Tensor | None = None,
                 allowed_cols: torch.Tensor | None = None, masked_k: int = 0,
                 matmul_dtype: torch.dtype | None = None,
                 index_dtype: torch.dtype = torch.long) -> tuple[TopK, TopK | None]:
    """Top-k candidates found in a rank-``rank`` principal subspace, leading ``rescore`` re-scored in full width.

    Same interface as `blocked_topk`, whose search it runs on the projected features: the block products then cost
    ``rank / D`` of the full ones. With ``rank >= D`` and ``rescore >= k`` the result equals `blocked_topk` up to
    floating-point rounding. ``matmul_dtype`` (e.g. bf16) is used for the projections and the search; the
    re-scoring then reads the candidate rows stored as fp16 (the gather is memory-bound, so half the bytes; on
    unit-norm features the rounding error this adds to a score is small next to the Sinkhorn temperature, see
    bench/tea/README.md) and computes in ``left``'s dtype. With ``torch.int8`` the basis and the projections are
    fp32 and only the search products are quantized (see `blocked_topk`). Features stored in fp16
    (`LightTEAConfig.feature_dtype`) are projected a block of rows at a time, re-scored as stored, and scored in fp32.
    ``index_dtype`` as in `blocked_topk`.
    """
    quantized = matmul_dtype == torch.int8
    basis = principal_basis(left, right, rank, generator, matmul_dtype=None if quantized else matmul_dtype)
    work = work_dtype(left)
    low = matmul_dtype is not None and matmul_dtype != left.dtype and matmul_dtype != work
    proj_dtype = work if quantized else (matmul_dtype or work)
    pl, pr = (project_rows(x, basis, proj_dtype, block_rows) for x in (left, right))
    full, masked = blocked_topk(pl, pr, k, block_rows, masked_rows, allowed_cols, masked_k,
                                matmul_dtype=torch.int8 if quantized else None, index_dtype=index_dtype)
    del pl, pr
    # the search's values come back in the projection dtype; re-scoring and Sinkhorn work in fp32 (or left's dtype)
    full = TopK(full.values.to(work), full.index)
    if masked is not None:
        masked = TopK(masked.values.to(work), masked.index)
    stored = right.to(torch.float16) if low and rescore > 0 else right
    # both results are this call's own tensors: re-scored in place
    full = rescore_topk(left, stored, full, rescore, inplace=True)
    if masked is not None:
        masked = rescore_topk(left, stored, masked, rescore, rows=torch.nonzero(masked_rows)[:, 0], inplace=True)
    return full, masked


def candidate_recall(left: torch.Tensor, right: torch.Tensor, found: TopK, rows: torch.Tensor,
                     allowed_cols: torch.Tensor | None = None) -> dict[str, float]:
    """How well ``found`` (candidates of all rows) matches the exact top-k on the sampled ``rows``.

    With ``allowed_cols`` (bool) the exact top-k is taken over those columns only, as the search was.
    ``recall`` is the share of the exact top-k (index set) that ``found`` holds, ``top1`` the share of rows whose
    best-scored candidate is the exact best, ``same_set`` the share of rows whose candidate set is exactly the
    exact top-k.
    """
    k = found.index.shape[1]
    work = work_dtype(left)
    sims = left[rows].to(work) @ right.to(work).T
    if allowed_cols is not None:
        sims[:, ~allowed_cols] = float("-inf")
    exact = torch.topk(sims, k, dim=1)
    hit = (exact.indices[:, :, None] == found.index[rows][:, None, :]).any(dim=2)
    return {"recall": hit.float().mean().item(), "top1": (found.index[rows, 0] == exact.indices[:, 0]).float().mean()
            .item(), "same_set": hit.all(dim=1).float().mean().item(), "rows": len(rows)}
