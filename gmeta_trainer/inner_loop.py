"""The maths of the inner loop as pure functions: which parameters adapt, the masked task loss, and one task's
adapt-then-query step written with ``torch.func`` so it can be ``vmap``-ed over the tasks of a meta-batch.

MAML (Finn et al., 2017): fast weights ``θ' = θ - α ∇_θ L_support(θ)`` (repeated ``inner_steps`` times), meta loss
``L_query(θ')``. Second order differentiates through ``∇_θ L_support``; first order (FOMAML) treats it as a constant
(``detach``), so ``dθ'/dθ = I``. Meta-SGD learns ``α`` per element. MeLU (the closest public anchor for G-Meta's
recommendation setting) adapts only the dense decision layers; embeddings change in the outer update only.

Fast weights are passed with ``torch.func.functional_call``, never loaded with ``load_state_dict``: loading cuts the
graph and silently turns second order into first order (MeLU issue #9).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

__all__ = ["InnerLoopConfig", "InnerLoopError", "adapt", "masked_task_loss", "select_inner_params"]


class InnerLoopError(ValueError):
    """The inner-loop settings cannot work with this model (named parameter, reason and fix in the message)."""


@dataclass
class InnerLoopConfig:
    """Inner-loop settings of the meta-learner (the engine's view of `MetaTrainingArguments`).

    Parameters:
        inner_lr (`float`, defaults to 0.1): step size α of the inner SGD steps (initial value when learnable).
        learn_inner_lr (`bool`, defaults to `False`): Meta-SGD, one learnable rate per parameter element.
        inner_steps (`int`, defaults to 1): inner SGD steps on the support set during training.
        eval_inner_steps (`int`, *optional*): inner steps at evaluation; defaults to ``inner_steps``.
        first_order (`bool`, defaults to `False`): FOMAML; no differentiation through the inner gradients.
        inner_params (`str`, defaults to `"dense"`): `"dense"` (every parameter outside embedding tables, MeLU),
            `"all"` (classic MAML), or a regular expression matched (``re.search``) against parameter names.
        task_vmap (`bool`, defaults to `True`): vectorise the tasks with ``torch.vmap``; `False` loops in Python.
        loss (`str`, defaults to `"bce"`): `"bce"` (binary labels, logits) or `"mse"` (regression).
    """

    inner_lr: float = field(default=0.1, metadata={"help": "Inner-loop SGD step size (initial value if learnable)."})
    learn_inner_lr: bool = field(default=False, metadata={"help": "Meta-SGD: learn one rate per parameter element."})
    inner_steps: int = field(default=1, metadata={"help": "Inner SGD steps on each task's support set."})
    eval_inner_steps: int | None = field(default=None, metadata={"help": "Inner steps at evaluation (default: "
                                                                          "inner_steps)."})
    first_order: bool = field(default=False, metadata={"help": "First-order MAML (no second derivatives)."})
    inner_params: str = field(default="dense", metadata={"help": "'dense', 'all', or a regex on parameter names."})
    task_vmap: bool = field(default=True, metadata={"help": "Vectorise tasks with torch.vmap (else a Python loop)."})
    loss: str = field(default="bce", metadata={"help": "'bce' (binary labels) or 'mse' (regression)."})

    def __post_init__(self):
        if not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"inner_steps={self.inner_steps!r} must be an integer >= 1: with 0 steps there is no "
                             "adaptation and meta-training is plain training (use transformers.Trainer instead).")
        if self.eval_inner_steps is None:
            self.eval_inner_steps = self.inner_steps
        if not isinstance(self.eval_inner_steps, int) or self.eval_inner_steps < 0:
            raise ValueError(f"eval_inner_steps={self.eval_inner_steps!r} must be an integer >= 0.")
        if not self.inner_lr > 0:
            raise ValueError(f"inner_lr={self.inner_lr!r} must be > 0; inner steps with a zero or negative rate "
                             "cannot adapt. Typical values are 0.01-1.0.")
        if self.loss not in ("bce", "mse"):
            raise ValueError(f"loss={self.loss!r} is not supported; use 'bce' or 'mse'.")
        if self.inner_params not in ("dense", "all"):
            try:
                re.compile(self.inner_params)
            except re.error as exc:
                raise ValueError(f"inner_params={self.inner_params!r} is neither 'dense', 'all' nor a valid regular "
                                 f"expression ({exc}).") from exc


def _embedding_param_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or getattr(mod, "is_embedding_collection", False):
            prefix = f"{mod_name}." if mod_name else ""
            names.update(prefix + n for n, _ in mod.named_parameters())
    return names


def select_inner_params(model: nn.Module, inner_params: str) -> list[str]:
    """Names of the parameters adapted in the inner loop (raises `InnerLoopError` when the choice cannot work)."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    emb = _embedding_param_names(model)
    if inner_params == "dense":
        chosen = [n for n in trainable if n not in emb]
    elif inner_params == "all":
        chosen = list(trainable)
    else:
        pattern = re.compile(inner_params)
        chosen = [n for n in trainable if pattern.search(n)]
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad and pattern.search(n)]
        if frozen:
            raise InnerLoopError(f"inner_params={inner_params!r} matches frozen parameters {frozen}; the inner loop "
                                 "can only adapt parameters with requires_grad=True. Narrow the pattern.")
    if not chosen:
        raise InnerLoopError(f"inner_params={inner_params!r} selects no trainable parameter of "
                             f"{type(model).__name__} (parameters: {trainable[:8]}...). Use 'dense', 'all' or a "
                             "pattern that matches some names.")
    sharded = [n for n, p in model.named_parameters() if getattr(p, "_gmeta_sharded", False) and n in chosen]
    if sharded:
        raise InnerLoopError(f"inner_params={inner_params!r} selects row-sharded embedding parameters {sharded}: a "
                             "sharded table cannot be adapted per task inside the vectorised inner loop (each task "
                             "would need its own copy of every shard). Use inner_params='dense' (G-Meta/MeLU) or "
                             "do not shard the tables.")
    return chosen


