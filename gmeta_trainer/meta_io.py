"""Meta-IO: task-consistent records and a loader that prefetches whole tasks.

G-Meta's point about I/O: a meta-batch is a set of *tasks*, each needing its support and query sets together, so a
generic sample-level pipeline ends up grouping interactions by task at step time. Here the grouping, the
support/query split, the padding and the masks happen **once, offline** (`build_task_records`), and the result is
one fixed-shape Arrow row per task, memory-mapped after `save_to_disk`/`load_from_disk`. Reading a meta-batch is then
a slice of an Arrow table; `TaskPrefetcher` does it in a background thread so the training step does not wait.

Record layout (``Ks`` = ``max_support_size``, ``Kq`` = ``query_size``, ``F`` sparse, ``D`` dense features):
``task_id`` int64, ``num_support`` int64, ``sup_sparse [Ks, F]`` int64, ``sup_dense [Ks, D]`` float32,
``sup_y [Ks]`` float32, ``sup_w [Ks]`` float32 (1 = real example, 0 = padding), and the same ``qry_*`` with ``Kq``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .read_ahead import ReadAhead, ReadAheadStats

__all__ = ["MODEL_KEYS", "MetaIOConfig", "TaskBatchDataset", "TaskBatchReader", "TaskPrefetcher",
           "build_task_records", "collate_task_batch", "collate_tasks", "load_task_records"]

MODEL_KEYS = ("sup_sparse", "sup_dense", "sup_y", "sup_w", "qry_sparse", "qry_dense", "qry_y", "qry_w")


@dataclass
class MetaIOConfig:
    """How interactions become task records.

    Parameters:
        task_column (`str`, defaults to `"user_id"`): column whose values define the tasks (one task per value).
        label_column (`str`, defaults to `"label"`): target (0/1 for bce, a rating for mse).
        sparse_columns (`list[str]`): integer-coded categorical columns (one embedding table each).
        dense_columns (`list[str]`): real-valued columns; scalars or fixed-length lists, concatenated in order.
        time_column (`str`, *optional*, defaults to `"timestamp"`): order for ``split="time"``.
        support_size (`int`, defaults to 10): minimum support examples of a task.
        query_size (`int`, defaults to 10): query examples of a task (exactly this many).
        max_support_size (`int`, *optional*): support slots per record; tasks with more than ``support_size`` use
            up to this many (the most recent ones for a time split), the rest of the slots are padded with ``w = 0``.
            Defaults to ``support_size`` (fixed-size support).
        split (`str`, defaults to `"time"`): `"time"` (the newest ``query_size`` interactions are the query, the
            ones before them the support) or `"random"` (seeded per-task permutation).
        seed (`int`, defaults to 0): seed of the random split.
        small_tasks (`str`, defaults to `"error"`): what to do with tasks having fewer than
            ``support_size + query_size`` interactions: `"error"` or `"drop"`.
    """

    task_column: str = field(default="user_id", metadata={"help": "Column that defines the tasks."})
    label_column: str = field(default="label", metadata={"help": "Target column."})
    sparse_columns: list[str] = field(default_factory=list, metadata={"help": "Integer-coded categorical columns."})
    dense_columns: list[str] = field(default_factory=list, metadata={"help": "Real-valued (scalar or list) columns."})
    time_column: str | None = field(default="timestamp", metadata={"help": "Column ordering a time split."})
    support_size: int = field(default=10, metadata={"help": "Minimum support examples per task."})
    query_size: int = field(default=10, metadata={"help": "Query examples per task."})
    max_support_size: int | None = field(default=None, metadata={"help": "Support slots per record (padding)."})
    split: str = field(default="time", metadata={"help": "'time' or 'random'."})
    seed: int = field(default=0, metadata={"help": "Seed of the random split."})
    small_tasks: str = field(default="error", metadata={"help": "'error' or 'drop' tasks that are too small."})

    def __post_init__(self):
        if self.support_size < 1 or self.query_size < 1:
            raise ValueError(f"support_size={self.support_size} and query_size={self.query_size} must both be >= 1.")
        if self.max_support_size is None:
            self.max_support_size = self.support_size
        if self.max_support_size < self.support_size:
            raise ValueError(f"max_support_size={self.max_support_size} is smaller than support_size="
                             f"{self.support_size}; it is the number of padded slots, so it must be >= support_size.")
        if self.split not in ("time", "random"):
            raise ValueError(f"split={self.split!r} must be 'time' or 'random'.")
        if self.split == "time" and not self.time_column:
            raise ValueError("split='time' needs time_column; set time_column or use split='random'.")
        if self.small_tasks not in ("error", "drop"):
            raise ValueError(f"small_tasks={self.small_tasks!r} must be 'error' or 'drop'.")
        if not self.sparse_columns and not self.dense_columns:
            raise ValueError("MetaIOConfig needs at least one feature column: set sparse_columns and/or "
                             "dense_columns.")


def _column(table, name: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    col = table.column(name).combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        return flat.reshape(len(col), -1) if len(col) else flat.reshape(0, 0)
    return col.to_numpy(zero_copy_only=False)


def build_task_records(interactions, config: MetaIOConfig, output_dir: str | None = None):
    """Group ``interactions`` (a `datasets.Dataset`, one row per interaction) into one fixed-shape record per task.

    Returns a `datasets.Dataset` of task records (see the module docstring), memory-mapped from ``output_dir`` when
    given (written with ``save_to_disk``), in memory otherwise. Task order is sorted by task id; shuffle at load time.

    Raises:
        `KeyError`: a configured column is missing (the message lists the available ones).
        `ValueError`: tasks with fewer than ``support_size + query_size`` interactions and ``small_tasks="error"``.
    """
    import datasets

    # an Arrow table of exactly the visible rows (a `select`-ed Dataset keeps an indices mapping over the full table)
    table = interactions.with_format("arrow")[:] if hasattr(interactions, "with_format") else interactions
    names = list(table.column_names)
    needed = [config.task_column, config.label_column, *config.sparse_columns, *config.dense_columns]
    if config.split == "time":
        needed.append(config.time_column)
    missing = [c for c in needed if c not in names]
    if missing:
        what = "task column" if config.task_column in missing else "column(s)"
        raise KeyError(f"{what} {missing} not found in the interactions; available columns: {names}. Set "
                       "MetaIOConfig.task_column/label_column/sparse_columns/dense_columns to existing names.")

    task = _column(table, config.task_column)
    y = _column(table, config.label_column).astype(np.float32)
    sparse = (np.stack([_column(table, c).astype(np.int64) for c in config.sparse_columns], axis=1)
              if config.sparse_columns else np.zeros((len(task), 0), np.int64))
    dense_parts = [_column(table, c).astype(np.float32).reshape(len(task), -1) for c in config.dense_columns]
    dense = np.concatenate(dense_parts, axis=1) if dense_parts else np.zeros((len(task), 0), np.float32)

    rng = np.random.default_rng(config.seed)
    if config.split == "time":
        key = _column(table, config.time_column).astype(np.float64)
    else:
        key = rng.random(len(task))
    # stable order within a task: by key, ties broken by original row order
    order = np.lexsort((np.arange(len(task)), key, task))
    task_sorted = task[order]
    uniq, starts, counts = np.unique(task_sorted, return_index=True, return_counts=True)
    need = config.support_size + config.query_size
    small = counts < need
    if small.any():
        examples = ", ".join(f"{uniq[i].item()!r} ({counts[i]})" for i in np.flatnonzero(small)[:5])
        if config.small_tasks == "error":
            raise ValueError(f"{int(small.sum())} of {len(uniq)} tasks (column {config.task_column!r}) have fewer "
                             f"than support_size + query_size = {config.support_size} + {config.query_size} = {need} "
                             f"interactions, e.g. {examples}. Lower support_size/query_size, filter those tasks "
                             "out, or set MetaIOConfig.small_tasks='drop'.")
    keep = np.flatnonzero(~small)
    ks, kq, nf, nd = config.max_support_size, config.query_size, sparse.shape[1], dense.shape[1]
    n = len(keep)
    rec = {
        "sup_sparse": np.zeros((n, ks, nf), np.int64), "sup_dense": np.zeros((n, ks, nd), np.float32),
        "sup_y": np.zeros((n, ks), np.float32), "sup_w": np.zeros((n, ks), np.float32),
        "qry_sparse": np.zeros((n, kq, nf), np.int64), "qry_dense": np.zeros((n, kq, nd), np.float32),
        "qry_y": np.zeros((n, kq), np.float32), "qry_w": np.ones((n, kq), np.float32),
    }
    num_support = np.zeros(n, np.int64)
    for j, i in enumerate(keep):
        rows = order[starts[i]: starts[i] + counts[i]]
        q, s = rows[-kq:], rows[:-kq]
        if config.split == "random":
            q, s = rows[:kq], rows[kq:]
        s = s[-ks:]  # the most recent support interactions (time split) / a random subset (random split)
        m = len(s)
        num_support[j] = m
        rec["sup_sparse"][j, :m], rec["sup_dense"][j, :m] = sparse[s], dense[s]
        rec["sup_y"][j, :m], rec["sup_w"][j, :m] = y[s], 1.0
        rec["qry_sparse"][j], rec["qry_dense"][j], rec["qry_y"][j] = sparse[q], dense[q], y[q]

    feats = datasets.Features({
        "task_id": datasets.Value("int64") if np.issubdtype(uniq.dtype, np.integer) else datasets.Value("string"),
        "num_support": datasets.Value("int64"),
        "sup_sparse": datasets.Array2D((ks, nf), "int64"), "sup_dense": datasets.Array2D((ks, nd), "float32"),
        "sup_y": datasets.Sequence(datasets.Value("float32"), length=ks),
        "sup_w": datasets.Sequence(datasets.Value("float32"), length=ks),
        "qry_sparse": datasets.Array2D((kq, nf), "int64"), "qry_dense": datasets.Array2D((kq, nd), "float32"),
        "qry_y": datasets.Sequence(datasets.Value("float32"), length=kq),
        "qry_w": datasets.Sequence(datasets.Value("float32"), length=kq),
    })
    task_ids = uniq[keep]
    data = {"task_id": task_ids if feats["task_id"].dtype == "int64" else task_ids.astype(str),
            "num_support": num_support, **rec}
    ds = datasets.Dataset.from_dict(data, features=feats)
    if output_dir is not None:
        ds.save_to_disk(output_dir)
        return load_task_records(output_dir)
    return ds


def load_task_records(path: str):
    """Memory-map task records written by `build_task_records` (``output_dir``)."""
    import datasets

    return datasets.load_from_disk(path)


def collate_tasks(records: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack task records (dicts of arrays/tensors/lists) into the batch `MetaLearner.forward` takes."""
    if not records:
        raise ValueError("collate_tasks got an empty list of task records.")
    missing = [k for k in ("sup_sparse", "sup_y", "sup_w", "qry_sparse", "qry_y", "qry_w") if k not in records[0]]
    if missing:
        raise KeyError(f"task records lack {missing}; build them with gmeta_trainer.build_task_records "
                       f"(record keys found: {sorted(records[0])}).")
    out: dict[str, torch.Tensor] = {}
    for k in (*MODEL_KEYS, "task_id"):
        if k not in records[0] or isinstance(records[0][k], str):
            continue
        dtype = np.int64 if k.endswith("sparse") or k == "task_id" else np.float32
        out[k] = torch.from_numpy(np.stack([np.asarray(r[k], dtype=dtype) for r in records]))
    return out


