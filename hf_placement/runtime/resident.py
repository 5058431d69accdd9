"""What a process holds right now: the measured side of the memory accountant (`hf_placement.planner.memory`).

The accountant predicts model-state bytes per rank from a plan; `resident_bytes` measures them from live tensors, so a
benchmark or a test can hold the two side by side. Storages are counted once (tied weights, views into flat buffers)
and freed storages (a sharded engine's released gathers) count zero.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resident_bytes"]


def resident_bytes(modules: list[nn.Module | None], optimizer: torch.optim.Optimizer | None = None,
                   extra: list[torch.Tensor] | None = None) -> int:
    """Bytes of model state this process holds right now: allocated parameter storages of ``modules`` (freed shards
    count 0), their gradients, the optimizer's state and parameters, and ``extra`` tensors; each storage once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            return
        seen.add(key)
        total += s.nbytes()

    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            add(p.data)
            add(p.grad)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                add(p.data)
                add(p.grad)
                for v in optimizer.state.get(p, {}).values():
                    add(v)
    for t in extra or []:
        add(t)
    return total
