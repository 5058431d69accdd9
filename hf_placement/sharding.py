"""ZeRO-3-style parameter sharding inside a rank group: what All-colocated must do when four models do not fit.

A `ShardedModule` flattens the parameters of one module into a single buffer, keeps only its ``1/n`` slice on each of
the ``n`` ranks of the group, and frees the rest. Every forward gathers the full weights (one all-gather) right before
the module runs and frees them right after; a forward with gradients re-gathers them before its backward (a tensor
hook on the module's outputs), as ZeRO-3 does, so the training cost is two gathers per micro-batch. Gradients of a
trained module are reduce-scattered into the owner's slice (`ShardedModule.reduce_gradients`) and the optimizer steps
only that slice (`ShardedModule.shard` is the parameter to hand it): weights, gradients and optimizer state all live
``1/n`` per rank between calls.

Why storage resizing rather than reassigning ``param.data``: autograd keeps references to the weights it saved in
forward; the parameters stay views of one flat buffer whose *storage* is resized to 0 on release and re-allocated on
gather (the trick PyTorch FSDP uses), so the saved references see the re-gathered values in backward.

`gathered` pins the full weights for a block of calls (one gather for a whole generation, like DeepSpeed's Hybrid
Engine / TRL's ``ds3_gather_for_generation``, or to read a full state dict). ``bytes_gathered`` counts the traffic.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ShardedModule", "resident_bytes"]

# torch 2.13 deprecates the *_tensor names in favour of *_single; older releases only have the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)
    elif hasattr(tree, "to_tuple"):  # transformers ModelOutput
        yield from _tensors(tree.to_tuple())


class ShardedModule:
    """Shard the parameters of ``module`` over ``group`` (all ranks of the group call this, same module layout).

    Args:
        module: the module whose *own and nested* parameters are sharded; it keeps working as a normal module.
        group: the process group (``None``: the world).
        timeout_s: timeout of every gather / reduce-scatter; a stalled peer raises instead of hanging.
        trainable: keep a gradient path (re-gather before backward) and expose ``shard`` for the optimizer.
    """

    def __init__(self, module: nn.Module, group: Any = None, timeout_s: float = 300.0, trainable: bool = False):
        self.module, self.group, self.trainable = module, group, trainable
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = [p for p in dict(module.named_parameters(remove_duplicate=True)).values()]
        if not self.params:
            raise ValueError(f"{type(module).__name__} has no parameters to shard.")
        dtype = self.params[0].dtype
        if any(p.dtype != dtype for p in self.params):
            raise ValueError("ShardedModule needs every parameter of the module in one dtype; cast the module first.")
        self.numel = sum(p.numel() for p in self.params)
        self.chunk = -(-self.numel // self.world)
        with torch.no_grad():
            flat = torch.zeros(self.chunk * self.world, dtype=dtype, device=self.params[0].device)
            offset = 0
            for p in self.params:
                flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                offset += p.numel()
            self.shard = nn.Parameter(flat[self.rank * self.chunk : (self.rank + 1) * self.chunk].clone(),
                                      requires_grad=trainable)
            self.full = flat
            offset = 0
            for p in self.params:  # parameters become views of the flat buffer
                p.data = self.full[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.is_gathered = True
        self.pinned = 0
        self.bytes_gathered = 0
        self.gathers = 0
        self._hooks = [module.register_forward_pre_hook(self._pre_forward),
                       module.register_forward_hook(self._post_forward)]
        self.release()

    # ------------------------------------------------------------------ gather / release
    def gather(self) -> None:
        """All-gather the full weights into the flat buffer (the parameters' storage)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() != self._full_nbytes:
            storage.resize_(self._full_nbytes)
        with torch.no_grad():
            work = _all_gather(self.full, self.shard.detach(), group=self.group, async_op=True)
            work.wait(timeout=self.timeout)
        self.is_gathered = True
        self.gathers += 1
        self.bytes_gathered += (self.world - 1) * self.chunk * self.full.element_size()

    def release(self) -> None:
        """Free the full weights (keep this rank's slice only), unless pinned by `gathered`."""
        if self.pinned or not self.is_gathered:
            return
        try:
            self.full.untyped_storage().resize_(0)
        except RuntimeError as exc:
            raise RuntimeError("cannot free the gathered weights: their storage was pinned (e.g. by .numpy() on a "
                               "parameter). Copy parameters with .clone() before converting them.") from exc
        self.is_gathered = False

    @contextmanager
    def gathered(self):
        """Hold the full weights for the whole block: one gather, no per-forward traffic."""
        if self.pinned == 0:
            self.gather()
        self.pinned += 1
        try:
            yield self.module
        finally:
            self.pinned -= 1
            if self.pinned == 0:
                self.release()

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self.pinned:
            self.gather()

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.pinned:
            return output
        if self.trainable and torch.is_grad_enabled():
            fired = {"done": False}

            def regather(grad: torch.Tensor) -> torch.Tensor:
                if not fired["done"]:
                    fired["done"] = True
                    self.gather()
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(regather)
        self.release()
        return output

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """Sum the full gradients over the group into this rank's slice (``shard.grad``, averaged), drop the full
        gradients and free the full weights."""
        flat = torch.zeros(self.chunk * self.world, dtype=self.shard.dtype, device=self.shard.device)
        offset = 0
        for p in self.params:
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += p.numel()
        out = torch.empty(self.chunk, dtype=flat.dtype, device=flat.device)
        work = _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        work.wait(timeout=self.timeout)
        self.shard.grad = out / self.world
        self.release()

    def remove(self) -> None:
        """Gather the full weights back for good and remove the hooks (the module is an ordinary module again)."""
        if not self.is_gathered:
            self.gather()
        self.pinned += 1
        for h in self._hooks:
            h.remove()


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
