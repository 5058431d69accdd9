"""Checkpoints: per-rank shards that resume bit-identically, and consolidated full weights (+ optimizer state).

Sharded checkpoints are tied to the topology (strategy, world size, group size, bucket layout), like DeepSpeed's
ZeRO checkpoints: each rank writes exactly what it holds. A consolidated checkpoint (``model.safetensors`` with the
model's own parameter names, ``config.json`` for Hugging Face models, and optionally ``optimizer.safetensors`` with
each parameter's full optimizer state) is topology-free: it loads into any strategy, group size or world size, and
``GPT2LMHeadModel.from_pretrained(directory)`` reads the weights (the ``zero_to_fp32`` role).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .engine import LocalState

if TYPE_CHECKING:
    from .engine import ParoEngine, ShardPiece

__all__ = ["save_sharded", "load_sharded", "save_consolidated", "load_consolidated", "model_fingerprint"]

META_FILE = "paro_meta.json"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"


def _shard_file(rank: int, world: int) -> str:
    return f"paro-shard-rank{rank:05d}-of-{world:05d}.safetensors"


def model_fingerprint(engine: ParoEngine) -> dict[str, Any]:
    """Parameter names, shapes and trainability: what a checkpoint must match to belong to this model."""
    params = [[s.name, list(s.shape), s.trainable] for s in engine.slots]
    digest = hashlib.sha256(json.dumps(params).encode()).hexdigest()[:16]
    return {"params": params, "digest": digest}


def _topology_meta(engine: ParoEngine) -> dict[str, Any]:
    return {"strategy": engine.strategy.name, "world_size": engine.world_size, "group_size": engine.group_size,
            "bucket_sizes": [b.size for b in engine.buckets], "compute_dtype": str(engine.compute_dtype)}


def _check_model(engine: ParoEngine, saved: dict[str, Any], directory: str) -> None:
    mine = model_fingerprint(engine)
    if saved["digest"] == mine["digest"]:
        return
    theirs = {p[0]: (p[1], p[2]) for p in saved["params"]}
    ours = {p[0]: (p[1], p[2]) for p in mine["params"]}
    missing = sorted(set(ours) - set(theirs))[:5]
    extra = sorted(set(theirs) - set(ours))[:5]
    changed = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])[:5]
    raise ValueError(f"checkpoint {directory!r} belongs to a different model: parameters missing from it {missing}, "
                     f"unknown to this model {extra}, with another shape or trainability {changed}. Load the "
                     "checkpoint of this model (same architecture and the same frozen parameters).")


def _optimizer_tensors(engine: ParoEngine) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = engine.optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{idx}.{key}"] = value.detach().clone().contiguous()
            else:
                plain[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "plain_state": plain}


def save_sharded(engine: ParoEngine, directory: str) -> None:
    if not engine.at_step_boundary:
        raise RuntimeError("save_sharded must be called at an optimizer-step boundary (after engine.step()), not in "
                           "the middle of gradient accumulation.")
    os.makedirs(directory, exist_ok=True)
    local = engine.local_state()
    tensors = dict(local.tensors)
    meta: dict[str, Any] = dict(local.counters)
    if engine.optimizer is not None:
        opt_tensors, meta["optimizer"] = _optimizer_tensors(engine)
        tensors.update(opt_tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(directory, _shard_file(engine.rank, engine.world_size)),
              metadata={"paro": json.dumps(meta, default=_json_default)})
    if engine.rank == 0:
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump({"format": "paro-sharded-v1", "model": model_fingerprint(engine),
                       "topology": _topology_meta(engine), "config": engine.config.to_dict()}, f, indent=1)
    dist.barrier(group=engine.topology.world_group)


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot store {type(value).__name__} in checkpoint metadata")


def _read_meta(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, META_FILE)
    if not os.path.exists(path):
        hint = (" It holds a consolidated checkpoint: use engine.load_consolidated()."
                if os.path.exists(os.path.join(directory, MODEL_FILE)) else "")
        raise FileNotFoundError(f"{directory!r} is not a PaRO sharded checkpoint (no {META_FILE}).{hint}")
    with open(path) as f:
        return json.load(f)


def load_sharded(engine: ParoEngine, directory: str) -> None:
    meta = _read_meta(directory)
    _check_model(engine, meta["model"], directory)
    saved, mine = meta["topology"], _topology_meta(engine)
    if saved != mine:
        diff = {k: (saved.get(k), mine[k]) for k in mine if saved.get(k) != mine[k]}
        raise ValueError(
            f"sharded checkpoint {directory!r} was written by another topology (saved, here): {diff}. Sharded "
            "checkpoints hold each rank's own slices and cannot be resharded; write a consolidated checkpoint with "
            "engine.save_consolidated() on the original job and load it here with engine.load_consolidated().")
    path = os.path.join(directory, _shard_file(engine.rank, engine.world_size))
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        extra = json.loads(f.metadata()["paro"])
    if engine.optimizer is not None:
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optim."):
                _, idx, name = key.split(".", 2)
                state.setdefault(int(idx), {})[name] = value
        for key, value in extra["optimizer"]["plain_state"].items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = value
        engine.optimizer.load_state_dict({"state": state, "param_groups": extra["optimizer"]["param_groups"]})
    counters = {k: extra[k] for k in ("global_step", "loss_scale", "good_steps", "skipped_steps")}
    engine.load_local_state(LocalState({k: v for k, v in tensors.items() if k.startswith("bucket")}, counters))
    dist.barrier(group=engine.topology.world_group)


# --- consolidated --------------------------------------------------------------------------------------------
def _object_device(engine: ParoEngine) -> contextlib.AbstractContextManager[Any]:
    """Object collectives stage their bytes on the *current* CUDA device under NCCL: make that the engine's, so a
    script that moved the model to ``cuda:LOCAL_RANK`` without ``torch.cuda.set_device`` does not put every rank's
    bytes on ``cuda:0``."""
    return torch.cuda.device(engine.device) if engine.device.type == "cuda" else contextlib.nullcontext()


def _consolidated_optimizer(engine: ParoEngine) -> dict[str, torch.Tensor]:
    """Full per-parameter optimizer state (elementwise states gathered, scalar states such as ``step`` kept)."""
    group = engine.topology.world_group
    pieces = engine.shard_pieces()
    state_of = {id(p.tensor): engine.optimizer.state.get(p.tensor, {}) for p in pieces}
    local_keys = {k for st in state_of.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    # Every rank must run the same gathers: agree on the key set (ranks without pieces see no state).
    agreed: list[Any] = [None] * engine.world_size
    with _object_device(engine):
        dist.all_gather_object(agreed, sorted(local_keys), group=group)
    keys = sorted(set().union(*[set(k) for k in agreed]))
    out: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for key in keys:
        def elementwise(piece: ShardPiece, key: str = key) -> torch.Tensor | None:
            value = state_of[id(piece.tensor)].get(key)
            if value is None:
                return None
            if value.dim() == 0:
                name = f"{piece.name}::{key}"
                scalars[name] = max(scalars.get(name, float("-inf")), float(value))
                return None
            if value.numel() != piece.tensor.numel():
                raise NotImplementedError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)} for a shard of {piece.tensor.numel()} "
                    "elements: only elementwise optimizer states (Adam, AdamW, SGD momentum, ...) can be "
                    "consolidated. Use save_consolidated(include_optimizer=False) or sharded checkpoints.")
            return value

        for name, full in engine.full_values(elementwise):
            out[f"{name}::{key}"] = full.clone()
    # A scalar state (Adam's ``step``) is the same on every piece of a parameter; ranks without a piece have none.
    every: list[Any] = [None] * engine.world_size
    with _object_device(engine):
        dist.all_gather_object(every, scalars, group=group)
    merged: dict[str, float] = {}
    for part in every:
        for name, v in part.items():
            merged[name] = max(merged.get(name, float("-inf")), v)
    for name, v in merged.items():
        out[name] = torch.tensor(v, dtype=torch.float32, device="cpu")  # for the file
    return out


def save_consolidated(engine: ParoEngine, directory: str, include_optimizer: bool = True) -> None:
    weights = engine.consolidated_state_dict(dtype=torch.float32)
    optim = _consolidated_optimizer(engine) if include_optimizer and engine.optimizer is not None else None
    if engine.rank == 0:
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(directory, MODEL_FILE),
                  metadata={"format": "pt"})
        config = getattr(engine.module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(directory)
        info = {"format": "paro-consolidated-v1", "model": model_fingerprint(engine),
                "saved_from": _topology_meta(engine), "global_step": engine.global_step}
        if optim is not None:
            groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
            save_file(optim, os.path.join(directory, OPTIM_FILE),
                      metadata={"param_groups": json.dumps(groups, default=_json_default)})
        with open(os.path.join(directory, "paro_consolidated.json"), "w") as f:
            json.dump(info, f, indent=1)
    dist.barrier(group=engine.topology.world_group)


def load_consolidated(engine: ParoEngine, directory: str) -> None:
    """Load full weights (and optimizer state if present) into this engine's strategy and topology."""
    path = os.path.join(directory, MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory!r} has no {MODEL_FILE}: not a consolidated checkpoint.")
    weights = load_file(path)
    info_path = os.path.join(directory, "paro_consolidated.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            _check_model(engine, json.load(f)["model"], directory)
    missing = [s.name for s in engine.slots if s.name not in weights]
    bad = [s.name for s in engine.slots if s.name in weights and tuple(weights[s.name].shape) != tuple(s.shape)]
    if missing or bad:
        raise ValueError(f"checkpoint {directory!r} belongs to a different model: missing {missing[:5]}, wrong shape "
                         f"{bad[:5]}. Load a checkpoint of this model.")
    engine.load_full_values(weights)
    optim_path = os.path.join(directory, OPTIM_FILE)
    if engine.optimizer is not None and os.path.exists(optim_path):
        optim = load_file(optim_path)
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in optim.items():
            name, _, state_key = key.partition("::")
            by_param.setdefault(name, {})[state_key] = value
        # through the optimizer's own load_state_dict, which puts each state where its parameter lives (the file is
        # read to the CPU; on GPU ranks the shard pieces are on the GPU) and keeps Adam's `step` where it belongs
        index = {id(t): i for i, t in enumerate(t for g in engine.optimizer.param_groups for t in g["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for piece in engine.shard_pieces():
            saved = by_param.get(piece.name, {})
            piece_state = {k: v.clone() if v.dim() == 0 else v.reshape(-1)[piece.start:piece.stop].clone()
                           for k, v in saved.items()}
            if piece_state:
                state[index[id(piece.tensor)]] = piece_state
        with safe_open(optim_path, framework="pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
        current = engine.optimizer.state_dict()["param_groups"]
        merged = [{**cur, **{k: tuple(v) if isinstance(cur.get(k), tuple) else v
                             for k, v in saved_group.items() if k != "params"}}
                  for cur, saved_group in zip(current, groups)]
        engine.optimizer.load_state_dict({"state": state, "param_groups": merged})
    dist.barrier(group=engine.topology.world_group)
