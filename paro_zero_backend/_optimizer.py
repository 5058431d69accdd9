"""The user's optimizer, rebuilt over this rank's optimizer-state shard.

The engine hands the optimizer one tensor per (parameter, os slice) overlap, a *piece*, instead of the parameter:
rebuilding the user's optimizer class with its defaults and param groups over the pieces keeps param groups, weight
decay exclusions and per-element update rules exactly as on one process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["OptimizerLike", "rebuild_optimizer"]

OptimizerLike = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def rebuild_optimizer(optimizer: OptimizerLike, model_params: set[int], piece_of: Mapping[int, torch.Tensor],
                      pieces: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """``optimizer`` over the pieces: ``piece_of`` maps a parameter id to its piece on this rank (parameters without
    one are dropped from their group), ``pieces`` are all of them in layout order (for a factory)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("the optimizer already has state; build the engine before the first step, and "
                             "resume with engine.load_sharded()/load_consolidated() instead.")
        groups = []
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if id(p) not in model_params:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the model; build "
                                     "it over model.parameters().")
                if id(p) in piece_of:
                    params.append(piece_of[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            return type(optimizer)(groups, **defaults)
        except TypeError as exc:
            raise TypeError(f"could not rebuild {type(optimizer).__name__} over the optimizer-state shards "
                            f"({exc}). Pass a factory instead: ParoEngine(model, lambda groups: "
                            "MyOptimizer(groups, ...)).") from exc
    if callable(optimizer):
        return optimizer([{"params": list(pieces)}])
    raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, got {type(optimizer).__name__}.")
