"""Unequal per-rank batches + the weighted comm hook == one process on the union of the batches (fp32)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from antdt_callbacks import WeightedHookState, weighted_allreduce_hook
from hf_placement.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SIZES = [6, 2]  # rank 0 has three times rank 1's batch
CAPS = [4, None]  # rank 0 is memory-capped: its 6 samples run as micro-batches of 4 + 2 (local accumulation)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 5, generator=g)
    y = torch.randint(0, 3, (sum(SIZES),), generator=g)
    return x, y


def _both(rank: int, world: int) -> list[list[list[float]]]:
    return [_rank_grads(rank, world, False), _rank_grads(rank, world, True)]


def _rank_grads(rank: int, world: int, use_caps: bool) -> list[list[float]]:
    model = DDP(_model())
    state = WeightedHookState()
    model.register_comm_hook(state, weighted_allreduce_hook)
    x, y = _data()
    lo = sum(SIZES[:rank])
    xb, yb = x[lo:lo + SIZES[rank]], y[lo:lo + SIZES[rank]]
    state.weight = SIZES[rank] / sum(SIZES)
    cap = (CAPS[rank] if use_caps else None) or SIZES[rank]
    chunks = [(xb[i:i + cap], yb[i:i + cap]) for i in range(0, SIZES[rank], cap)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for j, (xm, ym) in enumerate(chunks):
        ctx = model.no_sync() if j < len(chunks) - 1 else contextlib.nullcontext()
        with ctx:
            loss = nn.functional.cross_entropy(model(xm), ym) * (len(xm) / SIZES[rank])
            loss.backward()
    grads = [p.grad.flatten().tolist() for p in model.parameters()]
    opt.step()
    return grads + [[float(v) for v in p.detach().flatten()] for p in model.parameters()]


def test_weighted_unequal_batches_equal_single_process_on_union():
    ref = _model()
    x, y = _data()
    nn.functional.cross_entropy(ref(x), y).backward()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    opt.step()
    outs = run_distributed(_both, 2, timeout=240)
    n = len(ref_grads)
    for variant in range(2):  # one batch per rank, and rank 0 as micro-batches 4 + 2
        for rank_out in (outs[0][variant], outs[1][variant]):
            for g_ref, g in zip(ref_grads, rank_out[:n]):
                torch.testing.assert_close(torch.tensor(g), g_ref.flatten(), rtol=1e-5, atol=1e-6)
            for p_ref, p in zip(ref.parameters(), rank_out[n:]):
                torch.testing.assert_close(torch.tensor(p), p_ref.detach().flatten(), rtol=1e-5, atol=1e-6)
    # Plain DDP (mean of the per-rank mean gradients) is biased towards the small batch: the check is not vacuous.
    plain = _model()
    for lo, size in ((0, SIZES[0]), (SIZES[0], SIZES[1])):
        (0.5 * nn.functional.cross_entropy(plain(x[lo:lo + size]), y[lo:lo + size])).backward()
    assert not torch.allclose(plain[0].weight.grad, ref_grads[0], atol=1e-4)
