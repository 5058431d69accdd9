"""Row-sharded embedding collection: G-Meta's model-parallel embedding layer in plain ``torch.distributed``.

The ``[R, d]`` table (all fields stacked, `EmbeddingCollection` layout) is cut into ``world`` contiguous row blocks
of ``ceil(R / world)`` rows; rank ``r`` keeps block ``r`` only, so per-rank embedding memory is ~1/world of the
table. A lookup is one round trip of ``all_to_all_single``:

1. each rank deduplicates the rows it needs and sends each row id to its owner (ids exchange, no autograd);
2. owners gather the rows and send the vectors back (the autograd function `_ShardedLookup`);
3. in backward the vector gradients travel the same way in reverse and are ``index_add``-ed into the owner's shard.

Dense layers stay data parallel (DDP all-reduce); the shard parameter is excluded from DDP, because each rank's
shard gradient already is the sum over all ranks. ``grad_reduction="mean"`` divides it by ``world`` to match DDP's
average, which is what makes 2 ranks reproduce 1 rank exactly.

Why ``sparse_grad``: the dense shard gradient is a zero-filled ``[rows_per_rank, d]`` tensor every step, and a dense
optimizer then sweeps every row of the shard, although a step touches only the rows looked up. With a large table
those two sweeps cost more than the lookup itself (bench/gmeta/README.md, cluster benchmark); a sparse COO gradient
of the served rows, with an optimizer that takes sparse gradients (`Adagrad`, `SGD`, `SparseAdam`), skips them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .models import EmbeddingCollection, check_ids_in_range

__all__ = ["RowShardedEmbeddingCollection", "shard_embeddings"]


def _a2a(tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out


class _ShardedLookup(torch.autograd.Function):
    """Vectors of ``recv_local`` rows of this rank's shard, sent back to the requesting ranks (and grads reversed)."""

    @staticmethod
    def forward(ctx, local_weight, recv_local, send_splits, recv_splits, group, grad_scale, sparse_grad=False):
        ctx.save_for_backward(recv_local)
        ctx.meta = (send_splits, recv_splits, group, grad_scale, local_weight.shape, sparse_grad)
        served = local_weight.index_select(0, recv_local)
        # the rows we serve go back to the ranks that asked: splits swap direction
        return _a2a(served, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad_vecs):
        (recv_local,) = ctx.saved_tensors
        send_splits, recv_splits, group, grad_scale, shape, sparse_grad = ctx.meta
        grad_served = _a2a(grad_vecs, send_splits, recv_splits, group)
        if sparse_grad:  # rows asked for by several ranks appear once per rank (uncoalesced): their sum is the grad
            if grad_scale != 1.0:
                grad_served.mul_(grad_scale)
            grad_local = torch.sparse_coo_tensor(recv_local.unsqueeze(0), grad_served, shape, check_invariants=False)
            return grad_local, None, None, None, None, None, None
        grad_local = torch.zeros(shape, dtype=grad_served.dtype, device=grad_served.device)
        grad_local.index_add_(0, recv_local, grad_served)
        if grad_scale != 1.0:
            grad_local.mul_(grad_scale)
        return grad_local, None, None, None, None, None, None


