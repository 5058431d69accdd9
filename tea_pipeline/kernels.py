"""The inner loops of a LightTEA round, each with a native kernel (``csrc/tea_kernels.cpp``) and a PyTorch path.

Why native: a profile of the fp32 path on CPUs without bf16 units showed these loops spending most of their time
on memory traffic that PyTorch's building blocks cannot avoid (one CSR product per triple-view projection, a
gathered copy of every candidate row before its dot product, a full sort network per top-k row, three passes and
a scatter per Sinkhorn iteration, an entries x k gather for the time-stamp Dice). The kernels do the same
arithmetic in one pass each; ``bench/tea/README.md`` has the per-stage measurements.

The native path is used for CPU tensors when ``csrc`` builds (see `csrc.load`; ``HF_SCALE_NATIVE=0`` forces the
PyTorch path everywhere); CUDA tensors always take the PyTorch path. Both paths return the same values up to
fp32 summation order (top-k: identical values; among equal values the native kernel lists lower columns first).
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

__all__ = ["csr_entries", "dice_candidates", "gathered_dot", "native_kernels", "sinkhorn_", "topk_merge_",
           "topk_rows", "weighted_segment_sum"]

_KERNEL = "tea_kernels"


def _native(*tensors: torch.Tensor) -> ModuleType | None:
    if any(t.device.type != "cpu" for t in tensors):
        return None
    try:
        import csrc  # noqa: PLC0415
    except ImportError:  # an install without the kernels package: PyTorch paths only
        return None
    return csrc.load(_KERNEL)


def native_kernels() -> dict[str, str]:
    """Which path the kernels take in this process: ``{"tea_kernels": "native" | "fallback: <reason>"}``."""
    try:
        import csrc  # noqa: PLC0415
    except ImportError:
        return {_KERNEL: "fallback: the csrc package is not installed"}
    csrc.load(_KERNEL)
    return {_KERNEL: csrc.status().get(_KERNEL, "not loaded")}


def weighted_segment_sum(crow: torch.Tensor, col: torch.Tensor, w: torch.Tensor, z: torch.Tensor, m: int,
                         out: torch.Tensor, native: bool = True, prefetch: int = 0) -> torch.Tensor:
    """``out[h, j*m:(j+1)*m] = sum_{q in crow[h]:crow[h+1]} w[q, j] * z[col[q], j*m:(j+1)*m]``, written into ``out``.

    ``crow`` / ``col`` are a CSR pattern (n x rows of ``z``) shared by all ``D = w.shape[1]`` projections; ``z`` is
    ``rows x D*m``; ``out`` is ``n x D*m`` (any row stride, e.g. a column block of a wider matrix).

    ``prefetch`` (native kernel only): how many tuples ahead the kernel asks for the ``z`` row it will read (0: it
    does not). The rows are read in tuple order, at random once ``z`` outgrows the caches, so each one waits for
    memory; asking ahead usually overlaps those waits, but it is off by default because one whole run with it was
    slower (`bench/tea/README.md`, 2026-12-07 evening; `bench/tea/bench_kernels.py` measures both).
    """
    kernel = _native(z) if native else None
    if kernel is not None:
        return kernel.weighted_segment_sum(crow, col, w, z, m, out, prefetch)
    n, d = len(crow) - 1, w.shape[1]
    zt = z.reshape(-1, d, m).transpose(0, 1).contiguous()  # D x rows x m: one dense operand per projection
    wt = w.T.contiguous()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        for j in range(d):
            s_j = torch.sparse_csr_tensor(crow, col, wt[j], (n, zt.shape[1]), check_invariants=False)
            out[:, j * m:(j + 1) * m] = torch.sparse.mm(s_j, zt[j])
    return out


def gathered_dot(left: torch.Tensor, right: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None,
                 gather_rows: int = 512, native: bool = True) -> torch.Tensor:
    """``out[i, c] = left[rows[i]] . right[index[i, c]]`` (rows default: all), in ``left``'s dtype (fp32 for fp16).

    ``right`` may be stored narrower (fp16): its rows are widened before the product, so only its storage rounding
    enters. The PyTorch path gathers about ``gather_rows`` candidate rows per chunk so that the gathered block stays
    cache-resident for the batched product.
    """
    index = index.contiguous()
    work = torch.float32 if left.dtype == torch.float16 else left.dtype
    kernel = _native(left, right) if native else None
    if kernel is not None and work == torch.float32 and right.dtype in (torch.float32, torch.float16):
        if left.dtype == torch.float32:
            return kernel.gathered_dot(left, right, index, None if rows is None else rows.contiguous())
        # fp16 left rows: widened to fp32 a chunk of rows at a time
        out = torch.empty(index.shape, dtype=work, device=left.device)
        step = 8192
        for r0 in range(0, index.shape[0], step):
            part = slice(r0, r0 + step)
            lrows = left[part] if rows is None else left[rows[part]]
            out[part] = kernel.gathered_dot(lrows.float(), right, index[part], None)
        return out
    chunk = max(1, gather_rows // max(1, index.shape[1]))
    out = torch.empty(index.shape, dtype=work, device=left.device)
    for r0 in range(0, index.shape[0], chunk):
        r1 = min(r0 + chunk, index.shape[0])
        lrows = (left[r0:r1] if rows is None else left[rows[r0:r1]]).to(work)
        cand = right.index_select(0, index[r0:r1].reshape(-1)).view(r1 - r0, index.shape[1], -1)
        if cand.dtype != work:
            cand = cand.to(work)
        out[r0:r1] = torch.bmm(cand, lrows[:, :, None])[:, :, 0]
    return out


def topk_rows(sims: torch.Tensor, k: int, native: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of every row of ``sims`` and their columns, sorted by value (descending): one
    `topk_merge_` of the whole rows into empty lists."""
    if not 1 <= k <= sims.shape[1]:
        raise ValueError(f"k must lie in [1, {sims.shape[1]}] (the row length), got {k}")
    if not native or _native(sims) is None or sims.dtype != torch.float32 or sims.stride(-1) != 1:
        return torch.topk(sims, k, dim=1)
    values = torch.full((sims.shape[0], k), float("-inf"), device=sims.device)
    index = torch.full((sims.shape[0], k), -1, dtype=torch.long, device=sims.device)
    topk_merge_(sims, 0, values, index)
    return values, index


