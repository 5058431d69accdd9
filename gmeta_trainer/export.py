"""Consolidated export of a sharded-table checkpoint: every rank's rows in one part, so it loads and resumes on any
world size (the format is described in `gmeta_trainer.checkpoint`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from ._checkpoint_files import save_tensors, write_json
from .checkpoint import INDEX_NAME, MODEL_NAME, SHARDS_DIR, ShardReader, read_index

__all__ = ["export_consolidated"]


def export_consolidated(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        overwrite: bool = False) -> Path:
    """Consolidate a sharded-table checkpoint into one part that loads on any world size. Runs in one process with
    no process group (it reads every rank's files).

    ``output_dir`` gets ``model.safetensors`` with the dense parameters and the full tables under their unsharded
    names (loadable into the unsharded model as is), ``gmeta_shards/`` with the optimizer state of all rows, and
    copies of the Trainer's files (optimizer, scheduler, trainer state, ...), so ``trainer.train(
    resume_from_checkpoint=output_dir)`` continues on any world size. Built in a temporary directory renamed at the
    end. Returns ``output_dir``.

    Raises:
        `FileExistsError`: ``output_dir`` exists and ``overwrite`` is False.
        `IncompleteCheckpointError`, `CorruptCheckpointError`, `CheckpointError`: see `read_index`.
    """
    root, out = Path(checkpoint_dir), Path(output_dir)
    if out.resolve() == root.resolve():
        raise ValueError(f"output_dir {out} is the checkpoint itself; export into a new directory.")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new directory or pass overwrite=True (--overwrite).")
    index = read_index(root)
    reader = ShardReader(root, index, verify=True)
    prefix = index.get("prefix", "")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model = dict(reader.dense())
        optim: dict[str, torch.Tensor] = {}
        tables = {}
        for name, spec in index["tables"].items():
            model[f"{prefix}{name}.weight"] = reader.rows(name, "weight", 0, spec["rows"]).contiguous()
            for key, kind in index["optimizer_state"].items():
                optim[f"{name}.optim.{key}"] = (reader.rows(name, f"optim.{key}", 0, spec["rows"]) if kind == "rows"
                                                else reader.whole(name, f"optim.{key}")).contiguous()
            tables[name] = {**spec, "weights": {"file": MODEL_NAME, "key": f"{prefix}{name}.weight"}}
        weights = save_tensors(model, str(tmp / MODEL_NAME))
        for spec in tables.values():
            spec["weights"].update(weights)
        part_file = f"{SHARDS_DIR}/rank-00000-of-00001.safetensors"
        (tmp / SHARDS_DIR).mkdir()
        part = {"rank": 0, "file": part_file, "rows": {n: [0, s["rows"]] for n, s in tables.items()},
                **save_tensors(optim, str(tmp / part_file))}
        for item in root.iterdir():  # the Trainer's files: optimizer (dense), scheduler, trainer state, RNG, args
            if item.is_file() and item.name != MODEL_NAME and not item.name.startswith("."):
                shutil.copy2(item, tmp / item.name)
        new_index = {**index, "world_size": 1, "consolidated": True, "source_world_size": index["world_size"],
                     "tables": tables, "parts": [part]}
        write_json(new_index, str(tmp / SHARDS_DIR / INDEX_NAME))
        if out.exists():  # overwrite: move the old export aside first, so a crash leaves one of the two whole
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
