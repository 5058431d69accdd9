"""gmeta_trainer: G-Meta-style distributed meta-learning for recommendation models on the Hugging Face Trainer.

Paper: G-Meta: Distributed Meta Learning in GPU Clusters for Large-Scale Recommender Systems (Xiao et al., CIKM 2023,
arXiv 2401.04338). Pieces:

* `MetaTrainingArguments` / `MetaTrainer`: MAML-family inner loop vectorised over tasks with ``torch.func``, outer
  update by the Trainer's optimizer, evaluation that adapts on every task's support set.
* `DLRMModel` and `RowShardedEmbeddingCollection` (row-sharded tables, ``all_to_all_single`` lookups).
* Meta-IO: `build_task_records` (task-grouped, padded, Arrow / memory-mapped), `TaskBatchReader` (Arrow slices of
  whole tasks), `TaskPrefetcher` and `ReadAhead` (reading on a background thread); `MetaTrainer` reads through them.
* Checkpoints of sharded tables: per-rank shard files (rows and their optimizer state) that resume on the same world
  size, `export_consolidated` (one part, loads on any world size), `load_checkpoint_weights`.
* Data: `movielens_cold_start` (MovieLens-100K, newest users held out) and `make_synthetic_interactions`.
"""

from .baselines import evaluate_on_tasks, train_global_model
from .checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    load_checkpoint_weights,
    load_table_optimizer_state,
    save_sharded_tables,
)
from .data import (
    GENRES,
    ColdStartData,
    encode_categorical,
    load_movielens_100k,
    make_synthetic_interactions,
    movielens_cold_start,
)
from .export import export_consolidated
from .inner_loop import InnerLoopConfig, InnerLoopError, masked_task_loss, select_inner_params
from .meta_io import (
    MetaIOConfig,
    TaskBatchDataset,
    TaskBatchReader,
    TaskPrefetcher,
    build_task_records,
    collate_task_batch,
    collate_tasks,
    load_task_records,
)
from .meta_learner import MetaLearner
from .metrics import binary_auc, cold_start_metrics, compute_cold_start_metrics
from .models import DLRMConfig, DLRMModel, EmbeddingCollection, check_ids_in_range
from .read_ahead import ReadAhead, ReadAheadDataLoader, ReadAheadError, ReadAheadStats
from .sharded_embedding import RowShardedEmbeddingCollection, shard_embeddings


def __getattr__(name: str):
    # The Trainer integration imports transformers (seconds); the engine, Meta-IO and data do not need it.
    if name == "MetaTrainer":
        from .trainer import MetaTrainer

        return MetaTrainer
    if name == "MetaTrainingArguments":
        from .config import MetaTrainingArguments

        return MetaTrainingArguments
    raise AttributeError(f"module 'gmeta_trainer' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "ColdStartData",
    "CorruptCheckpointError",
    "DLRMConfig",
    "DLRMModel",
    "EmbeddingCollection",
    "GENRES",
    "IncompleteCheckpointError",
    "InnerLoopConfig",
    "InnerLoopError",
    "MetaIOConfig",
    "MetaLearner",
    "MetaTrainer",
    "MetaTrainingArguments",
    "ReadAhead",
    "ReadAheadDataLoader",
    "ReadAheadError",
    "ReadAheadStats",
    "RowShardedEmbeddingCollection",
    "TaskBatchDataset",
    "TaskBatchReader",
    "TaskPrefetcher",
    "binary_auc",
    "build_task_records",
    "check_ids_in_range",
    "cold_start_metrics",
    "collate_task_batch",
    "collate_tasks",
    "compute_cold_start_metrics",
    "encode_categorical",
    "evaluate_on_tasks",
    "export_consolidated",
    "load_checkpoint_weights",
    "load_movielens_100k",
    "load_table_optimizer_state",
    "load_task_records",
    "make_synthetic_interactions",
    "masked_task_loss",
    "movielens_cold_start",
    "save_sharded_tables",
    "select_inner_params",
    "shard_embeddings",
    "train_global_model",
]
