"""`ParoAccelerator`: an `accelerate.Accelerator` that trains the model with the PaRO-DP engine instead of DDP.

Accelerate has no registration point for a custom engine (closed `DistributedType` enum, fixed kwargs handlers), so
this subclass uses the duck-typed seams it does have:
- ``prepare`` resolves ``strategy="auto"`` (`paro_zero_backend.resolve_strategy`, the guideline on the real model,
  with measured bandwidths unless given; the table is kept as ``paro_guideline``), builds
  `paro_zero_backend.ParoEngine` from the model *and* its optimizer (the engine rebuilds the optimizer over its
  shards) and returns the engine as the model plus a proxy optimizer whose ``step`` runs the
  engine's step (optimizer update + parameter sync). Dataloaders and schedulers go through the normal path.
- the accumulation boundary: ``Accelerator.no_sync(model)`` / ``accumulate()`` call ``model.no_sync()``, which the
  engine implements as "not the boundary" (per-micro-step reductions of g=I/G still run);
- ``backward`` divides the loss by the accumulation steps like Accelerate, and the engine averages over the ``n``
  ranks (sum, then divide by n), which is exactly DDP's gradient;
- ``clip_grad_norm_``, ``summon_full_params`` (the engine's ``gathered()``: one gather for a whole ``generate``),
  ``get_state_dict`` / ``save_model`` (collective: full weights on every rank), and
  ``save_state`` / ``load_state`` (the engine's per-rank sharded checkpoint + Accelerate's own RNG/scheduler files).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn
from transformers.utils import logging

from hf_placement import release_process_groups_at_exit
from paro_zero_backend import GuidelineTable, ParoEngine, resolve_strategy

from .paro_plugin import ParoPlugin

__all__ = ["ParoAccelerator", "ParoOptimizer"]

logger = logging.get_logger(__name__)

SHARDED_DIR = "paro_sharded"
_SUPPORTED = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.MULTI_XPU,
              DistributedType.MULTI_NPU, DistributedType.MULTI_MLU, DistributedType.MULTI_MUSA,
              DistributedType.MULTI_HPU, DistributedType.MULTI_SDAA, DistributedType.MULTI_NEURON)


class ParoOptimizer(torch.optim.Optimizer):
    """Optimizer facade over a `ParoEngine`: ``param_groups``/``state`` are the engine's sharded optimizer's (so LR
    schedulers act on the real optimizer), ``step()`` is the engine's step (update the os shards, then sync_p)."""

    def __init__(self, engine: ParoEngine, source: torch.optim.Optimizer | None = None):
        # No super().__init__: all state lives in the engine's optimizer. ``source`` is the user's optimizer: an LR
        # scheduler built over it before prepare() must drive the engine's optimizer, so its ``param_groups`` are
        # re-pointed at the engine's groups (the engine copied every group option, ``initial_lr`` included).
        self.engine = engine
        self.source = source
        if source is not None:
            source.param_groups = engine.optimizer.param_groups

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def param_groups(self):  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.engine.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.engine.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.engine.optimizer.state = value

    @property
    def defaults(self):  # type: ignore[override]
        return self.engine.optimizer.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.engine.optimizer.defaults = value

    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise ValueError("ParoOptimizer.step does not take a closure: compute the loss, call "
                             "accelerator.backward(loss), then optimizer.step().")
        self.engine.step()
        if self.source is not None:
            # what torch's LR-scheduler wrapper of ``source.step`` records (``source.step`` itself never runs), so a
            # scheduler over ``source`` does not warn that it stepped before the optimizer
            self.source._opt_called = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (topology-specific; see `ParoAccelerator.save_state`)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("PaRO shards parameters when the engine is built: add every parameter group to the "
                                  "optimizer before accelerator.prepare().")

    def __repr__(self) -> str:
        return f"ParoOptimizer({self.engine.strategy}, {self.engine.optimizer!r})"


