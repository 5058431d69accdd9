"""Checkpoints of row-sharded embedding tables: per-rank shard files that resume on the same world size, and a
consolidated export that loads (and resumes) on any world size.

Why per-rank files: a table is sharded because it should not sit whole on one rank, so saving it must not gather it
either. Every rank writes its own rows and the optimizer state of those rows; the dense parameters, replicated by
data parallelism, are written once. Layout of a checkpoint directory (the Trainer's files plus ``gmeta_shards/``)::

    model.safetensors                                dense parameters (no sharded table)
    optimizer.pt                                     optimizer state of the dense parameters
    gmeta_shards/rank-00000-of-00002.safetensors     rank 0's rows of every sharded table: "<table>.weight" and
                                                     "<table>.optim.<key>" (e.g. exp_avg, exp_avg_sq, step)
    gmeta_shards/rank-00001-of-00002.safetensors
    gmeta_shards/index.json                          world size, tables (vocab sizes, width, rows), the row
                                                     partition and each part's rows, step, bytes and sha256 of
                                                     every file; written last: a shard set without it is incomplete

A consolidated export (`export_consolidated`) has one part: its ``model.safetensors`` holds the dense parameters and
the full tables under their unsharded names ("<table>.weight"), so the unsharded model loads it as is, and its only
shard file holds the optimizer state of all rows. A checkpoint whose rows sit in one part (an export, or a run of one
rank) resumes on any world size; per-rank shards resume only on the world size that wrote them, because the optimizer
state, the RNG states and the data position are per rank (their weights alone load anywhere,
`load_checkpoint_weights`).

Row partition ("contiguous", `RowShardedEmbeddingCollection`): the ``R`` rows of a table (all fields stacked) are cut
into ``W`` blocks of ``ceil(R / W)`` rows; rank ``r`` holds rows ``[r * ceil(R / W), min((r + 1) * ceil(R / W), R))``.

Every file written here goes to a temporary name in its directory and is renamed into place, so a crash mid-save
leaves the previous file or none; a checkpoint is a new directory, and `MetaTrainer` writes the shard index before
the Trainer rotates old checkpoints away, so a crash mid-save never costs an earlier checkpoint. An export is built
in a temporary directory renamed at the end.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._checkpoint_files import atomic_write, save_tensors, sha256_of, write_json
from .meta_learner import MetaLearner

__all__ = [
    "INDEX_NAME",
    "SHARDS_DIR",
    "CheckpointError",
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "ShardReader",
    "atomic_write",
    "dense_state_dict",
    "has_sharded_tables",
    "load_checkpoint_weights",
    "load_table_optimizer_state",
    "read_index",
    "save_sharded_tables",
]

SHARDS_DIR = "gmeta_shards"
INDEX_NAME = "index.json"
MODEL_NAME = "model.safetensors"
FORMAT = "gmeta_trainer.sharded_tables"
VERSION = 1
_LEARNER_PREFIX = "model."  # MetaLearner keeps the recommendation model under `.model`


class CheckpointError(RuntimeError):
    """A sharded-table checkpoint cannot be used; the message names the file or setting and the fix."""


class IncompleteCheckpointError(CheckpointError):
    """A file the checkpoint needs is missing (an interrupted save, or shards not copied together)."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, altered or unreadable (its size or sha256 differs from the index)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or the run: table shapes, names, or the world size of per-rank shards."""


# ---------------------------------------------------------------------------------------------------- tables
@dataclass
class _Table:
    name: str  # module name without the MetaLearner prefix, e.g. "embeddings"
    module: nn.Module
    param: nn.Parameter  # this process's rows: `local_weight` (sharded) or `weight` (replicated)
    start: int
    end: int
    world: int  # parts of this model's partition (1: the process holds every row)
    rank: int
    param_name: str  # key of `param` in model.state_dict()

    @property
    def rows(self) -> int:
        return sum(self.module.vocab_sizes)


def _prefix_of(model: nn.Module) -> str:
    return _LEARNER_PREFIX if isinstance(model, MetaLearner) else ""


def _tables(model: nn.Module, sharded_only: bool) -> dict[str, _Table]:
    prefix = _prefix_of(model)
    out = {}
    for name, module in model.named_modules():
        if not getattr(module, "is_embedding_collection", False):
            continue
        bare = name[len(prefix):] if prefix and name.startswith(prefix) else name
        if getattr(module, "is_sharded", False):
            out[bare] = _Table(bare, module, module.local_weight, module.row_start, module.row_end, module.world,
                               module.rank, f"{name}.local_weight")
        elif not sharded_only:
            out[bare] = _Table(bare, module, module.weight, 0, module.num_rows, 1, 0, f"{name}.weight")
    return out


