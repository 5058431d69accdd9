"""DLRM-style recommendation models: sparse features through embedding tables, dense features and the interaction
through MLPs.

Tensor legend: ``N`` any leading batch shape (``[T, K]`` for tasks x examples), ``F`` sparse fields, ``D`` dense
features, ``d`` embedding dimension.

Why the model is split into ``embed`` and ``forward(..., emb=...)``: G-Meta's inner loop adapts only the replicated
dense layers, so the embedding lookup (the only communication when tables are sharded) runs once per meta-step for the
support and query sets together, outside the vectorised inner loop. ``forward`` accepts pre-looked-up embeddings
for that reason; it does the lookup itself when the tables are adapted in the inner loop too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DLRMConfig", "DLRMModel", "EmbeddingCollection", "check_ids_in_range"]


def check_ids_in_range(ids: torch.Tensor, vocab_sizes: list[int], names: list[str] | None = None) -> None:
    """Raise a `ValueError` naming the field when an id in ``ids[..., f]`` is outside ``[0, vocab_sizes[f])``."""
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sparse ids must be int32/int64, got {ids.dtype}; cast with `.long()`.")
    if ids.shape[-1] != len(vocab_sizes):
        raise ValueError(f"sparse ids have {ids.shape[-1]} fields in the last dimension but the embedding collection "
                         f"has {len(vocab_sizes)} tables; pass one id per table (shape [..., {len(vocab_sizes)}]).")
    if ids.numel() == 0:
        return
    flat = ids.reshape(-1, ids.shape[-1])
    lo, hi = flat.amin(0), flat.amax(0)
    sizes = torch.tensor(vocab_sizes, dtype=flat.dtype, device=flat.device)
    bad = ((lo < 0) | (hi >= sizes)).nonzero().flatten().tolist()
    if bad:
        f = bad[0]
        name = names[f] if names else f"#{f}"
        value = int(lo[f]) if lo[f] < 0 else int(hi[f])
        raise ValueError(f"embedding id {value} of sparse field {name!r} is out of range [0, {vocab_sizes[f]}). "
                         "Re-encode the feature (e.g. with `gmeta_trainer.encode_categorical`) or raise "
                         f"`vocab_sizes[{f}]` in the model config; reserve id 0 for unknown values if new ones appear.")


class EmbeddingCollection(nn.Module):
    """One embedding table per sparse field, stored as a single ``[sum(vocab_sizes), d]`` matrix with row offsets.

    A single matrix makes row sharding (`RowShardedEmbeddingCollection`) a plain row split of the same tensor, so the
    sharded and unsharded models start from identical weights.

    ``sparse_grad=True`` gives the table a sparse COO gradient holding only the rows looked up (``F.embedding(...,
    sparse=True)``): with a large replicated table this avoids a dense table-sized gradient every step, and lets
    ``torch.distributed.all_reduce`` send only those rows. It needs an optimizer that takes sparse gradients
    (`torch.optim.SGD` without momentum, `Adagrad`, `SparseAdam`).
    """

    is_embedding_collection = True

    def __init__(self, vocab_sizes: list[int], embedding_dim: int, names: list[str] | None = None,
                 init_std: float = 0.05, seed: int = 0, sparse_grad: bool = False):
        super().__init__()
        self.sparse_grad = bool(sparse_grad)
        if not vocab_sizes or any(int(v) < 1 for v in vocab_sizes):
            raise ValueError(f"vocab_sizes must be a non-empty list of positive ints, got {vocab_sizes}.")
        self.vocab_sizes = [int(v) for v in vocab_sizes]
        self.names = list(names) if names else [f"field{i}" for i in range(len(vocab_sizes))]
        self.embedding_dim = int(embedding_dim)
        offsets = torch.tensor([0] + self.vocab_sizes[:-1], dtype=torch.long).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)
        self.weight = nn.Parameter(self.initial_table(self.vocab_sizes, self.embedding_dim, init_std, seed))

    @staticmethod
    def initial_table(vocab_sizes: list[int], dim: int, init_std: float, seed: int) -> torch.Tensor:
        """The full table drawn from its own generator, so every rank (and the sharded twin) draws the same rows."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(sum(vocab_sizes), dim, generator=gen) * init_std

    @property
    def num_rows(self) -> int:
        return sum(self.vocab_sizes)

    def forward(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """``ids [N, F]`` -> ``[N, F, d]``."""
        if check:
            check_ids_in_range(ids, self.vocab_sizes, self.names)
        return F.embedding(ids + self.offsets, self.weight, sparse=self.sparse_grad)


@dataclass
class DLRMConfig:
    """Shape of a `DLRMModel`.

    Parameters:
        vocab_sizes (`list[int]`): rows of each sparse field's table.
        sparse_names (`list[str]`, *optional*): field names, used in error messages.
        num_dense (`int`, defaults to 0): dense (real-valued) input features.
        embedding_dim (`int`, defaults to 16): width of every table.
        bottom_mlp (`list[int]`): hidden widths of the dense-feature MLP; its output has width ``embedding_dim``.
        top_mlp (`list[int]`): hidden widths of the MLP on the interaction output (a 1-unit head is appended).
        interaction (`str`, defaults to `"dot"`): `"dot"` (DLRM pairwise dot products plus the dense vector) or
            `"concat"` (MeLU-style concatenation).
        init_std (`float`), seed (`int`): embedding initialisation.
    """

    vocab_sizes: list[int]
    sparse_names: list[str] | None = None
    num_dense: int = 0
    embedding_dim: int = field(default=16, metadata={"help": "Width of every embedding table."})
    bottom_mlp: list[int] = field(default_factory=lambda: [32])
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    interaction: str = field(default="dot", metadata={"help": "'dot' (DLRM) or 'concat' (MeLU-style)."})
    init_std: float = 0.05
    seed: int = 0

    def __post_init__(self):
        if self.interaction not in ("dot", "concat"):
            raise ValueError(f"interaction={self.interaction!r} is not supported; use 'dot' or 'concat'.")
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}.")
        if self.sparse_names is not None and len(self.sparse_names) != len(self.vocab_sizes):
            raise ValueError(f"sparse_names has {len(self.sparse_names)} names for {len(self.vocab_sizes)} tables.")

    def to_dict(self) -> dict:
        return asdict(self)


