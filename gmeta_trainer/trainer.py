"""`MetaTrainer`: `transformers.Trainer` for MAML-family meta-training of recommendation models (G-Meta).

The model the Trainer sees is a `MetaLearner`, whose ``forward`` adapts on every task's support set (vectorised with
``torch.vmap``) and returns the query loss; so DDP gradient sync, accumulation, the optimizer (the outer update),
schedulers, logging and checkpoints are the Trainer's own. What changes:

* ``prediction_step`` returns the query logits *after* adapting on each task's support set (``torch.func.grad``
  ignores the surrounding ``no_grad``, so adaptation works in evaluation while nothing else builds a graph), with
  ``[label, weight]`` as labels; the default ``compute_metrics`` gives pooled and per-user AUC.
* gradient clipping includes row-sharded embedding shards in the global norm (their squared norms are summed over
  ranks), so every rank clips by the same factor;
* data: the Trainer's own DataLoaders (sampler, sharding, epoch seeding, resume skipping) with their reads moved to
  Meta-IO, Arrow slices of whole tasks on a read-ahead thread (``meta_io_prefetch``, on by default): the same
  batches in the same order, so a run is identical with it off;
* checkpoints with row-sharded tables (`gmeta_trainer.checkpoint`): every rank writes its own rows and their
  optimizer state, ``model.safetensors`` keeps the dense parameters, and ``resume_from_checkpoint`` continues
  exactly on the same world size; `export_consolidated` makes one that loads on any world size.
  ``save_model()`` still writes the whole unsharded model (the tables gathered) for inference.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import logging

from .checkpoint import (
    SHARDS_DIR,
    IncompleteCheckpointError,
    atomic_write,
    dense_state_dict,
    load_checkpoint_weights,
    load_table_optimizer_state,
    save_sharded_tables,
)
from .config import MetaTrainingArguments
from .meta_io import TaskBatchDataset, collate_task_batch, collate_tasks
from .meta_learner import MetaLearner
from .metrics import compute_cold_start_metrics
from .read_ahead import ReadAheadDataLoader, ReadAheadStats, with_read_ahead

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

    Attributes:
        meta_io_stats (`ReadAheadStats`): batches the training loaders handed out through Meta-IO read-ahead and the
            seconds the training step waited for them (zero when ``meta_io_prefetch`` is off).

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
        self.meta_io_stats = ReadAheadStats()
        self._writing_checkpoint = False

    # ---- data: the Trainer's loaders, read through Meta-IO on a read-ahead thread

    def get_train_dataloader(self):
        return self._read_through_meta_io(super().get_train_dataloader(), self.meta_io_stats)

    def get_eval_dataloader(self, eval_dataset=None):
        return self._read_through_meta_io(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset):
        return self._read_through_meta_io(super().get_test_dataloader(test_dataset))

    def _read_through_meta_io(self, loader, stats: ReadAheadStats | None = None):
        """Swap the single-process DataLoader inside accelerate's ``DataLoaderShard`` for one that reads the same
        batch indices (same batch sampler) on a read-ahead thread, through `TaskBatchReader` when the dataset is a
        `datasets.Dataset` with the default collator (otherwise through the dataset and collator given). The shard
        keeps its RNG synchronisation, device placement and end-of-data bookkeeping in the training thread. A
        mid-epoch resume (accelerate's ``skip_first_batches`` rebuilds the loader from this dataset and collate
        function) still reads through `TaskBatchReader`, without the thread for the rest of that epoch."""
        if not self.args.meta_io_prefetch:
            return loader
        from accelerate.data_loader import DataLoaderShard

        base = getattr(loader, "base_dataloader", None)
        if isinstance(base, ReadAheadDataLoader):  # a cached (persistent) eval loader
            return loader
        if self.args.dataloader_num_workers > 0 or type(loader) is not DataLoaderShard or base is None \
                or base.batch_sampler is None:
            logger.info("meta_io_prefetch: reading without the Meta-IO read-ahead thread (it needs "
                        "dataloader_num_workers=0 and a per-rank DataLoaderShard; dispatch_batches loaders "
                        "broadcast every batch, which must stay in the training thread).")
            return loader
        dataset = collate = None
        import datasets

        if base.collate_fn is collate_tasks and isinstance(base.dataset, datasets.Dataset):
            dataset, collate = TaskBatchDataset(base.dataset), collate_task_batch
        loader.base_dataloader = with_read_ahead(base, self.args.meta_io_prefetch_batches, dataset, collate,
                                                 stats=stats)
        return loader

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

    # ---- checkpoints with row-sharded tables

    def _sharded_tables(self) -> dict[str, nn.Module]:
        learner = self.accelerator.unwrap_model(self.model)
        return {name: m for name, m in learner.named_modules() if getattr(m, "is_sharded", False)}

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, with row-sharded tables written per rank (`save_sharded_tables`) instead of
        gathered; the shard files and their index are complete before the Trainer rotates old checkpoints away."""
        self._writing_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._writing_checkpoint = False

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Inside a checkpoint, sharded tables go to per-rank shard files (every rank runs this: the Trainer calls
        ``_save`` on all ranks) and ``model.safetensors`` holds the dense parameters. Otherwise (``save_model()``)
        the tables are gathered (a collective) and stored under their unsharded names (``...embeddings.weight``),
        so the file loads into the plain model for inference or export."""
        tables = self._sharded_tables()
        if tables and state_dict is None and dist.is_initialized():
            learner = self.accelerator.unwrap_model(self.model)
            if self._writing_checkpoint:
                optimizer = None if self.args.save_only_model else self.optimizer
                save_sharded_tables(learner, output_dir or self.args.output_dir, optimizer=optimizer,
                                    step=self.state.global_step)
                state_dict = dense_state_dict(learner)
            else:
                full = {name: m.gather_full_weight() for name, m in tables.items()}
                state_dict = {}
                for key, value in learner.state_dict().items():
                    owner = key.rsplit(".", 1)[0]
                    if owner in full and key.endswith(".local_weight"):
                        state_dict[f"{owner}.weight"] = full[owner].contiguous()
                    else:
                        state_dict[key] = value
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """With sharded tables, ``optimizer.pt`` holds the dense parameters' state only (the rows' state is in the
        shard files), written atomically like the scheduler."""
        if not self._sharded_tables() or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        if not self.args.should_save:
            return
        learner = self.accelerator.unwrap_model(self.model)
        sharded = {id(p) for p in learner.parameters() if getattr(p, "_gmeta_sharded", False)}
        state = self.optimizer.state_dict()
        # state_dict() numbers parameters in param_groups order; drop the sharded ones' entries
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        drop = {i for i, p in enumerate(order) if id(p) in sharded}
        state["state"] = {i: v for i, v in state["state"].items() if i not in drop}
        atomic_write(os.path.join(output_dir, OPTIMIZER_NAME), lambda tmp: torch.save(state, tmp))
        with warnings.catch_warnings():  # as the Trainer: the optimizer *is* saved, just above
            warnings.filterwarnings("ignore", message=".*state of the optimizer.*")
            scheduler_state = self.lr_scheduler.state_dict()
        atomic_write(os.path.join(output_dir, SCHEDULER_NAME), lambda tmp: torch.save(scheduler_state, tmp))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        learner = self.accelerator.unwrap_model(model if model is not None else self.model)
        if (Path(resume_from_checkpoint) / SHARDS_DIR).is_dir():
            if not (Path(resume_from_checkpoint) / TRAINER_STATE_NAME).is_file():
                raise IncompleteCheckpointError(
                    f"{resume_from_checkpoint} has no {TRAINER_STATE_NAME}: the save was interrupted before the "
                    "Trainer finished it. Resume from an earlier checkpoint.")
            load_checkpoint_weights(learner, resume_from_checkpoint, resume=True)
            logger.info(f"Loaded dense parameters and sharded-table rows from {resume_from_checkpoint}.")
            return
        if self._sharded_tables():
            raise NotImplementedError(
                f"{resume_from_checkpoint} was saved without sharded tables (no {SHARDS_DIR}/), and this model has "
                "row-sharded tables. Resume it with the unsharded model it was saved from, or load its weights into "
                "the unsharded model and shard that with gmeta_trainer.shard_embeddings (the optimizer state then "
                "restarts).")
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and (Path(checkpoint) / SHARDS_DIR).is_dir() and self.optimizer is not None:
            learner = self.accelerator.unwrap_model(self.model)
            load_table_optimizer_state(learner, self.optimizer, checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is not None and (Path(best) / SHARDS_DIR).is_dir():
            logger.info(f"Loading best model from {best} (score: {self.state.best_metric}).")
            load_checkpoint_weights(self.accelerator.unwrap_model(self.model), best)
            return
        super()._load_best_model()

    def _clip_grad_norm(self, model):
        learner = self.accelerator.unwrap_model(model)
        sharded = [p for p in learner.parameters() if getattr(p, "_gmeta_sharded", False)]
        if not sharded or not dist.is_initialized() or dist.get_world_size() == 1:
            return super()._clip_grad_norm(model)
        # Global norm = dense part (identical on every rank after DDP) + shards (disjoint rows, summed over ranks);
        # the clip factor is then the same on every rank, as in a single process.
        dense = [p for p in learner.parameters() if p.grad is not None and not getattr(p, "_gmeta_sharded", False)]
        device = sharded[0].device  # where the shards live is where the collective below runs
        dense_sq = sum((_squared_norm(p.grad) for p in dense), torch.zeros((), device=device))
        shard_sq = sum((_squared_norm(p.grad) for p in sharded if p.grad is not None), torch.zeros((), device=device))
        dist.all_reduce(shard_sq)
        total = (dense_sq + shard_sq).sqrt()
        coef = torch.clamp(self.args.max_grad_norm / (total + 1e-6), max=1.0)
        for p in [*dense, *sharded]:
            if p.grad is None:
                continue
            # in place on the values: `mul_` on a detached alias of a sparse tensor rebinds the alias's values and
            # leaves the gradient unscaled
            (p.grad._values() if p.grad.is_sparse else p.grad).detach().mul_(coef.to(p.grad.dtype))
        return total


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """``||grad||²`` in fp32; a sparse gradient (``sparse_grad`` tables) is coalesced first, since its repeated
    rows add up before they are squared."""
    grad = grad.detach()
    if grad.is_sparse:
        grad = grad.coalesce().values()
    return grad.float().pow(2).sum()
