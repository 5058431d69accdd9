"""Sinkhorn operator on the sparse k-candidate layout (reference: ``alignment.sinkhorn``), plus a dense reference.

``M = exp(sim / temperature)`` restricted to each row's k candidates, then ``iterations`` rounds of row
normalisation followed by column normalisation over the sparse support (the last step is a column step, so every
used column sums to 1 and at most one row can score above 0.5 in it).
"""

from __future__ import annotations

import torch


def sparse_sinkhorn(sims: torch.Tensor, index: torch.Tensor, num_cols: int, temperature: float,
                    iterations: int, active: torch.Tensor | None = None) -> torch.Tensor:
    """Sinkhorn on ``sims`` (rows x k) whose entry (i, c) sits in column ``index[i, c]``; returns rows x k scores.

    Each row is shifted by its maximum before ``exp``: the first row normalisation cancels any per-row factor, so
    the result is unchanged while fp32 cannot overflow. Rows outside ``active`` (bool, rows) take no part: their
    scores are 0 and they take no column mass from the others.
    """
    m = torch.exp((sims - sims.max(dim=1, keepdim=True).values) / temperature)
    if active is not None:
        m[~active] = 0.0
    flat = index.reshape(-1)
    col = torch.empty(num_cols, dtype=m.dtype, device=m.device)
    tiny = torch.finfo(m.dtype).tiny  # only inactive rows and the columns they alone use have zero sums
    # In place, and `take` for the column gather: allocating fresh rows x k tensors in every iteration is measurably
    # slower (bench/tea/README.md), and the result is the same.
    for _ in range(iterations):
        m.div_(m.sum(dim=1, keepdim=True).clamp_(min=tiny))
        col.zero_().index_add_(0, flat, m.view(-1))
        m.div_(torch.take(col.clamp_(min=tiny), index))
    return m


def dense_sinkhorn(sims: torch.Tensor, index: torch.Tensor, num_cols: int, temperature: float,
                   iterations: int) -> torch.Tensor:
    """The reference procedure on a dense rows x num_cols matrix (zeros off the support); for tests."""
    dense = torch.zeros(sims.shape[0], num_cols, dtype=torch.float64)
    dense.scatter_(1, index, torch.exp(sims.double() / temperature))
    for _ in range(iterations):
        dense = dense / dense.sum(dim=1, keepdim=True)
        col = dense.sum(dim=0, keepdim=True)
        dense = torch.where(col > 0, dense / torch.where(col > 0, col, 1.0), dense)
    return dense
