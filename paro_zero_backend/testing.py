"""Helpers shared by the PaRO tests, the tour and the examples: a tiny GPT-2, fixed data, and a reference run.

The reference is the single-process run the engine must reproduce: one model, AdamW, and per optimizer step the
gradient of the mean loss over the *global* batch (all ranks' micro-batches), accumulated over ``s`` micro-steps
with the loss divided by ``s``, exactly as a data-parallel run sees it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "ADAMW_KWARGS", "make_adamw", "tiny_gpt2", "make_batches", "reference_run", "paro_train", "max_rel_diff",
    "to_numpy", "from_numpy",
]


def tiny_gpt2(seed: int = 0, n_embd: int = 30, n_layer: int = 2, vocab_size: int = 61, n_positions: int = 16):
    """A 2-layer GPT-2 without dropout (deterministic runs); sizes 30 and 61 make every bucket need padding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab_size, n_positions=n_positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def make_batches(steps: int, accumulation: int, world_size: int, micro_batch: int = 2, seq_len: int = 12,
                 vocab_size: int = 61, seed: int = 1) -> torch.Tensor:
    """Token ids shaped ``[steps, accumulation, world_size, micro_batch, seq_len]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (steps, accumulation, world_size, micro_batch, seq_len), generator=g)


# AdamW settings of the equivalence tests. eps=1e-4 rather than 1e-8: with eps far below the gradient scale, an
# element whose gradient is a near-cancelling sum moves by ~lr * (rounding error) / eps, so summation order alone
# (which necessarily differs between a sharded and a single-process run: per-rank accumulation, then a sum over
# ranks) shows up as relative differences far above fp32 rounding after a few steps, in a single process just as well.
ADAMW_KWARGS = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4}


def make_adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **ADAMW_KWARGS)


def reference_run(model: nn.Module, data: torch.Tensor,
                  max_grad_norm: float | None = None) -> dict[str, torch.Tensor]:
    """Single-process AdamW over the global batch; returns the final parameters by name."""
    opt = make_adamw(model.parameters())
    device = next(model.parameters()).device
    steps, s, n = data.shape[:3]
    for step in range(steps):
        for k in range(s):
            # The mean over ranks of per-rank mean losses equals the loss on the concatenated batch only for equal
            # token counts, which holds here; accumulate per rank to mirror the data-parallel sum exactly.
            for r in range(n):
                ids = data[step, k, r].to(device)
                (model(input_ids=ids, labels=ids).loss / (s * n)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def paro_train(engine, data: torch.Tensor, rank: int, steps: range | None = None) -> list[float]:
    """Train with the engine on this rank's slice of ``data``; returns the loss of every micro-step."""
    losses = []
    s = data.shape[1]
    for step in steps if steps is not None else range(data.shape[0]):
        for k in range(s):
            ids = data[step, k, rank].to(engine.device)
            ctx = engine.no_sync() if k < s - 1 else contextlib.nullcontext()
            with ctx:
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss / s)
            losses.append(float(loss.detach()))
        engine.step()
    return losses


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Max over tensors of ``||a - b||_2 / ||b||_2``: the relative difference of each parameter tensor.

    Per tensor rather than per element: AdamW turns rounding noise in a near-zero gradient element into an update
    of up to ``lr``, so element-wise ratios of zero-initialised biases say more about AdamW than about the engine.
    """
    worst = 0.0
    for k, ref in b.items():
        if k not in a:
            raise KeyError(f"{k} missing from the compared state")
        diff = (a[k].float() - ref.float()).norm().item()
        worst = max(worst, diff / max(ref.float().norm().item(), 1e-12))
    return worst


def summary(engine: Any) -> dict[str, Any]:
    return {"strategy": engine.strategy.name, "memory": engine.memory_bytes(),
            "last_step_bytes": engine.last_step_bytes}


def to_numpy(obj: Any) -> Any:
    """Tensors (also inside dicts) -> numpy copies, for values a rank returns through `run_distributed`: tensors
    shared through file descriptors die with the rank process."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().float().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    return obj


def from_numpy(obj: Any) -> Any:
    """Inverse of `to_numpy`, applied in the test process."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: from_numpy(v) for k, v in obj.items()}
    return obj
