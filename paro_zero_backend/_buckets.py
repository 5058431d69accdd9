"""Flat padded buckets: which parameters travel together, and where each one lives in the flat buffer.

Parameters are grouped into *units* (the modules whose parameters are gathered and released together: the root, every
child of an ``nn.ModuleList`` by default, and the caller's extra units), then into buckets of at most ``bucket_size``
elements per unit, with frozen and trainable parameters in separate buckets (p-level gathers cover every parameter,
gradient/os/sync_p work only covers trainable ones, paper §11). Each bucket is padded to a multiple of the world size
``n`` so that every level (1, 1/m, 1/n) is an equal, contiguous slice in the device-major layout
(`schedule.slice_range`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ParamSlot", "Bucket", "build_units", "build_buckets"]


@dataclass
class ParamSlot:
    name: str
    param: nn.Parameter
    shape: torch.Size
    numel: int
    offset: int  # start in the bucket's flat coordinates
    trainable: bool
    bucket: int = -1


@dataclass
class Bucket:
    index: int
    unit: int
    trainable: bool
    slots: list[ParamSlot]
    numel: int  # unpadded elements
    size: int  # padded to a multiple of the world size
    # Runtime state (filled by the engine).
    p_store: torch.Tensor | None = None  # compute dtype, p-level slice
    full: torch.Tensor | None = None  # gathered working buffer while gathered
    g_acc: torch.Tensor | None = None  # grad dtype, g-level slice, accumulated over micro-steps
    g_tmp: torch.Tensor | None = None  # full local gradient of the current micro-step (g != N)
    master: torch.Tensor | None = None  # fp32 os-level slice
    master_grad: torch.Tensor | None = None  # fp32 os-level reduced gradient (after sync_g)
    arrived: int = 0
    reduced: bool = False
    pins: int = 0  # open ParoEngine.gathered() blocks holding this bucket's full working copy
    pieces: list[tuple[ParamSlot, int, int, torch.Tensor]] = field(default_factory=list)

    @property
    def num_trainable(self) -> int:
        return sum(1 for s in self.slots if s.trainable)


def _unit_modules(model: nn.Module, class_names: list[str] | None, extra: Sequence[nn.Module]) -> list[nn.Module]:
    units: list[nn.Module] = [model]
    for module in model.modules():
        if module is model:
            continue
        if class_names is not None:
            if type(module).__name__ in class_names:
                units.append(module)
        elif isinstance(module, nn.ModuleList):
            units.extend(child for child in module.children() if all(child is not u for u in units))
    members = {id(m) for m in model.modules()}
    for module in extra:
        if id(module) not in members:
            raise ValueError(f"extra_units holds a {type(module).__name__} that is not a submodule of the model; pass "
                             "modules of the wrapped model (e.g. model.policy, model.value_model.score).")
        if all(module is not u for u in units):
            units.append(module)
    return units


def build_units(model: nn.Module, class_names: list[str] | None, extra: Sequence[nn.Module] = ()
                ) -> tuple[list[nn.Module], dict[int, int]]:
    """Units and, for each parameter id, the index of the unit that gathers it.

    Units: the root, then the children of every ``nn.ModuleList`` (``class_names=None``) or the modules of the named
    classes (``[]``: none), then ``extra`` (modules called directly, whose forward gathers their own parameters). A
    parameter is owned by the innermost unit around the module that holds it; a parameter held by modules of
    different units (tied embeddings) goes to the root, which stays gathered for the whole forward and backward.
    """
    units = _unit_modules(model, class_names, extra)
    unit_of_module: dict[int, int] = {}

    def visit(module: nn.Module, current: int) -> None:
        for idx, u in enumerate(units):
            if u is module:
                current = idx
                break
        unit_of_module[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(model, 0)
    owner: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False):
            u = unit_of_module[id(module)]
            owner[id(p)] = u if owner.get(id(p), u) == u else 0
    return units, owner


def build_buckets(model: nn.Module, owner: dict[int, int], num_units: int, bucket_size: int,
                  world_size: int) -> tuple[list[Bucket], list[ParamSlot]]:
    """Pack parameters (first name of each, in ``named_parameters`` order) into padded buckets."""
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(num_units)]
    for name, p in model.named_parameters():
        per_unit[owner[id(p)]].append((name, p))
    buckets: list[Bucket] = []
    slots: list[ParamSlot] = []
    for unit, params in enumerate(per_unit):
        for trainable in (True, False):
            current: list[ParamSlot] = []
            used = 0

            def close(unit: int = unit, trainable: bool = trainable) -> None:
                nonlocal current, used
                if current:
                    size = max(-(-used // world_size), 1) * world_size
                    b = Bucket(len(buckets), unit, trainable, current, used, size)
                    for s in current:
                        s.bucket = b.index
                    buckets.append(b)
                current, used = [], 0

            for name, p in params:
                if p.requires_grad != trainable:
                    continue
                if current and used + p.numel() > bucket_size:
                    close()
                slot = ParamSlot(name, p, p.shape, p.numel(), used, trainable)
                current.append(slot)
                slots.append(slot)
                used += p.numel()
            close()
    return buckets, slots