def _flatten_arrow(col) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if isinstance(col.type, pa.ExtensionType):  # datasets' Array2D stores nested lists
        col = col.storage
    while pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        col = pc.list_flatten(col)
    return col.to_numpy(zero_copy_only=False)


class TaskBatchReader:
    """Read meta-batches of task records as Arrow slices: columns are flattened and reshaped in bulk, skipping the
    per-row Python decoding a `DataLoader` + `collate_tasks` does. ``read(idx)`` equals
    ``collate_tasks([records[i] for i in idx])`` exactly, tasks in the order of ``idx``.

    Args:
        records (`datasets.Dataset`): task records (`build_task_records`).
    """

    def __init__(self, records):
        self.records = records.with_format("arrow")
        first = records.with_format("numpy")[0]
        # per-record shapes and dtypes of the numeric model inputs (a string task_id stays out, as in collate_tasks)
        self._shapes = {k: (np.asarray(first[k]).shape, np.asarray(first[k]).dtype) for k in (*MODEL_KEYS, "task_id")
                        if k in first and np.asarray(first[k]).dtype.kind in "iuf"}

    def __len__(self) -> int:
        return len(self.records)

    def read(self, idx: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        idx = np.asarray(idx, dtype=np.int64)
        # read in ascending order (contiguous Arrow slices), then put the tasks back in the requested order
        sorted_idx = np.sort(idx)
        back = np.searchsorted(sorted_idx, idx)
        table = self.records[sorted_idx.tolist()]
        out = {}
        for k, (shape, dtype) in self._shapes.items():
            flat = _flatten_arrow(table.column(k)).reshape(len(idx), *shape)
            out[k] = torch.from_numpy(np.ascontiguousarray(flat[back], dtype=dtype))  # a writable copy
        return out


class TaskBatchDataset(torch.utils.data.Dataset):
    """Map-style view of task records whose ``__getitems__`` returns a whole collated meta-batch through
    `TaskBatchReader`; pair it with `collate_task_batch`. This is how a `DataLoader` (the Trainer's, with its
    sampler and sharding) reads through Meta-IO: batches equal those of ``records`` + `collate_tasks`."""

    def __init__(self, records):
        self.records = records
        self.reader = TaskBatchReader(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return self.records[int(i)]

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.reader.read(indices)


def collate_task_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collate function of `TaskBatchDataset`: its ``__getitems__`` already returns the collated batch."""
    return batch


class TaskPrefetcher:
    """Iterate meta-batches of whole tasks from task records, read by a background thread ``prefetch`` batches
    ahead (`TaskBatchReader` on a `ReadAhead` thread), so the training step does not wait on I/O.

    ``wait_seconds`` accumulates the time the consumer spent blocked waiting for a batch (the data-wait). An error in
    the reader thread reaches the consumer as a `ReadAheadError` naming the batch, with the original as its cause;
    a loop that stops early leaves no thread behind once the iterator is dropped.

    Args:
        records (`datasets.Dataset`): task records (`build_task_records`).
        tasks_per_batch (`int`): tasks per meta-batch.
        shuffle (`bool`), seed (`int`): task order per epoch.
        prefetch (`int`, defaults to 4): batches read ahead.
        drop_last (`bool`, defaults to `True`): drop a last incomplete meta-batch (vmap batches keep one shape).
        rank (`int`), world_size (`int`): read only this rank's share of every epoch (strided over batches).
        epochs (`int`, defaults to 1): passes over the records per iteration.
        timeout (`float`, *optional*, defaults to 120): seconds to wait for one batch before raising `TimeoutError`.
    """

    def __init__(self, records, tasks_per_batch: int, shuffle: bool = True, seed: int = 0, prefetch: int = 4,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1, epochs: int = 1,
                 timeout: float | None = 120.0):
        if tasks_per_batch < 1:
            raise ValueError(f"tasks_per_batch={tasks_per_batch} must be >= 1.")
        if prefetch < 1:
            raise ValueError(f"prefetch={prefetch} must be >= 1.")
        self.reader = TaskBatchReader(records)
        self.records = self.reader.records
        self.tasks_per_batch, self.shuffle, self.seed = tasks_per_batch, shuffle, seed
        self.prefetch, self.drop_last, self.rank, self.world_size = prefetch, drop_last, rank, world_size
        self.epochs, self.timeout = epochs, timeout
        self.stats = ReadAheadStats()

    @property
    def wait_seconds(self) -> float:
        return self.stats.wait_seconds

    @property
    def batches_served(self) -> int:
        return self.stats.items

    def _batches(self) -> list[np.ndarray]:
        out = []
        n = len(self.records)
        for epoch in range(self.epochs):
            idx = (np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n))
            cut = n - n % self.tasks_per_batch if self.drop_last else n
            batches = [idx[i: i + self.tasks_per_batch] for i in range(0, cut, self.tasks_per_batch)]
            usable = len(batches) - len(batches) % self.world_size
            out.extend(batches[self.rank: usable: self.world_size])
        return out

    def __len__(self) -> int:
        return len(self._batches())

    def _read(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return self.reader.read(idx)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = self._batches()
        reader = ReadAhead((self._read(idx) for idx in batches), self.prefetch, name="gmeta-task-prefetch",
                           timeout=self.timeout, stats=self.stats)
        try:
            yield from reader
        finally:
            reader.close()
