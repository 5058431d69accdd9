"""Sparse similarity with temporal constraints (reference: ``alignment.sparse_sims`` and ``cal_simt``).

The structural similarity is an exact top-k inner product search done in row blocks (no |P| x |P| matrix is ever
held); the temporal similarity (multiset Dice of the entities' time stamps) is computed only for those top-k
candidate pairs, which is all the reference ever reads from its dense |P| x |P| ``simt`` matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopK:
    values: torch.Tensor  # rows x k
    index: torch.Tensor  # rows x k, positions into the candidate (right) list


def blocked_topk(left: torch.Tensor, right: torch.Tensor, k: int, block_rows: int,
                 masked_rows: torch.Tensor | None = None, allowed_cols: torch.Tensor | None = None,
                 masked_k: int = 0) -> tuple[TopK, TopK | None]:
    """Exact top-k of ``left @ right.T`` per row, in blocks of ``block_rows`` rows.

    With ``masked_rows`` (bool, rows) and ``allowed_cols`` (bool, columns), the same block products also give the
    top-``masked_k`` of the masked rows over the allowed columns only, so the pseudo-seed search of a round costs no
    second matrix product.
    """
    n = left.shape[0]
    k = min(k, right.shape[0])
    vals = torch.empty(n, k, device=left.device)
    idx = torch.empty(n, k, dtype=torch.long, device=left.device)
    want_masked = masked_rows is not None
    if want_masked:
        masked_pos = torch.full((n,), -1, dtype=torch.long, device=left.device)
        n_masked = int(masked_rows.sum())
        masked_pos[masked_rows] = torch.arange(n_masked, device=left.device)
        masked_k = min(masked_k, int(allowed_cols.sum()))
        mvals = torch.empty(n_masked, masked_k, device=left.device)
        midx = torch.empty(n_masked, masked_k, dtype=torch.long, device=left.device)
        blocked = ~allowed_cols
    for r0 in range(0, n, block_rows):
        r1 = min(r0 + block_rows, n)
        sims = left[r0:r1] @ right.T
        v, i = torch.topk(sims, k, dim=1)
        vals[r0:r1], idx[r0:r1] = v, i
        if want_masked:
            sel = masked_rows[r0:r1]
            if bool(sel.any()):
                sub = sims[sel]
                sub[:, blocked] = float("-inf")
                v, i = torch.topk(sub, masked_k, dim=1)
                pos = masked_pos[r0:r1][sel]
                mvals[pos], midx[pos] = v, i
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
        starts = self.crow[rows]
        lens = self.crow[rows + 1] - starts
        total = int(lens.sum())
        row = torch.repeat_interleave(torch.arange(len(rows), device=lens.device), lens)
        first = torch.cumsum(lens, 0) - lens
        offs = torch.arange(total, device=lens.device) - first[row] + starts[row]
        return row, self.col[offs], self.val[offs]

    def __call__(self, left_entities: torch.Tensor, candidates: torch.Tensor,
                 max_entries: int = 1 << 22) -> torch.Tensor:
        """Dice of ``left_entities[i]`` (entity ids) against right positions ``candidates[i, :]``: rows x k.

        Rows are processed in chunks of about ``max_entries`` (non-zero x candidate) look-ups to bound memory.
        """
        out = torch.zeros(candidates.shape, device=candidates.device)
        lens = self.crow[left_entities + 1] - self.crow[left_entities]
        per_row = (lens * candidates.shape[1]).cumsum(0)
        r0 = 0
        while r0 < len(left_entities):
            done = per_row[r0 - 1] if r0 else 0
            r1 = max(r0 + 1, int(torch.searchsorted(per_row, done + max_entries, right=True)))
            row, taus, cnts = self._entries(left_entities[r0:r1])
            if len(row):
                right_vals = self.right_dense[candidates[r0:r1][row], taus[:, None]]  # entries x k
                out[r0:r1].index_add_(0, row, torch.minimum(right_vals, cnts[:, None]))
            r0 = r1
        den = self.totals[left_entities][:, None] + self.right_totals[candidates]
        return torch.where(den > 0, 2.0 * out / den.clamp(min=1e-12), torch.zeros_like(out))