def has_sharded_tables(model: nn.Module) -> bool:
    """Whether ``model`` holds row-sharded embedding tables (`RowShardedEmbeddingCollection`)."""
    return bool(_tables(model, sharded_only=True))


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the rows of sharded tables (those go to the per-rank shard files)."""
    sharded = {t.param_name for t in _tables(model, sharded_only=True).values()}
    return {k: v for k, v in model.state_dict().items() if k not in sharded}


def _optimizer_state(optimizer) -> dict:
    return optimizer.state  # torch optimizers and accelerate's AcceleratedOptimizer (a property) alike


# ---------------------------------------------------------------------------------------------------- save
def save_sharded_tables(model: nn.Module, output_dir: str | os.PathLike, optimizer=None, step: int = 0) -> dict:
    """Write this rank's rows of every sharded table of ``model`` (and, with ``optimizer``, their optimizer state)
    to ``output_dir/gmeta_shards/``; rank 0 then writes ``index.json``. A collective: every rank of the tables'
    group calls it. Returns the index.

    Raises:
        `CheckpointError`: some rank could not write its file (the message names the rank and the cause); no index
            is written, so the shard set stays recognisably incomplete.
    """
    tables = _tables(model, sharded_only=True)
    if not tables:
        raise ValueError("save_sharded_tables found no sharded embedding table in the model; save an unsharded model "
                         "with its state_dict (or trainer.save_model()).")
    groups = {id(t.module.group) for t in tables.values()}
    if len(groups) != 1:
        raise NotImplementedError("sharded tables on different process groups are not supported by the checkpoint "
                                  "format (one partition per checkpoint); shard every table over the same group.")
    first = next(iter(tables.values()))
    group, world, rank = first.module.group, first.world, first.rank
    shard_dir = os.path.join(os.fspath(output_dir), SHARDS_DIR)
    file = f"{SHARDS_DIR}/rank-{rank:05d}-of-{world:05d}.safetensors"
    state = _optimizer_state(optimizer) if optimizer is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for t in tables.values():
        tensors[f"{t.name}.weight"] = t.param.detach().cpu().contiguous()
        for key, value in state.get(t.param, {}).items():
            if not torch.is_tensor(value):
                raise NotImplementedError(f"optimizer state {key!r} of table {t.name!r} is a {type(value).__name__}, "
                                          "not a tensor; only tensor state (Adam, AdamW, SGD momentum, ...) is "
                                          "saved per rank.")
            kinds[key] = "rows" if tuple(value.shape) == tuple(t.param.shape) else "replicated"
            tensors[f"{t.name}.optim.{key}"] = value.detach().cpu().contiguous()
    report: dict[str, Any] = {"rank": rank, "file": file, "rows": {t.name: [t.start, t.end] for t in tables.values()},
                              "optimizer_state": kinds}
    try:
        os.makedirs(shard_dir, exist_ok=True)
        report.update(save_tensors(tensors, os.path.join(os.fspath(output_dir), file)))
    except Exception as exc:  # noqa: BLE001 - reported to every rank below, then raised
        report["error"] = f"{type(exc).__name__}: {exc}"
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report, group=group)  # bounded by the process group's timeout
    failed = [r for r in reports if "error" in r]
    if failed:
        r = failed[0]
        raise CheckpointError(f"rank {r['rank']} could not write {r['file']} in {output_dir}: {r['error']}. The "
                              f"shard set there has no {INDEX_NAME} and is not resumable; earlier checkpoints are "
                              "untouched.")
    kinds_seen = {json.dumps(r["optimizer_state"], sort_keys=True) for r in reports}
    if len(kinds_seen) > 1:
        raise CheckpointError("the ranks hold different optimizer state keys for their table rows "
                              f"({sorted(kinds_seen)}); save after an optimizer step on every rank.")
    index = {
        "format": FORMAT, "version": VERSION, "world_size": world, "consolidated": False, "step": int(step),
        "prefix": _prefix_of(model),
        "partition": {"rule": "contiguous",
                      "doc": "rank r holds rows [r*ceil(R/W), min((r+1)*ceil(R/W), R)) of every table"},
        "tables": {t.name: {"vocab_sizes": list(t.module.vocab_sizes), "names": list(t.module.names),
                            "embedding_dim": int(t.module.embedding_dim), "rows": t.rows,
                            "dtype": str(t.param.dtype).removeprefix("torch.")} for t in tables.values()},
        "optimizer_state": reports[0]["optimizer_state"],
        "parts": sorted(reports, key=lambda r: r["rank"]),
    }
    for part in index["parts"]:
        part.pop("optimizer_state")
    if rank == 0:
        write_json(index, os.path.join(shard_dir, INDEX_NAME))
    dist.barrier(group=group)  # the index exists for every rank once this returns
    return index


# ---------------------------------------------------------------------------------------------------- read
def _siblings_with_index(checkpoint_dir: Path) -> list[str]:
    parent = checkpoint_dir.parent
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir()
                  if p != checkpoint_dir and (p / SHARDS_DIR / INDEX_NAME).is_file())


def read_index(checkpoint_dir: str | os.PathLike) -> dict:
    """The ``gmeta_shards/index.json`` of a checkpoint, checked for format and for the files it lists.

    Raises:
        `IncompleteCheckpointError`: no index (an interrupted save) or a listed file is missing.
        `CorruptCheckpointError`: the index is not valid JSON, or a file's size differs from the index (truncated).
        `CheckpointError`: not a sharded-table checkpoint of a version this code reads.
    """
    root = Path(checkpoint_dir)
    path = root / SHARDS_DIR / INDEX_NAME
    if not path.is_file():
        if not root.is_dir():
            raise IncompleteCheckpointError(f"checkpoint directory {root} does not exist.")
        if (root / SHARDS_DIR).is_dir():
            others = _siblings_with_index(root)
            hint = f" Complete checkpoints next to it: {others}." if others else ""
            raise IncompleteCheckpointError(
                f"{root / SHARDS_DIR} has no {INDEX_NAME}: the save was interrupted before every rank finished "
                f"writing its shard, so this checkpoint cannot be used. Resume from an earlier checkpoint.{hint}")
        raise CheckpointError(f"{root} is not a sharded-table checkpoint (no {SHARDS_DIR}/{INDEX_NAME}); it was "
                              "saved without sharded tables. Load it with the unsharded model.")
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({exc}); the file is corrupt. Resume from an "
                                     "earlier checkpoint.") from exc
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CheckpointError(f"{path} has format {index.get('format')!r} version {index.get('version')!r}; this "
                              f"gmeta_trainer reads {FORMAT!r} version {VERSION}.")
    for part in index["parts"]:
        _check_file(root, part["file"], part, f"the shard of rank {part['rank']}", index["world_size"])
    for spec in index["tables"].values():
        if "weights" in spec:
            _check_file(root, spec["weights"]["file"], spec["weights"], "the consolidated tables", 1)
    return index


def _check_file(root: Path, rel: str, meta: dict, what: str, world: int) -> None:
    path = root / rel
    if not path.is_file():
        where = (" Per-rank shards are written by each rank into its own output_dir: with no shared filesystem, copy "
                 f"every rank's {SHARDS_DIR}/ files into one checkpoint directory.") if world > 1 else ""
        raise IncompleteCheckpointError(f"{path} ({what}) is missing; the checkpoint is incomplete.{where} Or "
                                        "resume from an earlier checkpoint.")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise CorruptCheckpointError(f"{path} ({what}) has {size} bytes, the index says {meta['bytes']}: the file "
                                     "is truncated or was overwritten. Copy it again or resume from an earlier "
                                     "checkpoint.")


class ShardReader:
    """Opens checkpoint files on demand; each file's sha256 is verified once, on first use, so a rank only hashes
    the files it reads."""

    def __init__(self, root: Path, index: dict, verify: bool):
        self.root, self.index, self.verify = root, index, verify
        self.meta = {p["file"]: p for p in index["parts"]}
        for spec in index["tables"].values():
            if "weights" in spec:
                self.meta[spec["weights"]["file"]] = spec["weights"]
        self._handles: dict[str, Any] = {}

    def open(self, rel: str):
        if rel not in self._handles:
            from safetensors import safe_open

            path = self.root / rel
            meta = self.meta[rel]
            if self.verify and sha256_of(str(path)) != meta["sha256"]:
                raise CorruptCheckpointError(f"{path} does not match the sha256 in {SHARDS_DIR}/{INDEX_NAME}: the "
                                             "file is corrupt. Copy it again or resume from an earlier checkpoint.")
            try:
                self._handles[rel] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own SafetensorError on a bad header
                raise CorruptCheckpointError(f"{path} is not a readable safetensors file ({exc}).") from exc
        return self._handles[rel]

    def rows(self, table: str, kind: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``kind`` (``"weight"`` or ``"optim.<key>"``) of ``table``, from every part that
        holds some of them."""
        spec = self.index["tables"][table]
        pieces = []
        for part in self.index["parts"]:
            lo, hi = part["rows"][table]
            a, b = max(start, lo), min(end, hi)
            if a >= b:
                continue
            if kind == "weight" and "weights" in spec:
                rel, key = spec["weights"]["file"], spec["weights"]["key"]
            else:
                rel, key = part["file"], f"{table}.{kind}"
            pieces.append(self._slice(rel, key, a - lo, b - lo))
        got = sum(p.shape[0] for p in pieces)
        if got != end - start:
            raise CorruptCheckpointError(f"the parts in {self.root / SHARDS_DIR} cover {got} of rows [{start}, {end}) "
                                         f"of table {table!r}; the index is inconsistent.")
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def whole(self, table: str, kind: str) -> torch.Tensor:
        """A tensor that every part holds whole (replicated optimizer state, e.g. Adam's ``step``)."""
        part = self.index["parts"][0]
        return self._slice(part["file"], f"{table}.{kind}", None, None)

    def _slice(self, rel: str, key: str, a: int | None, b: int | None) -> torch.Tensor:
        handle = self.open(rel)
        if key not in handle.keys():
            raise CorruptCheckpointError(f"{self.root / rel} has no tensor {key!r} though the index lists it.")
        try:
            return handle.get_tensor(key) if a is None else handle.get_slice(key)[a:b]
        except Exception as exc:  # noqa: BLE001 - safetensors errors on damaged data
            raise CorruptCheckpointError(f"could not read {key!r} from {self.root / rel} ({exc}).") from exc

    def dense(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.root / MODEL_NAME
        if not path.is_file():
            raise IncompleteCheckpointError(f"{path} (the dense parameters) is missing; the checkpoint is "
                                            "incomplete. Resume from an earlier checkpoint.")
        if MODEL_NAME in self.meta:
            self.open(MODEL_NAME)  # verifies the recorded sha256
        try:
            state = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError on damaged files
            raise CorruptCheckpointError(f"{path} is not a readable safetensors file ({exc}); the file is corrupt "
                                         "or truncated. Resume from an earlier checkpoint.") from exc
        table_keys = {spec["weights"]["key"] for spec in self.index["tables"].values() if "weights" in spec}
        return {k: v for k, v in state.items() if k not in table_keys}


# ---------------------------------------------------------------------------------------------------- load
def _match_tables(model: nn.Module, index: dict) -> dict[str, _Table]:
    """The model's table for each table of the checkpoint, sharded or not, with the same vocab sizes and width."""
    tables = _tables(model, sharded_only=False)
    missing = sorted(set(index["tables"]) - set(tables))
    if missing:
        raise CheckpointMismatchError(f"the checkpoint has embedding tables {missing} that the model lacks (model "
                                      f"tables: {sorted(tables)}); build the model the checkpoint was saved from.")
    out = {}
    for name, spec in index["tables"].items():
        t = tables[name]
        have = (list(t.module.vocab_sizes), int(t.module.embedding_dim))
        want = (spec["vocab_sizes"], spec["embedding_dim"])
        if have != want:
            raise CheckpointMismatchError(
                f"table {name!r}: the checkpoint has vocab_sizes={want[0]} x embedding_dim={want[1]} "
                f"({spec['rows']} rows), the model has vocab_sizes={have[0]} x embedding_dim={have[1]} "
                f"({t.rows} rows). Build the model with the checkpoint's sizes (DLRMConfig.vocab_sizes / "
                "embedding_dim).")
        out[name] = t
    return out


def _check_same_partition(root: Path, index: dict, tables: dict[str, _Table]) -> None:
    """Per-rank shards resume only on the partition that wrote them; one part with every row fits any."""
    if len(index["parts"]) == 1:
        return
    w = index["world_size"]
    for t in tables.values():
        part = index["parts"][t.rank] if t.rank < len(index["parts"]) else None
        if t.world != w or part is None or part["rows"].get(t.name) != [t.start, t.end]:
            now = (f"this run has {t.world} rank(s)" if getattr(t.module, "is_sharded", False)
                   else "this run replicates the tables (not sharded)")
            raise CheckpointMismatchError(
                f"{root} holds sharded tables saved by {w} ranks as per-rank shards, and {now}: per-rank shards and "
                "their optimizer state resume only on the world size that wrote them. Consolidate the checkpoint "
                f"first: `python -m gmeta_trainer export {root} {root}-consolidated` (or "
                "gmeta_trainer.export_consolidated), then resume from the export, which loads on any world size. "
                "To load the weights only, use gmeta_trainer.load_checkpoint_weights.")


def load_checkpoint_weights(model: nn.Module, checkpoint_dir: str | os.PathLike, *, resume: bool = False,
                            verify: bool = True) -> dict:
    """Load a sharded-table checkpoint or a consolidated export into ``model`` (a `MetaLearner` or the bare
    recommendation model, sharded over any world size or not): dense parameters, and this process's rows of every
    table read from whichever parts hold them. Returns the index.

    ``resume=True`` additionally requires per-rank shards to match this run's partition (same world size), as a
    resume with their optimizer state does. ``verify`` checks the sha256 of every file read.

    Raises:
        `IncompleteCheckpointError`, `CorruptCheckpointError`, `CheckpointMismatchError` (see `read_index`; shapes,
        table or parameter names that differ from the model; a world-size change with ``resume=True``).
    """
    root = Path(checkpoint_dir)
    index = read_index(root)
    tables = _match_tables(model, index)
    if resume:
        _check_same_partition(root, index, tables)
    reader = ShardReader(root, index, verify)
    dense = _rename(reader.dense(), index.get("prefix", ""), _prefix_of(model))
    table_keys = {t.param_name for t in tables.values()}
    own = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in table_keys}
    missing = sorted(set(own) - set(dense))
    unexpected = sorted(set(dense) - set(own))
    if missing or unexpected:
        raise CheckpointMismatchError(f"the dense parameters of {root / MODEL_NAME} do not match the model: missing "
                                      f"{missing}, unexpected {unexpected}. Build the model the checkpoint was saved "
                                      "from (same DLRMConfig and MetaTrainingArguments.learn_inner_lr).")
    bad = [f"{k}: checkpoint {tuple(dense[k].shape)}, model {tuple(v.shape)}" for k, v in own.items()
           if tuple(dense[k].shape) != tuple(v.shape)]
    if bad:
        raise CheckpointMismatchError(f"parameter shapes differ from the checkpoint: {bad}. Build the model with the "
                                      "checkpoint's sizes.")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(dense[k])
        for t in tables.values():
            t.param.copy_(reader.rows(t.name, "weight", t.start, t.end))
    return index


