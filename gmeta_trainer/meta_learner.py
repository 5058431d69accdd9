"""`MetaLearner`: a module whose ``forward`` is one meta-step (adapt on every task's support set, loss on its query
set), vectorised over the tasks of the batch with ``torch.vmap``.

Why the inner loop lives inside ``forward``: DDP (and therefore Trainer/accelerate) synchronises gradients in the
backward of whatever ``forward`` built, so a second-order meta-gradient is all-reduced correctly with no extra code,
and the outer update is the Trainer's normal optimizer step.

Batch layout (Meta-IO records collated by `collate_tasks`): ``T`` tasks, ``Ks`` support and ``Kq`` query slots,
``F`` sparse fields, ``D`` dense features:
``sup_sparse [T, Ks, F]``, ``sup_dense [T, Ks, D]``, ``sup_y [T, Ks]``, ``sup_w [T, Ks]`` (1 = real, 0 = padding),
and the same with ``qry_``.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .inner_loop import InnerLoopConfig, InnerLoopError, adapt, call_with, masked_task_loss, select_inner_params

__all__ = ["MetaLearner"]


def _lr_key(name: str) -> str:
    return name.replace(".", "__")


class MetaLearner(nn.Module):
    """Wraps a recommendation model (e.g. `DLRMModel`) for MAML-family meta-training.

    The wrapped model must accept ``model(sparse=..., dense=...)`` (logits per example). If it also has
    ``embed(sparse)`` and accepts ``emb=``, and no embedding parameter adapts in the inner loop, the lookup runs once
    per meta-step for support and query together, outside the vectorised loop (required for sharded tables).

    Args:
        model (`nn.Module`): the recommendation model.
        config (`InnerLoopConfig`): inner-loop settings.

    Example:

    ```python
    >>> from gmeta_trainer import (DLRMConfig, DLRMModel, InnerLoopConfig, MetaIOConfig, MetaLearner,
    ...                            TaskPrefetcher, build_task_records, make_synthetic_interactions)
    >>> io = MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"])
    >>> tasks = build_task_records(make_synthetic_interactions(num_users=8), io)
    >>> model = DLRMModel(DLRMConfig(vocab_sizes=[100, 8], num_dense=4))
    >>> learner = MetaLearner(model, InnerLoopConfig(inner_lr=0.5))
    >>> out = learner(**next(iter(TaskPrefetcher(tasks, tasks_per_batch=4))))
    >>> out["loss"].backward()
    ```
    """

    def __init__(self, model: nn.Module, config: InnerLoopConfig | None = None):
        super().__init__()
        self.model = model
        self.config = config or InnerLoopConfig()
        self.fast_names = select_inner_params(model, self.config.inner_params)
        params = dict(model.named_parameters())
        if self.config.learn_inner_lr:
            self.inner_lrs = nn.ParameterDict({_lr_key(n): nn.Parameter(torch.full_like(params[n],
                                                                                         self.config.inner_lr))
                                               for n in self.fast_names})
        else:
            self.inner_lrs = None
        self._second_order_checked = False
        self.sharded_names = [f"model.{n}" for n, p in model.named_parameters() if getattr(p, "_gmeta_sharded", False)]
        # DDP must neither broadcast nor all-reduce shard parameters: every rank owns different rows.
        self._ddp_params_and_buffers_to_ignore = list(self.sharded_names)
        emb_names = {n for n in params if n not in self.fast_names}
        self.lookup_outside = hasattr(model, "embed") and not any(
            n in self.fast_names for n in params if "embed" in n) and bool(emb_names)
        accepted = inspect.signature(model.forward).parameters
        self._takes_check_ids = "check_ids" in accepted
        if self.lookup_outside and "emb" not in accepted:
            self.lookup_outside = False
        if self.sharded_names and not self.lookup_outside:
            raise InnerLoopError(f"{type(model).__name__} has sharded embeddings but no `embed(sparse)` method; the "
                                 "sharded lookup is a collective and must run outside the vectorised inner loop "
                                 "(give the model `embed(sparse)` and a forward that accepts `emb=`).")

    def _lrs(self) -> dict[str, torch.Tensor | float]:
        if self.inner_lrs is None:
            return {n: self.config.inner_lr for n in self.fast_names}
        return {n: self.inner_lrs[_lr_key(n)] for n in self.fast_names}

    def _inputs(self, sparse: torch.Tensor, dense: torch.Tensor | None, emb: torch.Tensor | None) -> dict:
        inputs: dict = {}
        if emb is not None:
            inputs["emb"] = emb
        else:
            inputs["sparse"] = sparse
            if self._takes_check_ids:
                inputs["check_ids"] = False
        if dense is not None and dense.shape[-1] > 0:
            inputs["dense"] = dense
        return inputs

    def forward(self, sup_sparse: torch.Tensor, sup_y: torch.Tensor, sup_w: torch.Tensor, qry_sparse: torch.Tensor,
                qry_y: torch.Tensor, qry_w: torch.Tensor, sup_dense: torch.Tensor | None = None,
                qry_dense: torch.Tensor | None = None, task_id: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """One meta-step over ``T`` tasks. Returns ``loss`` (mean query loss over tasks, differentiable w.r.t. the
        initial parameters in training mode), ``logits [T, Kq]`` (query logits after adaptation) and
        ``task_losses [T]``."""
        cfg = self.config
        training = self.training
        steps = cfg.inner_steps if training else cfg.eval_inner_steps
        first_order = cfg.first_order or not training
        T, ks = sup_y.shape
        kq = qry_y.shape[1]
        params = dict(self.model.named_parameters())
        if not training:
            params = {k: v.detach() for k, v in params.items()}
        fast = {n: params[n] for n in self.fast_names}
        slow = {n: p for n, p in params.items() if n not in fast}
        lrs = self._lrs()
        if not training:
            lrs = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in lrs.items()}

        with torch.set_grad_enabled(training):
            if self.lookup_outside:
                nf = sup_sparse.shape[-1]
                ids = torch.cat([sup_sparse.reshape(-1, nf), qry_sparse.reshape(-1, nf)])
                emb = self.model.embed(ids)  # one lookup (one all-to-all round trip when sharded) per meta-step
                sup_emb = emb[: T * ks].reshape(T, ks, nf, -1)
                qry_emb = emb[T * ks:].reshape(T, kq, nf, -1)
            else:
                self._check_ids(sup_sparse)
                self._check_ids(qry_sparse)
                sup_emb = qry_emb = None
            sup_in = self._inputs(sup_sparse, sup_dense, sup_emb)
            qry_in = self._inputs(qry_sparse, qry_dense, qry_emb)
            forward = call_with(self.model, slow)
            # Second order through a layer that is only once differentiable silently degrades to first order;
            # detect that once, on one task outside vmap (inside vmap `requires_grad` is not observable).
            check = training and not first_order and torch.is_grad_enabled() and not self._second_order_checked

            def one_task(s_in, s_y, s_w, q_in, q_y, q_w, check=False):
                adapted = adapt(forward, fast, lrs, s_in, s_y, s_w, steps, first_order, cfg.loss, check)
                logits = forward(adapted, q_in)
                return masked_task_loss(logits, q_y, q_w, cfg.loss), logits

            args = (sup_in, sup_y, sup_w, qry_in, qry_y, qry_w)
            try:
                if check:
                    adapt(forward, fast, lrs, _index(sup_in, 0), sup_y[0], sup_w[0], 1, False, cfg.loss, True)
                    self._second_order_checked = True
                if cfg.task_vmap:
                    dims = tuple({k: (None if k == "check_ids" else 0) for k in a} if isinstance(a, dict) else 0
                                 for a in args)
                    losses, logits = torch.vmap(one_task, in_dims=dims)(*args)
                else:
                    outs = [one_task(*(_index(a, t) for a in args)) for t in range(T)]
                    losses = torch.stack([o[0] for o in outs])
                    logits = torch.stack([o[1] for o in outs])
            except InnerLoopError:
                raise
            except RuntimeError as exc:
                if "functorch" in str(exc) or "autograd.Function" in str(exc) or "vmap" in str(exc):
                    raise InnerLoopError(
                        f"the inner loop could not run under torch.func ({exc}). Every layer the support loss "
                        "passes through must support torch.func transforms (custom autograd.Functions need "
                        "`setup_context` and `generate_vmap_rule = True`); set task_vmap=False if only vmap "
                        "fails, or exclude the layer from inner_params.") from exc
                raise
        return {"loss": losses.mean(), "logits": logits, "task_losses": losses}

    def _check_ids(self, ids: torch.Tensor) -> None:
        for mod in self.model.modules():
            if getattr(mod, "is_embedding_collection", False):
                from .models import check_ids_in_range

                check_ids_in_range(ids, mod.vocab_sizes, mod.names)
                return


def _index(a, t: int):
    if isinstance(a, dict):
        return {k: (v[t] if torch.is_tensor(v) else v) for k, v in a.items()}
    return a[t]