def topk_merge_(sims: torch.Tensor, col0: int, values: torch.Tensor, index: torch.Tensor,
                rows: torch.Tensor | None = None, allowed: torch.Tensor | None = None, native: bool = True) -> None:
    """Merge a tile of scores (columns ``col0 ..``) into running top-k lists ``values`` / ``index``, in place.

    ``sims`` is fp32 or bf16 on the native path (a bf16 search's tiles, read as the fp32 values they exactly are;
    other dtypes take the PyTorch path). ``values`` / ``index`` (rows x k, fp32 / int64) start as ``-inf`` / ``-1``
    and stay sorted (value descending; among equal values the native kernel keeps the lower column first). Tiles
    must come in increasing column order.
    ``rows`` (int64) picks the tile rows that feed the lists (list ``i`` takes tile row ``rows[i]``); ``allowed``
    (bool over all columns) leaves the other columns out. A list may end with ``-inf`` / ``-1`` padding only while
    fewer than k allowed columns have been merged.
    """
    kernel = _native(sims, values) if native else None
    if (kernel is not None and sims.dtype in (torch.float32, torch.bfloat16) and sims.stride(-1) == 1
            and values.dtype == torch.float32
            and index.dtype == torch.long and values.is_contiguous() and index.is_contiguous()):
        kernel.topk_merge_(sims, col0, values, index, None if rows is None else rows.contiguous(),
                           None if allowed is None else allowed.contiguous())
        return
    tile = sims if rows is None else sims[rows]
    cols = torch.arange(col0, col0 + tile.shape[1], device=tile.device)
    if allowed is not None:
        keep = allowed[col0:col0 + tile.shape[1]]
        tile, cols = tile[:, keep], cols[keep]
    if tile.shape[1] == 0:
        return
    v, i = torch.topk(tile, min(values.shape[1], tile.shape[1]), dim=1)
    # held entries first: on equal values the stable sort keeps them (the lower columns) ahead
    merged_v = torch.cat([values, v.to(values.dtype)], dim=1)
    merged_i = torch.cat([index, cols[i]], dim=1)
    merged_v, order = torch.sort(merged_v, dim=1, descending=True, stable=True)
    k = values.shape[1]
    values.copy_(merged_v[:, :k])
    index.copy_(merged_i.gather(1, order[:, :k]))