def _rename(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """Keys of a checkpoint saved from a `MetaLearner` (prefix ``model.``) or a bare model, for the other kind.
    Keys outside the prefix (the learner's own ``inner_lrs``) have no place in a bare model and are dropped."""
    if src == dst:
        return state
    out = {}
    for k, v in state.items():
        if k.startswith(src):
            out[dst + k[len(src):]] = v
        elif dst:  # a bare checkpoint has nothing outside its model
            out[k] = v
    return out


def load_table_optimizer_state(model: nn.Module, optimizer, checkpoint_dir: str | os.PathLike,
                               verify: bool = True) -> bool:
    """Put the optimizer state of this process's table rows from a checkpoint into ``optimizer`` (after the dense
    state was loaded the usual way). Per-rank shards must match this run's partition. Returns False when the
    checkpoint holds no optimizer state (saved with ``save_only_model``, or before the first step)."""
    root = Path(checkpoint_dir)
    index = read_index(root)
    kinds = index["optimizer_state"]
    if not kinds:
        return False
    tables = _match_tables(model, index)
    _check_same_partition(root, index, tables)
    reader = ShardReader(root, index, verify)
    state = _optimizer_state(optimizer)
    for t in tables.values():
        entry = {}
        for key, kind in kinds.items():
            value = (reader.rows(t.name, f"optim.{key}", t.start, t.end) if kind == "rows"
                     else reader.whole(t.name, f"optim.{key}"))
            if kind == "rows":
                value = value.to(device=t.param.device, dtype=t.param.dtype)
            elif key == "step" and value.dim() == 0:
                # torch's own placement of a loaded ``step``: on the parameter's device for fused/capturable
                # optimizers (fused AdamW on GPUs reads it there), on the CPU otherwise
                group = next(g for g in optimizer.param_groups if any(p is t.param for p in g["params"]))
                if group.get("fused") or group.get("capturable"):
                    value = value.to(device=t.param.device, dtype=torch.float32)
            else:
                value = value.to(device=t.param.device)
            entry[key] = value
        state[t.param] = entry
    return True
