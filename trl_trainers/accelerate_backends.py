"""Policy + value model trained by the engine an accelerate config names: DeepSpeed ZeRO-0..3 or FSDP2.

TRL's PPO trainer prepared its policy+value wrapper with ``accelerator.prepare`` and the reference and reward models
with DeepSpeed inference engines under ZeRO-3; these backends do the same through Accelerate, so the settings of
TRL's ``deepspeed_zero{1,2,3}.yaml`` and ``fsdp2.yaml`` mean here what they meant there. What differs from
`ReplicatedBackend` is only who owns the weights:

- the training forward goes through the prepared root module (DeepSpeed's and FSDP2's hooks start there);
- backward goes through the engine (DeepSpeed reduces gradients in its own buckets; FSDP2 reduce-scatters at the
  accumulation boundary);
- phases that call a sub-model directly (generation, scoring) run inside `pin`, which gathers the weights the way
  TRL did: under ZeRO-3 the whole policy once per rollout when ``ds3_gather_for_generation`` is true, per layer
  through DeepSpeed's own hooks when false; under FSDP2 the whole wrapper, unsharded once per phase.

The batch, accumulation and clipping fields of the DeepSpeed config are filled from `PPOConfig` where they are
``"auto"`` (as the HF Trainer does: ``gradient_clipping`` from ``max_grad_norm``) and must agree with it where they
are set; an optimizer or scheduler block in the DeepSpeed config is refused (PPOTrainer builds AdamW and the LR
schedule from `PPOConfig`, as TRL did).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from .batch_layout import BatchLayout
from .ppo_config import PPOConfig
from .training_backend import TrainingBackend

__all__ = ["DeepSpeedBackend", "FSDP2Backend", "fill_deepspeed_config", "fsdp2_settings", "model_state_bytes"]


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer at the bottom of Accelerate's and DeepSpeed's wrappers (the one holding the state)."""
    seen = 0
    while optimizer is not None and seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank stores: a DTensor's local shard, a ZeRO-3 parameter's partition, else ``t``."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def model_state_bytes(module: nn.Module, optimizer: Any) -> int:
    """Bytes this rank stores for a trained model's state: parameters (the local shard when sharded), the optimizer's
    own parameter copies (fp32 masters of ZeRO) and its state (AdamW moments), each storage counted once.

    Measured on the tensors the engine holds, not computed from the strategy, so an engine that keeps an extra copy
    shows it."""
    storages: dict[int, int] = {}

    def add(t: Any) -> None:
        local = _local(t) if isinstance(t, torch.Tensor) else None
        if local is not None and local.numel() > 0:  # a ZeRO-3 parameter is empty; its partition is not
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())

    for p in module.parameters():
        add(p)
    inner = _innermost_optimizer(optimizer)
    if inner is not None:
        for group in inner.param_groups:
            for p in group["params"]:
                add(p)
        for state in inner.state.values():
            for value in state.values():
                add(value)
    return sum(storages.values())


# ------------------------------------------------------------------------------------------------------ DeepSpeed
def _fill_or_check(config: dict[str, Any], key: str, value: Any, field_name: str) -> None:
    current = config.get(key, "auto")
    if current == "auto":
        config[key] = value
    elif current != value:
        raise ValueError(f"the DeepSpeed config sets `{key}: {current}` but PPOConfig.{field_name} is {value}, and "
                         f"PPOTrainer's update is laid out from PPOConfig. Set `{key}: auto` in the DeepSpeed config "
                         f"(as TRL's configs do) or pass --{field_name} {current}.")


def fill_deepspeed_config(config: dict[str, Any], args: PPOConfig, layout: BatchLayout) -> None:
    """Fill the ``"auto"`` batch, accumulation and clipping fields of the launch's DeepSpeed config from the PPO
    layout (in place), and refuse settings the PPO update cannot honour, naming the key and the fix."""
    for block in ("optimizer", "scheduler"):
        if block in config:
            raise ValueError(f"the DeepSpeed config has an `{block}` block; PPOTrainer builds AdamW and its LR "
                             "schedule from PPOConfig (learning_rate, lr_scheduler_type, ...), as TRL did. Remove "
                             f"`{block}` from the DeepSpeed config.")
    if config.get("fp16", {}).get("enabled") is True:
        raise ValueError("the DeepSpeed config enables fp16, which PPOTrainer does not support (as with fp16=True); "
                         "set `mixed_precision: bf16` (or 'no') in the accelerate config.")
    _fill_or_check(config, "train_micro_batch_size_per_gpu", layout.train_micro_batch, "per_device_train_batch_size")
    _fill_or_check(config, "gradient_accumulation_steps", layout.accumulation_steps, "gradient_accumulation_steps")
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = float(args.max_grad_norm or 0.0)