class ParoAccelerator(Accelerator):
    """`Accelerator` whose ``prepare(model, optimizer)`` returns a PaRO-DP engine (no DDP wrap).

    Args:
        paro_plugin (`ParoPlugin`, *optional*): PaRO settings; defaults to `ParoPlugin.from_env()` (``PARO_*``
            variables and ``PARO_CONFIG_FILE``, which reach every worker of ``accelerate launch``).
        *args, **kwargs: passed to `Accelerator`. ``deepspeed_plugin`` and ``fsdp_plugin`` are rejected: PaRO is the
            data-parallel engine, it cannot be combined with another one.

    Launch with several processes: ``accelerate launch --multi_gpu --num_processes N`` or ``torchrun``; on a CPU-only
    machine keep that launcher and pass ``cpu=True`` (Accelerate's ``--cpu`` multi-process path needs mpirun).
    """

    def __init__(self, *args: Any, paro_plugin: ParoPlugin | None = None, **kwargs: Any):
        for key, what in (("deepspeed_plugin", "DeepSpeed"), ("deepspeed_plugins", "DeepSpeed"),
                          ("fsdp_plugin", "FSDP")):
            if kwargs.get(key) is not None:
                raise ValueError(f"ParoAccelerator got {key}={type(kwargs[key]).__name__}: PaRO replaces {what} as the "
                                 f"data-parallel engine. Remove the {what} plugin (and its accelerate config section) "
                                 "or use a plain Accelerator.")
        for var, what in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")):
            if os.environ.get(var, "false").lower() in ("1", "true", "yes"):
                raise ValueError(f"{var} is set: the launch config enables {what}, which PaRO replaces. Launch with a "
                                 "plain MULTI_GPU/MULTI_CPU accelerate config and pass PaRO settings through "
                                 "PARO_CONFIG_FILE or a ParoPlugin.")
        if paro_plugin is not None and not isinstance(paro_plugin, ParoPlugin):
            raise TypeError(f"paro_plugin must be a ParoPlugin, got {type(paro_plugin).__name__}.")
        self.paro_plugin = paro_plugin if paro_plugin is not None else ParoPlugin.from_env()
        super().__init__(*args, **kwargs)
        release_process_groups_at_exit()  # scripts rarely call end_training(): see hf_placement.lifecycle
        if getattr(self.state, "deepspeed_plugin", None) is not None or getattr(self.state, "fsdp_plugin", None):
            raise ValueError("The Accelerate state has a DeepSpeed or FSDP plugin; PaRO replaces them. Launch with a "
                             "plain MULTI_GPU/MULTI_CPU accelerate config.")
        if self.distributed_type not in _SUPPORTED:
            hint = (" (CPU-only machine: `accelerate launch --multi_gpu --num_processes N` uses the torchrun launcher; "
                    "build the accelerator with cpu=True / TrainingArguments(use_cpu=True))"
                    if not torch.cuda.is_available() else "")
            raise ValueError(f"ParoAccelerator needs a multi-process data-parallel launch, got distributed_type="
                             f"{self.distributed_type}. Launch with `accelerate launch --num_processes N`{hint} or "
                             "torchrun.")
        # Checks group_size against the launch now (not at prepare): a clear error before any model work.
        self.paro_plugin.to_paro_config().resolve_group_size(self.num_processes)
        self.paro_engine: ParoEngine | None = None
        self.paro_guideline: GuidelineTable | None = None  # the table behind strategy="auto", set by prepare()

    # ----------------------------------------------------------------------------------------------- prepare
    def _paro_config(self, model: nn.Module):
        """The plugin's settings under this accelerator, with ``strategy="auto"`` resolved for ``model``
        (collective: every rank measures the links the guideline needs, unless the plugin gives them)."""
        mp = self.mixed_precision if self.mixed_precision in ("bf16", "fp16") else "no"
        config = self.paro_plugin.to_paro_config(mixed_precision=mp,
                                                 gradient_accumulation_steps=self.gradient_accumulation_steps)
        resolved = resolve_strategy(config, model)
        self.paro_guideline = resolved.guideline
        return resolved.config

    def prepare(self, *args: Any, device_placement=None):
        """Models and optimizers pair up into one `ParoEngine` (exactly one of each, or an already built engine);
        everything else (dataloaders, schedulers) is prepared by `Accelerator.prepare`."""
        models = [i for i, a in enumerate(args) if isinstance(a, nn.Module) and not isinstance(a, ParoEngine)]
        optims = [i for i, a in enumerate(args) if isinstance(a, torch.optim.Optimizer)]
        out = list(args)
        if models or optims:
            if len(models) != 1 or len(optims) != 1:
                raise ValueError(f"ParoAccelerator.prepare needs the model and its optimizer together in one call "
                                 f"(got {len(models)} model(s) and {len(optims)} optimizer(s)): PaRO shards the "
                                 "optimizer state with the parameters. Call prepare(model, optimizer, ...).")
            if self.paro_engine is not None:
                raise ValueError("ParoAccelerator already prepared a model; one PaRO engine per accelerator.")
            model, optimizer = args[models[0]], args[optims[0]]
            if isinstance(optimizer, AcceleratedOptimizer):
                optimizer = optimizer.optimizer
            model = model.to(self.device)
            engine = ParoEngine(model, optimizer, self._paro_config(model))
            self.paro_engine = engine
            wrapped = AcceleratedOptimizer(ParoOptimizer(engine, optimizer), device_placement=False, scaler=None)
            self._models.append(engine)
            self._optimizers.append(wrapped)
            out[models[0]], out[optims[0]] = engine, wrapped
            logger.info("PaRO engine ready: strategy %s, %d ranks, group size %d", engine.strategy,
                        engine.world_size, engine.group_size)
        rest = [i for i in range(len(args)) if i not in models and i not in optims]
        if rest:
            prepared = super().prepare(*[args[i] for i in rest], device_placement=device_placement)
            prepared = prepared if len(rest) > 1 else (prepared,)
            for i, obj in zip(rest, prepared):
                out[i] = obj
        return out[0] if len(out) == 1 else tuple(out)

    def _engine_of(self, model: Any) -> ParoEngine | None:
        if isinstance(model, ParoEngine):
            return model
        if self.paro_engine is not None and (model is None or model is self.paro_engine.module):
            return self.paro_engine
        return None

    # --------------------------------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Divide by the accumulation steps (as Accelerate does); the engine averages over ranks (sum, then / n)."""
        if self.paro_engine is None:
            return super().backward(loss, **kwargs)
        if kwargs.get("learning_rate") is not None:
            raise ValueError("LOMO-style backward(learning_rate=...) is not supported with PaRO.")
        self.paro_engine.backward(loss / self.gradient_accumulation_steps)

    @contextlib.contextmanager
    def no_sync(self, model):  # Accelerate's version already duck-types; kept explicit for the engine
        engine = self._engine_of(model)
        if engine is None:
            with super().no_sync(model):
                yield
            return
        with engine.no_sync():
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Global gradient norm over all ranks' shards (one scalar all-reduce), clipped to ``max_norm``."""
        if self.paro_engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        return self.paro_engine.clip_grad_norm_(float(max_norm), norm_type)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's module. Under a strategy that partitions parameters they are only materialised inside
        ``summon_full_params``; use `get_state_dict` for the weights."""
        if isinstance(model, ParoEngine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    @contextlib.contextmanager
    def summon_full_params(self, model=None) -> Iterator[None]:
        """Collective: full working parameters inside the block (e.g. for ``generate`` or inspection): one gather
        at entry, none per layer while inside (the engine's ``gathered()``)."""
        engine = self._engine_of(model)
        if engine is None:
            raise ValueError("summon_full_params needs a model prepared by this ParoAccelerator.")
        with engine.gathered():
            yield

    # ----------------------------------------------------------------------------------------------- weights
    def get_state_dict(self, model, unwrap=True):
        """Collective (every rank must call it): the full fp32 weights by parameter name, on every rank."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return engine.consolidated_state_dict()

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """Collective: gather the full weights; the main process writes ``model.safetensors`` (+ ``config.json`` for
        Hugging Face models, so ``from_pretrained(save_directory)`` loads it)."""
        engine = self._engine_of(model)
        if engine is None:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        if not safe_serialization:
            raise ValueError("PaRO writes safetensors only; call save_model(..., safe_serialization=True).")
        engine.save_consolidated(str(save_directory), include_optimizer=False)

    # ------------------------------------------------------------------------------------------- checkpoints
    @contextlib.contextmanager
    def _without_engine(self) -> Iterator[None]:
        models, optims = self._models, self._optimizers
        self._models = [m for m in models if not isinstance(m, ParoEngine)]
        self._optimizers = [o for o in optims if not isinstance(getattr(o, "optimizer", None), ParoOptimizer)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optims

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any):
        """Collective: the engine's per-rank shards + topology metadata under ``output_dir/paro_sharded``, then
        Accelerate's own state (schedulers, samplers, RNG, registered objects). Resume with the same topology."""
        if self.paro_engine is None:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if output_dir is None:
            raise ValueError("ParoAccelerator.save_state needs an explicit output_dir.")
        self.paro_engine.save_sharded(os.path.join(output_dir, SHARDED_DIR))
        with self._without_engine():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any):
        if self.paro_engine is None:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if input_dir is None:
            raise ValueError("ParoAccelerator.load_state needs an explicit input_dir.")
        self.paro_engine.load_sharded(os.path.join(input_dir, SHARDED_DIR))
        with self._without_engine():
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