def sinkhorn_(m: torch.Tensor, index: torch.Tensor, num_cols: int, iterations: int,
              native: bool = True) -> torch.Tensor:
    """``iterations`` rounds of row then column normalisation of ``m`` (rows x k, entry (i, c) in column
    ``index[i, c]``), in place. Zero rows and the columns only they use stay zero."""
    kernel = _native(m) if native else None
    if kernel is not None and m.dtype == torch.float32 and m.is_contiguous():
        kernel.sinkhorn_(m, index.contiguous(), num_cols, iterations)
        return m
    flat = index.reshape(-1)
    col = torch.empty(num_cols, dtype=m.dtype, device=m.device)
    tiny = torch.finfo(m.dtype).tiny  # only zero rows and the columns they alone use have zero sums
    # In place, and `take` for the column gather: allocating fresh rows x k tensors in every iteration is measurably
    # slower (bench/tea/README.md), and the result is the same.
    for _ in range(iterations):
        m.div_(m.sum(dim=1, keepdim=True).clamp_(min=tiny))
        col.zero_().index_add_(0, flat, m.view(-1))
        m.div_(torch.take(col.clamp_(min=tiny), index))
    return m


def csr_entries(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local row, column, value) of the non-zeros of the CSR rows ``rows``."""
    starts = crow[rows]
    lens = crow[rows + 1] - starts
    total = int(lens.sum())
    row = torch.repeat_interleave(torch.arange(len(rows), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    offs = torch.arange(total, device=lens.device) - first[row] + starts[row]
    return row, col[offs], val[offs]


def dice_candidates(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, totals: torch.Tensor,
                    left: torch.Tensor, candidates: torch.Tensor, right_dense: torch.Tensor,
                    right_totals: torch.Tensor, max_entries: int = 1 << 22, native: bool = True) -> torch.Tensor:
    """Multiset Dice of entity ``left[i]`` (a CSR row of time counts) and right position ``candidates[i, c]`` (a
    dense count row): ``2 * sum_tau min(c1, c2) / (|c1| + |c2|)``, 0 when both are empty; rows x k.

    The PyTorch path works in chunks of about ``max_entries`` (non-zero x candidate) look-ups to bound memory.
    """
    kernel = _native(right_dense) if native else None
    if kernel is not None and right_dense.dtype == torch.float32 and val.dtype == torch.float32:
        return kernel.dice_candidates(crow, col, val, totals, left.contiguous(), candidates.contiguous(),
                                      right_dense, right_totals.contiguous())
    out = torch.zeros(candidates.shape, device=candidates.device)
    lens = crow[left + 1] - crow[left]
    per_row = (lens * candidates.shape[1]).cumsum(0)
    r0 = 0
    while r0 < len(left):
        done = per_row[r0 - 1] if r0 else 0
        r1 = max(r0 + 1, int(torch.searchsorted(per_row, done + max_entries, right=True)))
        row, taus, cnts = csr_entries(crow, col, val, left[r0:r1])
        if len(row):
            right_vals = right_dense[candidates[r0:r1][row], taus[:, None]]  # entries x k
            out[r0:r1].index_add_(0, row, torch.minimum(right_vals, cnts[:, None]))
        r0 = r1
    den = totals[left][:, None] + right_totals[candidates]
    return torch.where(den > 0, 2.0 * out / den.clamp(min=1e-12), torch.zeros_like(out))