def masked_task_loss(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor, kind: str = "bce") -> torch.Tensor:
    """Weighted mean loss of one task: ``Σ w·ℓ / max(Σ w, 1e-8)``; padded examples carry ``w = 0``."""
    if kind == "bce":
        per = F.binary_cross_entropy_with_logits(logits, y, reduction="none")
    else:
        per = (logits - y) ** 2
    return (per * w).sum(-1) / w.sum(-1).clamp_min(1e-8)


def adapt(
    forward: Callable[[dict[str, torch.Tensor], dict], torch.Tensor],
    fast: dict[str, torch.Tensor],
    lrs: dict[str, torch.Tensor | float],
    support: dict,
    y: torch.Tensor,
    w: torch.Tensor,
    steps: int,
    first_order: bool,
    loss: str = "bce",
    check_second_order: bool = False,
) -> dict[str, torch.Tensor]:
    """Run ``steps`` SGD steps of the support loss on the fast weights of one task; returns the adapted weights.

    ``forward(fast, inputs)`` returns the logits of the task's examples with ``fast`` substituted into the model.
    With ``check_second_order`` a gradient that has lost its graph (a layer with a ``once_differentiable``
    backward, a ``detach``) raises `InnerLoopError` instead of silently degrading to first order.
    """

    def support_loss(f):
        return masked_task_loss(forward(f, support), y, w, loss)

    for _ in range(steps):
        g = grad(support_loss)(fast)
        if first_order:
            g = {k: v.detach() for k, v in g.items()}
        elif check_second_order:
            cut = [k for k, v in g.items() if fast[k].requires_grad and not v.requires_grad]
            if cut:
                raise InnerLoopError(
                    f"second-order meta-gradients need the support loss to be twice differentiable, but the inner "
                    f"gradient of {cut} is cut from the graph (a layer with a once_differentiable backward, a "
                    "detach/no_grad in forward, or a non-differentiable op). Set first_order=True, or exclude those "
                    "layers from the inner loop with inner_params.")
        fast = {k: p - lrs[k] * g[k] for k, p in fast.items()}
    return fast


def call_with(model: nn.Module, slow: dict[str, torch.Tensor]) -> Callable[[dict, dict], torch.Tensor]:
    """``forward(fast, inputs)`` for `adapt`: ``model(**inputs)`` with ``{**slow, **fast}`` substituted."""

    def forward(fast: dict[str, torch.Tensor], inputs: dict) -> torch.Tensor:
        return functional_call(model, {**slow, **fast}, (), inputs)

    return forward