def _zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    sizes = getattr(config, "hidden_sizes", None)
    return max(sizes) if sizes else getattr(config, "hidden_size", None)


class DeepSpeedBackend(TrainingBackend):
    """Policy + value wrapper on a DeepSpeed engine prepared by `accelerate.Accelerator` (TRL 1.12's set-up).

    Args:
        model (`PolicyAndValueWrapper`): the trained models (full, or already partitioned by ``zero.Init`` when the
            config was built before the models, TRL's script order).
        optimizer (`torch.optim.Optimizer`): AdamW over the trainable parameters (DeepSpeed keeps its state sharded
            under ZeRO-1/2/3).
        args (`PPOConfig`) / layout (`BatchLayout`): micro-batch, accumulation and clipping for the DeepSpeed config.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, args: PPOConfig, layout: BatchLayout):
        from accelerate import Accelerator

        self.accelerator = Accelerator(gradient_accumulation_steps=layout.accumulation_steps)
        config = self.accelerator.state.deepspeed_plugin.deepspeed_config
        fill_deepspeed_config(config, args, layout)
        self.stage = _zero_stage(config)
        self.args = args
        self.engine, prepared = self.accelerator.prepare(model, optimizer)
        self.optimizer = optimizer  # the torch optimizer DeepSpeed steps: LR schedules act on its param groups
        self._prepared_optimizer = prepared
        self.frozen_engines: list[Any] = []

    # --------------------------------------------------------------------------------- the update
    def zero_grad(self) -> None:
        """DeepSpeed clears gradients itself after each optimizer step."""

    def micro_step(self, last: bool) -> AbstractContextManager[Any]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # the PPO loop already divides by the accumulation steps (or by the mini-batch token count)
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()  # steps the optimizer at the accumulation boundary only

    def step(self) -> None:
        if not self.engine.was_step_applied():
            raise RuntimeError("DeepSpeed did not apply an optimizer step at the end of a PPO mini-batch: its "
                               "gradient_accumulation_steps disagrees with the PPO micro-batches per mini-batch.")

    def train_forward(self, model: nn.Module, query_responses: torch.Tensor, pad_token_id: int,
                      context_length: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine(query_responses, pad_token_id, context_length, temperature)

    # --------------------------------------------------------------------------------- full weights
    @contextmanager
    def _gathered_zero3(self, module: nn.Module) -> Iterator[None]:
        """All of ``module``'s parameters gathered, with the engine's per-module fetch/release hooks lifted for the
        block (otherwise every sub-module call would release what was just gathered); collective."""
        import deepspeed

        offload = getattr(self.engine.optimizer, "parameter_offload", None)
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            hooks = [] if offload is None else list(offload.forward_hooks) + list(offload.backward_hooks)
            if offload is not None:
                for p in offload.module.parameters():
                    p.ds_active_sub_modules.clear()
                for h in hooks:
                    h.remove()
                offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                if offload is not None:
                    coordinator = getattr(offload, "param_coordinator", None)
                    if coordinator is not None and not coordinator.is_invalid_trace():
                        coordinator._invalidate_trace()
                    offload._register_deepspeed_module(offload.module)

    def gathered(self) -> AbstractContextManager[Any]:
        return self._gathered_zero3(self.engine.module) if self.stage == 3 else nullcontext()

    def pin(self, role: str) -> AbstractContextManager[Any]:
        """Generation gathers the policy once per rollout under ZeRO-3 (``ds3_gather_for_generation``); scoring runs
        per layer through DeepSpeed's hooks, as in TRL."""
        if self.stage == 3 and role == "actor":
            return self._gathered_zero3(self.engine.module.policy)
        return nullcontext()

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if self.stage != 3:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        with self._gathered_zero3(module):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def model_state_bytes(self) -> int:
        return model_state_bytes(self.engine.module, self._prepared_optimizer)

    # --------------------------------------------------------------------------------- frozen models
    def prepare_frozen(self, model: nn.Module | None) -> nn.Module | None:
        """Reference / reward model for inference: a ZeRO-3 engine without optimizer when training runs ZeRO-3 (so
        they are sharded too), else the module as it is (full on every rank, as TRL's stage-0 engine holds it)."""
        if model is None or self.stage != 3 or next(model.parameters(), None) is None:
            return model
        import deepspeed

        config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        config.get("zero_optimization", {}).pop("offload_optimizer", None)
        hidden = _hidden_size(model)
        if hidden is not None:
            zero = config.setdefault("zero_optimization", {})
            zero["reduce_bucket_size"] = hidden * hidden
            zero["stage3_param_persistence_threshold"] = 10 * hidden
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        self.frozen_engines.append(engine)
        return engine.module


