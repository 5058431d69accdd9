"""Sinkhorn operator on the sparse k-candidate layout (reference: ``alignment.sinkhorn``), plus a dense reference.

``M = exp(sim / temperature)`` restricted to each row's k candidates, then ``iterations`` rounds of row
normalisation followed by column normalisation over the sparse support (the last step is a column step, so every
used column sums to 1 and at most one row can score above 0.5 in it).
"""

from __future__ import annotations

import torch

from .kernels import sinkhorn_


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
    return sinkhorn_(m, index, num_cols, iterations)


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
