"""File writing for checkpoints: atomic (temporary name, flush, rename) so a crash mid-save leaves the previous file
or none, plus the size and sha256 recorded in a checkpoint index."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["atomic_write", "save_tensors", "sha256_of", "write_json"]


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)``, flush it to disk, then rename it to ``path``: readers see the old file or the whole
    new one, never a partial one."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform/filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: str) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_tensors(tensors: dict[str, torch.Tensor], path: str) -> dict[str, Any]:
    """Write ``tensors`` as safetensors, atomically; returns the ``bytes`` and ``sha256`` to record in an index."""
    from safetensors.torch import save_file

    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    return {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}


def write_json(obj: dict, path: str) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")

    atomic_write(path, write)
