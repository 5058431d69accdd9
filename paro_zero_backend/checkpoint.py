"""Checkpoints: per-rank shards that resume bit-identically, and consolidated full weights (+ optimizer state).

Sharded checkpoints are tied to the topology (strategy, world size, group size, bucket layout), like DeepSpeed's
ZeRO checkpoints: each rank writes exactly what it holds. A consolidated checkpoint (``model.safetensors`` with the
model's own parameter names, ``config.json`` for Hugging Face models, and optionally ``optimizer.safetensors`` with
each parameter's full optimizer state) is topology-free: it loads into any strategy, group size or world size, and
``GPT2LMHeadModel.from_pretrained(directory)`` reads the weights (the ``zero_to_fp32`` role).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .strategies import Level

if TYPE_CHECKING:
    from .engine import ParoEngine

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
    if engine._micro_steps != 0 or engine._grads_ready:
        raise RuntimeError("save_sharded must be called at an optimizer-step boundary (after engine.step()), not in "
                           "the middle of gradient accumulation.")
    os.makedirs(directory, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for b in engine.buckets:
        tensors[f"bucket{b.index}.param"] = b.p_store
        if b.trainable:
            tensors[f"bucket{b.index}.master"] = b.master
    opt_tensors, opt_meta = _optimizer_tensors(engine)
    tensors.update(opt_tensors)
    meta = {"optimizer": opt_meta, "global_step": engine.global_step, "loss_scale": engine.loss_scale,
            "good_steps": engine._good_steps, "skipped_steps": engine.skipped_steps}
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(directory, _shard_file(engine.rank, engine.world_size)),
              metadata={"paro": json.dumps(meta, default=_json_default)})
    if engine.rank == 0:
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump({"format": "paro-sharded-v1", "model": model_fingerprint(engine),
                       "topology": _topology_meta(engine), "config": engine.config.to_dict()}, f, indent=1)
    dist.barrier()


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
    for b in engine.buckets:
        b.p_store.copy_(tensors[f"bucket{b.index}.param"])
        if b.trainable:
            b.master.copy_(tensors[f"bucket{b.index}.master"])
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    for key, value in extra["optimizer"]["plain_state"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    engine.optimizer.load_state_dict({"state": state, "param_groups": extra["optimizer"]["param_groups"]})
    engine.global_step = extra["global_step"]
    engine.loss_scale = extra["loss_scale"]
    engine._good_steps = extra["good_steps"]
    engine.skipped_steps = extra["skipped_steps"]
    _refresh_working_params(engine)
    dist.barrier()


def _refresh_working_params(engine: ParoEngine) -> None:
    for b in engine.buckets:
        if engine.strategy.p == Level.N:
            b.full = b.p_store
            engine._point_params(b)
        else:
            engine._release(b)


# --- consolidated --------------------------------------------------------------------------------------------
def _consolidated_optimizer(engine: ParoEngine) -> dict[str, torch.Tensor]:
    """Full per-parameter optimizer state (elementwise states gathered, scalar states such as ``step`` kept)."""
    st = engine.strategy
    out: dict[str, torch.Tensor] = {}
    keys: set[str] = set()
    for state in engine.optimizer.state.values():
        keys.update(k for k, v in state.items() if isinstance(v, torch.Tensor))
    keys_list = sorted(keys)
    # Every rank must run the same gathers: agree on the key set (ranks without pieces see no state).
    agreed: list[Any] = [None] * engine.world_size
    dist.all_gather_object(agreed, keys_list)
    keys_list = sorted(set().union(*[set(k) for k in agreed]))
    with engine._uncounted():
        for b in engine.buckets:
            if not b.trainable:
                continue
            lo, _ = engine._range(st.os, b)
            for key in keys_list:
                flat = torch.zeros(b.master.numel(), dtype=torch.float32)
                scalars = torch.full((len(b.slots),), float("-inf"), dtype=torch.float64)
                position = {id(slot): k for k, slot in enumerate(b.slots)}
                for slot, a, z, piece in b.pieces:
                    value = engine.optimizer.state.get(piece, {}).get(key)
                    if value is None:
                        continue
                    if value.dim() == 0:
                        scalars[position[id(slot)]] = float(value)
                    elif value.numel() == piece.numel():
                        flat[a - lo:z - lo].copy_(value.reshape(-1))
                    else:
                        raise NotImplementedError(
                            f"optimizer state {key!r} has shape {tuple(value.shape)} for a shard of {piece.numel()} "
                            "elements: only elementwise optimizer states (Adam, AdamW, SGD momentum, ...) can be "
                            "consolidated. Use save_consolidated(include_optimizer=False) or sharded checkpoints.")
                full = engine._gather_level(flat, st.os)
                dist.all_reduce(scalars, op=dist.ReduceOp.MAX)
                for k, slot in enumerate(b.slots):
                    if torch.isfinite(scalars[k]):
                        out[f"{slot.name}::{key}"] = torch.tensor(float(scalars[k]), dtype=torch.float32)
                    else:
                        out[f"{slot.name}::{key}"] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
    return out


def save_consolidated(engine: ParoEngine, directory: str, include_optimizer: bool = True) -> None:
    weights = engine.consolidated_state_dict(dtype=torch.float32)
    optim = _consolidated_optimizer(engine) if include_optimizer else None
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
    dist.barrier()


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
    st = engine.strategy
    optim = load_file(os.path.join(directory, OPTIM_FILE)) if os.path.exists(os.path.join(directory, OPTIM_FILE)) \
        else None
    for b in engine.buckets:
        full = torch.zeros(b.size, dtype=torch.float32)
        for s in b.slots:
            full[s.offset:s.offset + s.numel].copy_(weights[s.name].reshape(-1))
        lo, hi = engine._range(st.p, b)
        b.p_store.copy_(full[lo:hi])
        if b.trainable:
            lo, hi = engine._range(st.os, b)
            b.master.copy_(full[lo:hi])
            if optim is not None:
                for slot, a, z, piece in b.pieces:
                    state = {}
                    for key, value in optim.items():
                        name, _, sk = key.partition("::")
                        if name != slot.name:
                            continue
                        state[sk] = value.clone() if value.dim() == 0 else \
                            value.reshape(-1)[a - slot.offset:z - slot.offset].clone()
                    if state:
                        engine.optimizer.state[piece] = state
    if optim is not None:
        with safe_open(os.path.join(directory, OPTIM_FILE), framework="pt") as f:
            groups = json.loads(f.metadata()["param_groups"])
        for group, saved in zip(engine.optimizer.param_groups, groups):
            for k, v in saved.items():
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    _refresh_working_params(engine)
    dist.barrier()