class RowShardedEmbeddingCollection(nn.Module):
    """Drop-in replacement for `EmbeddingCollection` whose rows are split across the ranks of ``group``.

    Every rank must call ``forward`` the same number of times (it is a collective); ``ids`` may differ per rank.

    Args:
        vocab_sizes (`list[int]`): rows per field.
        embedding_dim (`int`): width.
        full_weight (`torch.Tensor`, *optional*): the unsharded ``[R, d]`` table to slice (identical on all ranks);
            drawn like `EmbeddingCollection` from ``seed`` when omitted.
        group: process group (default: the world).
        grad_reduction (`str`, defaults to `"mean"`): `"mean"` divides shard gradients by the world size (DDP
            semantics), `"sum"` keeps the sum over ranks.
        sparse_grad (`bool`, defaults to `False`): give the shard a sparse COO gradient of the rows served this step
            instead of a dense shard-sized one (needs an optimizer that takes sparse gradients, e.g. `Adagrad`).
    """

    is_embedding_collection = True
    is_sharded = True

    def __init__(self, vocab_sizes: list[int], embedding_dim: int, names: list[str] | None = None,
                 full_weight: torch.Tensor | None = None, group=None, grad_reduction: str = "mean",
                 init_std: float = 0.05, seed: int = 0, sparse_grad: bool = False):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RowShardedEmbeddingCollection needs an initialised torch.distributed process group "
                               "(e.g. launched with torchrun or hf_placement.testing.run_distributed).")
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction={grad_reduction!r} must be 'mean' or 'sum'.")
        self.vocab_sizes = [int(v) for v in vocab_sizes]
        self.names = list(names) if names else [f"field{i}" for i in range(len(vocab_sizes))]
        self.embedding_dim = int(embedding_dim)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.grad_reduction = grad_reduction
        self.sparse_grad = bool(sparse_grad)
        rows = sum(self.vocab_sizes)
        self.rows_per_rank = math.ceil(rows / self.world)
        self.row_start = min(self.rank * self.rows_per_rank, rows)
        self.row_end = min(self.row_start + self.rows_per_rank, rows)
        if full_weight is None:
            full_weight = EmbeddingCollection.initial_table(self.vocab_sizes, self.embedding_dim, init_std, seed)
        if tuple(full_weight.shape) != (rows, self.embedding_dim):
            raise ValueError(f"full_weight has shape {tuple(full_weight.shape)}, expected ({rows}, "
                             f"{self.embedding_dim}) for vocab_sizes={self.vocab_sizes}.")
        self.local_weight = nn.Parameter(full_weight[self.row_start:self.row_end].detach().clone())
        self.local_weight._gmeta_sharded = True
        offsets = torch.tensor([0] + self.vocab_sizes[:-1], dtype=torch.long, device=self.local_weight.device)
        offsets = offsets.cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)

    @property
    def num_rows(self) -> int:
        return sum(self.vocab_sizes)

    def local_bytes(self) -> int:
        """Bytes of embedding rows this rank holds."""
        return self.local_weight.numel() * self.local_weight.element_size()

    def forward(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """``ids [N, F]`` (this rank's ids) -> ``[N, F, d]``; a collective over ``group``."""
        if check:
            check_ids_in_range(ids, self.vocab_sizes, self.names)
        rows = (ids.long() + self.offsets).reshape(-1)
        uniq, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        owner = torch.div(uniq, self.rows_per_rank, rounding_mode="floor")
        send_counts = torch.bincount(owner, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        # `uniq` is sorted, so rows are already grouped by owner in rank order
        recv_rows = _a2a(uniq, send_splits, recv_splits, self.group)
        recv_local = recv_rows - self.row_start
        scale = 1.0 / self.world if self.grad_reduction == "mean" else 1.0
        vecs = _ShardedLookup.apply(self.local_weight, recv_local, send_splits, recv_splits, self.group, scale,
                                    self.sparse_grad)
        return vecs.index_select(0, inverse).reshape(*ids.shape, self.embedding_dim)

    @torch.no_grad()
    def gather_full_weight(self) -> torch.Tensor:
        """The unsharded ``[R, d]`` table on every rank (for checks and checkpoints; costs a full all-gather)."""
        padded = self.local_weight.new_zeros(self.rows_per_rank, self.embedding_dim)
        padded[: self.local_weight.shape[0]] = self.local_weight
        out = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        return torch.cat(out)[: self.num_rows]


def shard_embeddings(model: nn.Module, group=None, grad_reduction: str = "mean",
                     sparse_grad: bool | None = None) -> nn.Module:
    """Replace every `EmbeddingCollection` inside ``model`` by a `RowShardedEmbeddingCollection` holding this rank's
    rows of the same weights (in place; returns ``model``). ``sparse_grad`` defaults to the table's own setting."""
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, EmbeddingCollection):
                sharded = RowShardedEmbeddingCollection(child.vocab_sizes, child.embedding_dim, child.names,
                                                        full_weight=child.weight.detach(), group=group,
                                                        grad_reduction=grad_reduction,
                                                        sparse_grad=child.sparse_grad if sparse_grad is None
                                                        else sparse_grad)
                setattr(module, child_name, sharded)
                replaced += 1
    if replaced == 0:
        raise ValueError("shard_embeddings found no EmbeddingCollection in the model; build the model with "
                         "gmeta_trainer.EmbeddingCollection tables (e.g. DLRMModel).")
    return model
