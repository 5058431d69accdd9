"""`MetaTrainer`: `transformers.Trainer` for MAML-family meta-training of recommendation models (G-Meta).

The model the Trainer sees is a `MetaLearner`, whose ``forward`` adapts on every task's support set (vectorised with
``torch.vmap``) and returns the query loss; so DDP gradient sync, accumulation, the optimizer (the outer update),
schedulers, logging and checkpoints are the Trainer's own. What changes:

* ``prediction_step`` returns the query logits *after* adapting on each task's support set (``torch.func.grad``
  ignores the surrounding ``no_grad``, so adaptation works in evaluation while nothing else builds a graph), with
  ``[label, weight]`` as labels; the default ``compute_metrics`` gives pooled and per-user AUC.
* gradient clipping includes row-sharded embedding shards in the global norm (their squared norms are summed over
  ranks), so every rank clips by the same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from .config import MetaTrainingArguments
from .meta_io import collate_tasks
from .meta_learner import MetaLearner
from .metrics import compute_cold_start_metrics

__all__ = ["MetaTrainer"]

logger = logging.get_logger(__name__)


class MetaTrainer(Trainer):
    """Meta-train ``model`` on task records (`build_task_records`) with the Trainer's loop.

    Args:
        model (`nn.Module` or `MetaLearner`): a recommendation model (e.g. `DLRMModel`, optionally with sharded
            embeddings) or an already-built `MetaLearner`; a plain model is wrapped with ``args.inner_loop_config()``.
        args (`MetaTrainingArguments`): training and inner-loop settings.
        train_dataset / eval_dataset (`datasets.Dataset`): task records; ``per_device_*_batch_size`` counts tasks.
        data_collator (*optional*): defaults to `collate_tasks`.
        compute_metrics (*optional*): defaults to `compute_cold_start_metrics` (``auc``, ``user_auc``, ``logloss``).

    Example:

    ```python
    from gmeta_trainer import (DLRMConfig, DLRMModel, MetaIOConfig, MetaTrainer, MetaTrainingArguments,
                               build_task_records, make_synthetic_interactions)

    inter = make_synthetic_interactions(num_users=64)
    tasks = build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                   support_size=10, query_size=10))
    model = DLRMModel(DLRMConfig(vocab_sizes=[100, 8], num_dense=4))
    args = MetaTrainingArguments(output_dir="out", per_device_train_batch_size=16, num_train_epochs=2,
                                 inner_lr=0.5, save_strategy="no")
    MetaTrainer(model=model, args=args, train_dataset=tasks, eval_dataset=tasks).train()
    ```
    """

    _tag_names = ["gmeta", "meta-learning", "maml"]

    def __init__(self, model=None, args: MetaTrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, compute_metrics=None, **kwargs):
        if model is None:
            raise ValueError("MetaTrainer needs a model (e.g. gmeta_trainer.DLRMModel or a MetaLearner).")
        if args is None:
            args = MetaTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, MetaTrainingArguments):
            raise TypeError(f"args must be a MetaTrainingArguments, got {type(args).__name__}; the inner-loop "
                            "settings live there.")
        if not isinstance(model, MetaLearner):
            model = MetaLearner(model, args.inner_loop_config())
        for name, ds in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            cols = getattr(ds, "column_names", None)
            if cols is not None and not {"sup_y", "qry_y", "sup_sparse", "qry_sparse"} <= set(cols):
                raise ValueError(f"{name} has columns {cols}, not task records; build them with "
                                 "gmeta_trainer.build_task_records(interactions, MetaIOConfig(...)).")
        super().__init__(model=model, args=args, data_collator=data_collator or collate_tasks,
                         train_dataset=train_dataset, eval_dataset=eval_dataset,
                         compute_metrics=compute_metrics or compute_cold_start_metrics, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Adapt on the support sets, predict the query sets: ``(loss, logits [T, Kq], labels [T, Kq, 2])``."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            out = model(**inputs)
        loss = out["loss"].detach()
        if prediction_loss_only:
            return loss, None, None
        labels = torch.stack([inputs["qry_y"], inputs["qry_w"]], dim=-1)
        return loss, out["logits"].detach(), labels

    def _sharded_tables(self) -> dict[str, nn.Module]:
        learner = self.accelerator.unwrap_model(self.model)
        return {name: m for name, m in learner.named_modules() if getattr(m, "is_sharded", False)}

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the *unsharded* model: row-sharded tables are gathered (a collective, so every rank runs this; the
        Trainer calls ``_save`` on all ranks) and stored under the unsharded names (``...embeddings.weight``), so the
        checkpoint loads into the plain model for inference or export."""
        tables = self._sharded_tables()
        if tables and state_dict is None and dist.is_initialized():
            full = {name: m.gather_full_weight() for name, m in tables.items()}
            state_dict = {}
            for key, value in self.accelerator.unwrap_model(self.model).state_dict().items():
                owner = key.rsplit(".", 1)[0]
                if owner in full and key.endswith(".local_weight"):
                    state_dict[f"{owner}.weight"] = full[owner].contiguous()
                else:
                    state_dict[key] = value
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._sharded_tables():
            raise NotImplementedError(
                "resuming a run with row-sharded embedding tables from a Trainer checkpoint is not supported: the "
                "checkpoint holds the gathered (unsharded) weights, and the optimizer state of the shards is not "
                "saved per rank. Load the saved weights into the unsharded model and shard it again with "
                "gmeta_trainer.shard_embeddings (optimizer state restarts), or train without sharding to resume.")
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _clip_grad_norm(self, model):
        learner = self.accelerator.unwrap_model(model)
        sharded = [p for p in learner.parameters() if getattr(p, "_gmeta_sharded", False)]
        if not sharded or not dist.is_initialized() or dist.get_world_size() == 1:
            return super()._clip_grad_norm(model)
        # Global norm = dense part (identical on every rank after DDP) + shards (disjoint rows, summed over ranks);
        # the clip factor is then the same on every rank, as in a single process.
        dense = [p for p in learner.parameters() if p.grad is not None and not getattr(p, "_gmeta_sharded", False)]
        dense_sq = sum((p.grad.detach().float().pow(2).sum() for p in dense), torch.zeros(()))
        shard_sq = sum((p.grad.detach().float().pow(2).sum() for p in sharded if p.grad is not None),
                       torch.zeros(()))
        dist.all_reduce(shard_sq)
        total = (dense_sq + shard_sq).sqrt()
        coef = torch.clamp(self.args.max_grad_norm / (total + 1e-6), max=1.0)
        for p in [*dense, *sharded]:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
        return total
