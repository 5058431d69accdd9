"""Tour part: PaRO-DP strategy IIG on 4 gloo ranks (2 groups x 2) equals one-process AdamW; counters equal formulas."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hf_placement import run_distributed

COMPONENT = "paro_zero_backend"
DESCRIPTION = "4 gloo ranks as 2x2: PaRO IIG == single-process AdamW, bytes == formula"

STEPS, ACCUM, WORLD, GROUP = 2, 2, 4, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 33), nn.GELU(), nn.Linear(33, 5))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, ACCUM, WORLD, 8, 12, generator=g), torch.randn(STEPS, ACCUM, WORLD, 8, 5, generator=g)


def _train(rank: int, world: int) -> tuple[dict, dict, dict]:
    from paro_zero_backend import ParoConfig, ParoEngine, traffic

    model = _model()
    engine = ParoEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4),
                        ParoConfig(strategy="IIG", group_size=GROUP))
    x, y = _data()
    for step in range(STEPS):
        for k in range(ACCUM):
            with engine.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                engine.backward(nn.functional.mse_loss(engine(x[step, k, rank]), y[step, k, rank]) / ACCUM)
        engine.step()
    pad = engine.padded_numel()
    want = traffic("IIG", pad["all"], pad["trainable"], WORLD, GROUP, ACCUM, bytes_param=4, bytes_grad=4)
    state = {k: v.numpy() for k, v in engine.consolidated_state_dict().items()}
    return state, engine.last_step_bytes, {k: want[k] for k in ("intra", "inter")}


def run() -> str:
    results = run_distributed(_train, WORLD, timeout=120)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    x, y = _data()
    for step in range(STEPS):
        for k in range(ACCUM):
            for r in range(WORLD):
                (nn.functional.mse_loss(model(x[step, k, r]), y[step, k, r]) / (ACCUM * WORLD)).backward()
        opt.step()
        opt.zero_grad()
    state, got, want = results[0]
    diff = max(float((torch.from_numpy(state[n]) - p.detach()).norm() / p.detach().norm())
               for n, p in model.named_parameters())
    assert diff <= 1e-5, diff
    assert got["intra"] == want["intra"] and got["inter"] == want["inter"], (got, want)
    return (f"IIG on 2x2 ranks == 1-process AdamW (max rel diff {diff:.1e}); bytes/step intra {got['intra']}, "
            f"inter {got['inter']} == formula")
