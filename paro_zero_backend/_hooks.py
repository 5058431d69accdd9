"""When working parameters come and go (strategies with p = I or G): the forward and backward hooks of each unit.

- a unit's forward pre-hook gathers its buckets; its forward hook releases them (with ``reshard_after_forward=False``
  and gradients on, it keeps them for the backward instead);
- a hook on the unit's output gradients gathers them again for its backward; a hook on its input gradients (fired
  once the unit's whole backward ran) releases them; the end of the backward releases whatever is left;
- every module that holds parameters checks, before it runs, that they are gathered: a module whose unit's forward
  never ran (a wrapper whose sub-modules the caller runs directly) gets an error naming the unit and the fix, instead
  of an obscure shape error on an empty weight.

While a bucket is pinned (`ParoEngine.gathered`) it stays gathered: the gathers are no-ops and the engine ignores
its releases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._buckets import Bucket
    from .engine import ParoEngine

__all__ = ["install_unit_hooks"]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested outputs (tuples, lists, dicts, HF ``ModelOutput``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def install_unit_hooks(engine: ParoEngine) -> list[Any]:
    """Register the gather/release hooks of every unit and the gathered-check of every module; returns the handles."""
    handles = []
    for u, module in enumerate(engine._units):
        if engine._unit_buckets[u]:
            handles.append(module.register_forward_pre_hook(_pre_forward(engine, u), with_kwargs=True))
            handles.append(module.register_forward_hook(_post_forward(engine, u)))
    # Registered after the unit hooks, so a unit's own gather runs before its check.
    names = {id(m): name or "<root>" for name, m in engine.module.named_modules()}
    unit_names = [names.get(id(m), "?") for m in engine._units]
    for name, module in engine.module.named_modules():
        own = [engine.buckets[engine._slot_by_param[id(p)].bucket] for p in module.parameters(recurse=False)]
        if own:
            handles.append(module.register_forward_pre_hook(_gathered_check(name or "<root>", own, unit_names)))
    return handles


def _release_unit(engine: ParoEngine, u: int) -> None:
    for b in engine._unit_buckets[u]:
        engine._release(b)


def _pre_forward(engine: ParoEngine, u: int) -> Callable:
    def hook(module, args, kwargs):
        engine._gather(engine._unit_buckets[u])
        if u != 0 and torch.is_grad_enabled():
            inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
            remaining = [len(inputs)]

            def on_input_grad(grad):
                remaining[0] -= 1
                if remaining[0] == 0:
                    _release_unit(engine, u)  # the unit's whole backward has run
                return None

            for t in inputs:
                t.register_hook(on_input_grad)
        return None

    return hook


def _post_forward(engine: ParoEngine, u: int) -> Callable:
    def hook(module, args, output):
        if torch.is_grad_enabled():
            def on_output_grad(grad):
                engine._ensure_callback()
                engine._gather(engine._unit_buckets[u])  # a no-op when the forward's copy was kept
                return None

            for t in _tensors(output):
                if t.requires_grad and t.grad_fn is not None:
                    t.register_hook(on_output_grad)
            if not engine.config.reshard_after_forward:
                return None  # kept for the backward: released after it (input-gradient hook, or end of backward)
        _release_unit(engine, u)
        return None

    return hook


def _gathered_check(name: str, own: list[Bucket], unit_names: list[str]) -> Callable:
    def hook(module, args):
        missing = [b for b in own if b.full is None]
        if missing:
            raise RuntimeError(
                f"module {name!r} ({type(module).__name__}) ran, but its parameters are not gathered: they belong "
                f"to the unit {unit_names[missing[0].unit]!r}, whose forward has not run. Call the model through "
                "that unit, pass the module you call directly in ParoEngine(..., extra_units=[...]), or run inside "
                "engine.gathered().")
        return None

    return hook
