"""The few collectives the PPO trainer needs, as no-ops on one process.

Why not DDP/accelerate: the trainer all-reduces gradients once per optimizer step (one flat bucket, deterministic
order), reduces whitening statistics and gathers metrics; keeping these explicit lets placement executors run the same
steps over a sub-group of ranks by passing ``group``.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["DistContext", "init_distributed_from_env"]


def init_distributed_from_env(timeout_s: float = 1800.0) -> None:
    """Initialise the default process group from torchrun/accelerate env vars when WORLD_SIZE > 1 and none exists."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


class DistContext:
    """World size, rank and the reductions of one (sub-)group; everything degrades to identity on one process."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.enabled = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.rank = dist.get_rank(group) if self.enabled else 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (returns a new tensor; the input is left untouched)."""
        if self.world_size == 1:
            return tensor
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equally shaped tensors of every rank along a new leading dim, flattened."""
        if self.world_size == 1:
            return tensor.reshape(1, *tensor.shape)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average ``.grad`` of ``params`` over ranks with one flat all-reduce (DDP's result, one bucket)."""
        if self.world_size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat /= self.world_size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Make every rank hold the parameters and buffers of rank ``src`` *of this group* (DDP's start-up broadcast).

        ``src`` is group-local: torch's ``broadcast`` takes a global rank, which is only the same thing for the world
        group or a group that starts at global rank 0 (not, e.g., a disaggregated inference group on ranks [2, 3]).
        """
        if self.world_size == 1:
            return
        if self.group is not None:
            src = dist.get_global_rank(self.group, src)
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor.data, src=src, group=self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