def _mlp(sizes: list[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRMModel(nn.Module):
    """DLRM (Naumov et al., 2019) sized for CPU: embeddings + bottom MLP, pairwise dot interaction, top MLP -> logit.

    Example:

    ```python
    >>> import torch
    >>> from gmeta_trainer import DLRMConfig, DLRMModel
    >>> model = DLRMModel(DLRMConfig(vocab_sizes=[10, 5], num_dense=3))
    >>> model(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3)).shape
    torch.Size([4])
    ```
    """

    def __init__(self, config: DLRMConfig):
        super().__init__()
        self.config = config
        d = config.embedding_dim
        self.embeddings = EmbeddingCollection(config.vocab_sizes, d, config.sparse_names, config.init_std,
                                              config.seed)
        n_vec = len(config.vocab_sizes)
        if config.num_dense > 0:
            self.bottom = _mlp([config.num_dense, *config.bottom_mlp, d], final_activation=True)
            n_vec += 1
        else:
            self.bottom = None
        if config.interaction == "dot":
            width = n_vec * (n_vec - 1) // 2 + (d if self.bottom is not None else 0)
            tri = torch.triu_indices(n_vec, n_vec, offset=1)
            self.register_buffer("_triu", tri, persistent=False)
        else:
            width = n_vec * d
        self.top = _mlp([width, *config.top_mlp, 1], final_activation=False)

    def embed(self, sparse: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Look up ``sparse [N, F]`` -> ``[N, F, d]`` (the only step that communicates when tables are sharded)."""
        return self.embeddings(sparse, check=check)

    def forward(self, sparse: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                emb: torch.Tensor | None = None, check_ids: bool = True) -> torch.Tensor:
        """Logits ``[N]`` from ``sparse [N, F]`` ids (or pre-looked-up ``emb [N, F, d]``) and ``dense [N, D]``."""
        if emb is None:
            if sparse is None:
                raise ValueError("DLRMModel.forward needs `sparse` ids or pre-looked-up `emb`.")
            emb = self.embed(sparse, check=check_ids)
        vecs = [emb]
        if self.bottom is not None:
            if dense is None or dense.shape[-1] != self.config.num_dense:
                got = None if dense is None else dense.shape[-1]
                raise ValueError(f"the model expects {self.config.num_dense} dense features, got {got}.")
            x = self.bottom(dense)
            vecs.insert(0, x.unsqueeze(-2))
        z = torch.cat(vecs, dim=-2)  # [N, n_vec, d]
        if self.config.interaction == "dot":
            inter = z @ z.transpose(-1, -2)
            feats = inter[..., self._triu[0], self._triu[1]]
            if self.bottom is not None:
                feats = torch.cat([x, feats], dim=-1)
        else:
            feats = z.flatten(-2)
        return self.top(feats).squeeze(-1)