# ------------------------------------------------------------------------------------------------------ FSDP2
def _env_flag(name: str, default: bool) -> bool:
    import os

    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def fsdp2_settings() -> dict[str, Any]:
    """The accelerate config's ``fsdp_config`` as ``accelerate launch`` exports it (``FSDP_*`` variables), checked
    against what this trainer can honour."""
    import os

    policy = os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").strip().upper()
    if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP", "NONE"):
        raise ValueError(f"fsdp_config.fsdp_auto_wrap_policy={policy} is not supported by PPOTrainer; use "
                         "TRANSFORMER_BASED_WRAP (TRL's fsdp2.yaml: one shard unit per transformer block) or NO_WRAP.")
    names = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    classes = [n.strip() for n in names.split(",") if n.strip() and n.strip() != "None"]
    if _env_flag("FSDP_ACTIVATION_CHECKPOINTING", False):
        raise ValueError("fsdp_config.fsdp_activation_checkpointing=true: PPOTrainer applies activation checkpointing "
                         "from PPOConfig (gradient_checkpointing / activation_checkpointing), for every engine. Set "
                         "fsdp_activation_checkpointing: false and pass --gradient_checkpointing True instead.")
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if mixed == "fp16":
        raise ValueError("mixed_precision: fp16 in the accelerate config is not supported by PPOTrainer; use bf16 "
                         "or no.")
    return {"wrap": policy == "TRANSFORMER_BASED_WRAP", "classes": classes, "mixed_precision": mixed,
            "reshard_after_forward": _env_flag("FSDP_RESHARD_AFTER_FORWARD", True),
            "offload_params": _env_flag("FSDP_OFFLOAD_PARAMS", False)}


def _blocks_to_wrap(model: nn.Module, classes: list[str]) -> list[nn.Module]:
    """The transformer blocks to shard one by one: the named classes, else every ``_no_split_modules`` class of the
    sub-models (what Accelerate's TRANSFORMER_BASED_WRAP uses)."""
    names = set(classes)
    if not names:
        for sub in model.modules():
            names.update(getattr(sub, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


class FSDP2Backend(TrainingBackend):
    """Policy + value wrapper sharded with FSDP2 (``fully_shard``) as the accelerate config's ``fsdp_config`` says.

    Sharded here rather than by ``Accelerator.prepare``: Accelerate 1.16 turns FSDP on only for accelerator devices
    (a CPU launch falls back to no distribution), while ``fully_shard`` itself runs on CPU and GPU alike. Each
    transformer block is a shard unit, then the root (TRANSFORMER_BASED_WRAP); the optimizer is built on the sharded
    parameters; gradients are reduce-scattered once per optimizer step (``set_requires_gradient_sync`` holds them
    on the other micro-steps); reference and reward model stay whole on every rank, as TRL kept them under FSDP.
    """

    def __init__(self, model: nn.Module, make_optimizer: Any, args: PPOConfig, layout: BatchLayout,
                 broadcast_module: Any = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

        settings = fsdp2_settings()
        self.args, self.settings = args, settings
        if broadcast_module is not None:
            broadcast_module(model)  # identical start on every rank (Accelerate's cpu_ram_efficient_loading does too)
        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": settings["reshard_after_forward"]}
        if settings["mixed_precision"] == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if settings["offload_params"]:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if settings["wrap"]:
            for block in _blocks_to_wrap(model, settings["classes"]):
                fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        self.module = model
        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        # The root must be the first FSDP module to run (it owns the parameters outside the wrapped blocks); the
        # phases call sub-models directly, so initialise it as the root now.
        model._get_fsdp_state()._lazy_init()
        self._pinned = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(last)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_forward(self, model: nn.Module, query_responses: torch.Tensor, pad_token_id: int,
                      context_length: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.module(query_responses, pad_token_id, context_length, temperature)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every FSDP module unsharded for the block (re-entrant; collective)."""
        self._pinned += 1
        try:
            if self._pinned == 1:
                for m in self.fsdp_modules:
                    m.set_reshard_after_forward(False, recurse=False)
                    m.unshard()
            yield
        finally:
            self._pinned -= 1
            if self._pinned == 0:
                for m in self.fsdp_modules:
                    m.reshard()
                    m.set_reshard_after_forward(self.settings["reshard_after_forward"], recurse=False)

    def pin(self, role: str) -> AbstractContextManager[Any]:
        """Policy and value model share one root: any phase that calls one of them directly unshards it."""
        return self.gathered() if role in ("actor", "critic") else nullcontext()

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        prefix = next((name + "." for name, m in self.module.named_modules() if m is module and name), "")
        return {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}

    def model_state_bytes(self) -> int:
        return model_state_bytes(self.module, self.optimizer)

    def prepare_frozen(self, model: nn.Module | None) -> nn.Module | None:
        return model
