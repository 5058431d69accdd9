"""DeepSpeed JSON configs with a ``"paro"`` section: PaRO-CC inside DeepSpeed ZeRO, or the PaRO engine itself.

Moving from ZeRO to PaRO should be a config change. A DeepSpeed config gains one top-level section, which this loader
strips before DeepSpeed validates the rest (upstream DeepSpeed rejects unknown keys):

- ``"paro": {"paro_cc": true, "group_size": 8}`` keeps DeepSpeed ZeRO and routes its all-gathers / reduce-scatters
  through PaRO-CC (`paro_zero_backend.deepspeed_cc`);
- ``"paro": {"strategy": "IIG", "group_size": 8}`` runs the whole job on `ParoEngine`: micro-batch, accumulation,
  precision (fp16 / bf16), gradient clipping, and the optimizer and scheduler blocks are translated
  (`paro_config_from_deepspeed`), and `DeepSpeedStyleEngine` keeps DeepSpeed's training-loop calls
  (``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` every micro-step).

DeepSpeed keys the PaRO engine cannot honour are listed in one error, never dropped silently. Keys that only tune how
DeepSpeed schedules its own buffers (ZeRO bucket sizes, overlap, logging) have no counterpart to get wrong and are
accepted: `PERFORMANCE_HINT_KEYS`.

`initialize(model, config)` is the entry point with ``deepspeed.initialize``'s shape and return value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ParoConfig

__all__ = ["ParoSection", "DeepSpeedTrainingSpec", "DeepSpeedStyleEngine", "PERFORMANCE_HINT_KEYS",
           "initialize", "load_deepspeed_config", "paro_config_from_deepspeed", "split_paro_section"]

logger = logging.getLogger(__name__)

PARO_KEY = "paro"
_DS_DEFAULT_CLIPPING = 1.0  # deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT
_TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
              "scheduler", "fp16", "bf16", "gradient_clipping", "zero_optimization"}
# Scheduling/logging knobs of DeepSpeed itself: no effect on the numbers, no PaRO counterpart.
PERFORMANCE_HINT_KEYS = {
    "top": {"steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
            "zero_allow_untested_optimizer", "memory_breakdown"},
    "zero_optimization": {"stage", "overlap_comm", "contiguous_gradients", "reduce_bucket_size",
                          "allgather_bucket_size", "allgather_partitions", "reduce_scatter", "round_robin_gradients",
                          "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                          "stage3_max_live_parameters", "stage3_max_reuse_distance",
                          "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                          "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                          "max_reuse_distance", "gather_16bit_weights_on_model_save",
                          "use_multi_rank_bucket_allreduce"},
}
_FP16_KEYS = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
              "auto_cast"}
_BF16_KEYS = {"enabled"}
_OPTIMIZER_PARAM_IGNORE = {"torch_adam", "fused", "adam_w_mode"}  # implementation choices, same math
_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad"}


@dataclass
class ParoSection:
    """The ``"paro"`` section of a DeepSpeed config.

    Parameters:
        strategy (`str`, *optional*): PaRO strategy (e.g. ``"IIG"``, ``"auto"``): run on `ParoEngine` instead of
            DeepSpeed. Without it the job stays on DeepSpeed ZeRO with PaRO-CC collectives.
        group_size (`int`, *optional*): ranks per group (node); defaults to ``LOCAL_WORLD_SIZE``.
        paro_cc (`bool`, *optional*, defaults to `True`): hierarchical collectives (in DeepSpeed: the patch; on the
            PaRO engine: ``ParoConfig.paro_cc``).
        cc_min_numel (`int`, *optional*, defaults to `0`): DeepSpeed only: tensors below this keep the flat collective.
        bucket_size (`int`, *optional*): PaRO engine only: elements per flat bucket (``ParoConfig.bucket_size``).
        reduce_dtype (`str`, *optional*): PaRO engine only: gradient communication dtype.
        timeout_s (`float`, *optional*, defaults to `600.0`): timeout of the intra/inter process groups.
    """

    strategy: str | None = field(default=None, metadata={"help": "PaRO strategy: run on ParoEngine instead of ZeRO."})
    group_size: int | None = field(default=None, metadata={"help": "Ranks per group (node)."})
    paro_cc: bool = field(default=True, metadata={"help": "Hierarchical PaRO-CC collectives."})
    cc_min_numel: int = field(default=0, metadata={"help": "DeepSpeed: flat collectives below this many elements."})
    bucket_size: int | None = field(default=None, metadata={"help": "PaRO engine: elements per flat bucket."})
    reduce_dtype: str | None = field(default=None, metadata={"help": "PaRO engine: gradient communication dtype."})
    timeout_s: float = field(default=600.0, metadata={"help": "Timeout of the intra/inter process groups (s)."})

    def __post_init__(self) -> None:
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"paro.group_size={self.group_size!r} must be a positive integer (ranks per node).")
        if not isinstance(self.paro_cc, bool):
            raise ValueError(f"paro.paro_cc={self.paro_cc!r} must be true or false.")
        if self.cc_min_numel < 0:
            raise ValueError(f"paro.cc_min_numel={self.cc_min_numel} must be >= 0.")
        if self.strategy is None and not self.paro_cc:
            raise ValueError("the paro section sets neither a strategy nor paro_cc=true, so it would change nothing: "
                             "remove it, set paro_cc: true (PaRO-CC inside ZeRO) or give a strategy (PaRO engine).")
        if self.strategy is not None:
            ParoConfig(strategy=self.strategy)  # validates the name, listing the valid strategies
        if self.strategy is None and (self.bucket_size is not None or self.reduce_dtype is not None):
            raise ValueError("paro.bucket_size / paro.reduce_dtype only apply to the PaRO engine: add a strategy, or "
                             "remove them (DeepSpeed's own zero_optimization settings apply).")

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> ParoSection:
        if not isinstance(section, dict):
            raise ValueError(f"the 'paro' section must be a JSON object, got {type(section).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown keys in the 'paro' section: {unknown}. Allowed keys: {sorted(known)}.")
        return cls(**section)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_deepspeed_config(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a fresh dict, from a dict or a JSON file path."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config file {path} does not exist.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {exc}.") from exc


def split_paro_section(config: str | os.PathLike | dict[str, Any]) -> tuple[dict[str, Any], ParoSection | None]:
    """(the config without its ``paro`` section, the parsed section or None): what DeepSpeed may see, and ours."""
    cfg = load_deepspeed_config(config)
    section = cfg.pop(PARO_KEY, None)
    return cfg, (ParoSection.from_dict(section) if section is not None else None)


# --------------------------------------------------------------------------------- DeepSpeed -> PaRO engine
@dataclass
class DeepSpeedTrainingSpec:
    """What the DeepSpeed config says about the training loop (the PaRO engine's config holds the rest)."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None


def _resolve_batch(cfg: dict[str, Any], world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro * accumulation * world; any two determine the third."""
    tbs, mbs, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    for name, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                    ("gradient_accumulation_steps", gas)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r} must be a positive integer (resolve 'auto' values before loading; the "
                             "HF Trainer integration does that from TrainingArguments).")
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * world_size:
            raise ValueError(f"train_batch_size={tbs} != train_micro_batch_size_per_gpu={mbs} * "
                             f"gradient_accumulation_steps={gas} * world_size={world_size} (= {mbs * gas * world_size})"
                             ". Fix one of them or drop train_batch_size to have it computed.")
    elif tbs is not None and mbs is not None:
        gas, rem = divmod(tbs, mbs * world_size)
        if rem or gas < 1:
            raise ValueError(f"train_batch_size={tbs} is not a multiple of train_micro_batch_size_per_gpu={mbs} * "
                             f"world_size={world_size}.")
    elif tbs is not None and gas is not None:
        mbs, rem = divmod(tbs, gas * world_size)
        if rem or mbs < 1:
            raise ValueError(f"train_batch_size={tbs} is not a multiple of gradient_accumulation_steps={gas} * "
                             f"world_size={world_size}.")
    elif mbs is not None:
        gas = gas or 1
        tbs = mbs * gas * world_size
    elif tbs is not None:
        gas = 1
        mbs, rem = divmod(tbs, world_size)
        if rem or mbs < 1:
            raise ValueError(f"train_batch_size={tbs} is not a multiple of world_size={world_size}.")
    else:
        raise ValueError("the DeepSpeed config needs train_batch_size or train_micro_batch_size_per_gpu.")
    return tbs, mbs, gas


def _check_keys(block: dict[str, Any], allowed: set[str], where: str, unsupported: list[str]) -> None:
    unsupported.extend(f"{where}.{k}" if where else k for k in sorted(set(block) - allowed))


def paro_config_from_deepspeed(config: str | os.PathLike | dict[str, Any], world_size: int | None = None
                               ) -> tuple[ParoConfig, DeepSpeedTrainingSpec]:
    """Translate a DeepSpeed config with a ``paro`` section that names a strategy into a `ParoConfig` + loop spec.

    Raises `ValueError` listing every DeepSpeed key the PaRO engine cannot honour.
    """
    cfg, section = split_paro_section(config)
    if section is None or section.strategy is None:
        raise ValueError("running a DeepSpeed config on the PaRO engine needs \"paro\": {\"strategy\": ...} (e.g. "
                         "\"IIG\" or \"auto\"); without a strategy use initialize(), which keeps DeepSpeed ZeRO with "
                         "PaRO-CC.")
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    unsupported: list[str] = []
    _check_keys(cfg, _TOP_LEVEL | PERFORMANCE_HINT_KEYS["top"], "", unsupported)
    tbs, mbs, gas = _resolve_batch(cfg, world_size)

    kwargs: dict[str, Any] = {"strategy": section.strategy, "group_size": section.group_size,
                              "paro_cc": section.paro_cc, "timeout_s": section.timeout_s,
                              "gradient_accumulation_steps": gas}
    if section.bucket_size is not None:
        kwargs["bucket_size"] = section.bucket_size
    if section.reduce_dtype is not None:
        kwargs["reduce_dtype"] = section.reduce_dtype

    fp16, bf16 = cfg.get("fp16") or {}, cfg.get("bf16") or {}
    _check_keys(fp16, _FP16_KEYS, "fp16", unsupported)
    _check_keys(bf16, _BF16_KEYS, "bf16", unsupported)
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable one precision.")
    if fp16.get("enabled"):
        kwargs["mixed_precision"] = "fp16"
        if fp16.get("loss_scale", 0) not in (0, 0.0):
            unsupported.append(f"fp16.loss_scale={fp16['loss_scale']} (static scaling; the PaRO engine scales "
                               "dynamically: use 0)")
        if fp16.get("hysteresis", 1) != 1:
            unsupported.append(f"fp16.hysteresis={fp16['hysteresis']} (the PaRO engine halves the scale on the first "
                               "overflow: use 1)")
        if fp16.get("auto_cast"):
            unsupported.append("fp16.auto_cast=true (the PaRO engine casts the parameters, not the inputs)")
        kwargs["initial_loss_scale"] = 2.0 ** fp16.get("initial_scale_power", 16)
        kwargs["loss_scale_window"] = fp16.get("loss_scale_window", 1000)
        kwargs["min_loss_scale"] = float(fp16.get("min_loss_scale", 1))
    elif bf16.get("enabled"):
        kwargs["mixed_precision"] = "bf16"

    clip = cfg.get("gradient_clipping", _DS_DEFAULT_CLIPPING)  # DeepSpeed clips at 1.0 unless told otherwise
    if clip:
        kwargs["max_grad_norm"] = float(clip)

    zero = cfg.get("zero_optimization") or {}
    _check_keys(zero, PERFORMANCE_HINT_KEYS["zero_optimization"], "zero_optimization", unsupported)
    if "stage" in zero:
        logger.info("zero_optimization.stage=%s is replaced by the PaRO strategy %s", zero["stage"], section.strategy)

    optimizer = cfg.get("optimizer")
    if optimizer is not None:
        _check_keys(optimizer, {"type", "params"}, "optimizer", unsupported)
        _check_optimizer(optimizer, unsupported)
    scheduler = cfg.get("scheduler")
    if scheduler is not None:
        _check_keys(scheduler, {"type", "params"}, "scheduler", unsupported)
        _scheduler_class(scheduler.get("type"), unsupported)
    if unsupported:
        raise ValueError("these DeepSpeed settings are not supported by the PaRO engine (nothing was ignored): "
                         f"{unsupported}. Remove them, or keep DeepSpeed ZeRO (drop paro.strategy) to use them.")
    return ParoConfig(**kwargs), DeepSpeedTrainingSpec(tbs, mbs, gas, optimizer, scheduler)


def _optimizer_class(spec: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """DeepSpeed's mapping: Adam/AdamW -> AdamW unless ``adam_w_mode`` is false for Adam; else torch.optim.<type>."""
    name = str(spec.get("type", ""))
    params = dict(spec.get("params") or {})
    if name.lower() in ("adam", "adamw"):
        w_mode = name.lower() == "adamw" or params.get("adam_w_mode", True)
        kwargs = {k: v for k, v in params.items() if k not in _OPTIMIZER_PARAM_IGNORE}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        return (torch.optim.AdamW if w_mode else torch.optim.Adam), kwargs
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer.type={name!r} is not supported by the PaRO engine: use Adam, AdamW or a "
                         "torch.optim class name (e.g. SGD). DeepSpeed-only optimizers (Lamb, OneBitAdam, ...) "
                         "need DeepSpeed.")
    return cls, params


def _check_optimizer(spec: dict[str, Any], unsupported: list[str]) -> None:
    try:
        cls, params = _optimizer_class(spec)
    except ValueError as exc:
        unsupported.append(f"optimizer.type={spec.get('type')!r} ({exc})")
        return
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        _check_keys(params, _ADAM_KEYS, "optimizer.params", unsupported)


def _scheduler_class(name: Any, unsupported: list[str] | None = None):
    ds_names = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
    if name in ds_names:
        try:
            from deepspeed.runtime import lr_schedules
        except ImportError:
            msg = f"scheduler.type={name!r} (DeepSpeed's scheduler classes need deepspeed installed)"
            if unsupported is None:
                raise ValueError(msg) from None
            unsupported.append(msg)
            return None
        return getattr(lr_schedules, name)
    cls = getattr(torch.optim.lr_scheduler, str(name), None)
    if not isinstance(cls, type):
        msg = f"scheduler.type={name!r} (use one of {list(ds_names)} or a torch.optim.lr_scheduler class name)"
        if unsupported is None:
            raise ValueError(msg)
        unsupported.append(msg)
        return None
    return cls


class DeepSpeedStyleEngine(nn.Module):
    """`ParoEngine` behind DeepSpeed's training-loop calls, so a ZeRO loop runs unchanged on PaRO.

    ``backward(loss)`` divides by the accumulation steps and defers the boundary sync (``no_sync``) on all but the
    last micro-step; ``step()`` is called every micro-step and updates (optimizer, then scheduler) at the boundary,
    as DeepSpeed's engine does.
    """

    def __init__(self, engine, spec: DeepSpeedTrainingSpec, lr_scheduler=None, guideline=None):
        super().__init__()
        self.engine = engine
        self.spec = spec
        self.lr_scheduler = lr_scheduler
        self.guideline = guideline  # the guideline table behind paro.strategy="auto" (None otherwise)
        self.micro_steps = 0
        self.global_steps = 0

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def device(self) -> torch.device:
        """Where the model and its shards live (DeepSpeed loops move their batches there)."""
        return self.engine.device

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def gradient_accumulation_steps(self) -> int:
        return self.spec.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.spec.micro_batch_size

    def train_batch_size(self) -> int:
        return self.spec.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.spec.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        gas = self.spec.gradient_accumulation_steps
        ctx = contextlib.nullcontext() if self.is_gradient_accumulation_boundary() else self.engine.no_sync()
        with ctx:
            self.engine.backward(loss / gas if gas > 1 else loss)

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            applied = self.engine.step()
            if applied and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.engine.optimizer.param_groups]

    def consolidated_state_dict(self, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        return self.engine.consolidated_state_dict(dtype)


def _to_rank_device(model: nn.Module) -> nn.Module:
    """As ``deepspeed.initialize`` does: a model still on the CPU goes to ``cuda:LOCAL_RANK`` when the process group
    cannot carry CPU tensors (NCCL alone); under gloo it stays where it is."""
    from hf_placement import backend_device_types

    params = list(model.parameters())
    if params and params[0].device.type == "cpu" and "cpu" not in backend_device_types() \
            and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        model = model.to(device)
    return model


def build_paro_engine(model: nn.Module, config: str | os.PathLike | dict[str, Any],
                      model_parameters=None) -> DeepSpeedStyleEngine:
    """`ParoEngine` (in a `DeepSpeedStyleEngine`) from a DeepSpeed config whose ``paro`` section has a strategy."""
    from .engine import ParoEngine
    from .resolve import resolve_strategy

    paro_cfg, spec = paro_config_from_deepspeed(config)
    if spec.optimizer is None:
        raise ValueError("the DeepSpeed config has no optimizer block; the PaRO engine builds the optimizer from it "
                         "(pass an optimizer object to ParoEngine directly otherwise).")
    model = _to_rank_device(model)
    resolved = resolve_strategy(paro_cfg, model)  # "auto" -> the guideline's pick, before the engine
    opt_cls, opt_kwargs = _optimizer_class(spec.optimizer)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    engine = ParoEngine(model, opt_cls(params, **opt_kwargs), resolved.config)
    scheduler = None
    if spec.scheduler is not None:
        sched_cls = _scheduler_class(spec.scheduler.get("type"))
        scheduler = sched_cls(engine.optimizer, **(spec.scheduler.get("params") or {}))
    return DeepSpeedStyleEngine(engine, spec, scheduler, guideline=resolved.guideline)


def initialize(model: nn.Module, config: str | os.PathLike | dict[str, Any], model_parameters=None, **kwargs: Any):
    """``deepspeed.initialize`` for configs with a ``paro`` section; returns ``(engine, optimizer, None, scheduler)``.

    - ``paro.strategy`` set: the PaRO engine (`DeepSpeedStyleEngine`); DeepSpeed is not needed.
    - otherwise: ``deepspeed.initialize`` on the config without the section, with PaRO-CC patched into DeepSpeed's
      communication layer; ``engine.paro_cc`` is the active `DeepSpeedParoCC` (``.counter``, ``.disable()``).
    - no section: plain ``deepspeed.initialize``.
    """
    cfg, section = split_paro_section(config)
    if section is not None and section.strategy is not None:
        if kwargs:
            raise ValueError(f"arguments {sorted(kwargs)} are DeepSpeed-only; the PaRO engine takes model, config and "
                             "model_parameters.")
        engine = build_paro_engine(model, config, model_parameters)
        return engine, engine.optimizer, None, engine.lr_scheduler
    import deepspeed

    if section is None:
        return deepspeed.initialize(model=model, config=cfg, model_parameters=model_parameters, **kwargs)
    from .deepspeed_cc import DeepSpeedParoCC

    cc = DeepSpeedParoCC(section.group_size, min_numel=section.cc_min_numel, timeout_s=section.timeout_s).enable()
    try:
        out = deepspeed.initialize(model=model, config=cfg, model_parameters=model_parameters, **kwargs)
    except BaseException:
        cc.disable()
        raise
    out[0].paro_cc = cc
    return out
