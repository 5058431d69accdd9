"""Which engine trains policy + value model, read from the launch (``accelerate launch --config_file ...``).

A TRL PPO script picks its engine by the accelerate config it is launched with, never in code. ``accelerate launch``
passes the config to every worker as environment variables (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP``,
``FSDP_VERSION``, ...); PaRO settings travel as ``PARO_CONFIG_FILE`` / ``PARO_<FIELD>`` next to a plain multi-process
accelerate config (Accelerate rejects unknown keys in its own YAML). `launch_engine_from_env` turns those variables
into one `LaunchEngine`, and refuses combinations this trainer cannot honour with the key to change.

- ``"replicated"``: a plain launch (``python``, ``torchrun``) or an accelerate DDP/multi-CPU config: full models on
  every rank, gradients averaged once per optimizer step (DDP's result);
- ``"deepspeed"``: DeepSpeed ZeRO stage 0-3 as the accelerate config's ``deepspeed_config`` says;
- ``"fsdp2"``: PyTorch FSDP2 (``fully_shard``) as the accelerate config's ``fsdp_config`` says;
- ``"paro"``: the PaRO engine (`paro_zero_backend`) with the strategy of the PaRO config.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["LaunchEngine", "launch_engine_from_env"]

EngineKind = Literal["replicated", "deepspeed", "fsdp2", "paro"]
_TRUE = {"1", "true", "yes", "on"}


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return str(environ.get(name, "")).strip().lower() in _TRUE


@dataclass(frozen=True)
class LaunchEngine:
    """The engine named by the launch: ``kind``, and for PaRO its strategy and ranks per intra group.

    ``source`` says which variable decided, for error messages and logs.
    """

    kind: EngineKind = "replicated"
    source: str = "plain launch or data-parallel accelerate config"
    paro_strategy: str | None = None
    paro_group_size: int | None = None
    zero_stage: int | None = None

    @property
    def is_accelerate_engine(self) -> bool:
        """DeepSpeed or FSDP2: models prepared by `accelerate.Accelerator.prepare` over the whole world."""
        return self.kind in ("deepspeed", "fsdp2")


def _paro_requested(environ: Mapping[str, str]) -> bool:
    return any(k == "PARO_CONFIG_FILE" or k == "PARO_STRATEGY" for k in environ)


def _zero_stage(env: Mapping[str, str]) -> int:
    """ZeRO stage of a DeepSpeed launch: the accelerate config's ``zero_stage``, or the stage in its
    ``deepspeed_config_file``."""
    stage = str(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")).strip()
    if stage.isdigit():
        return int(stage)
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and path != "None":
        import json

        try:
            with open(path) as f:
                value = json.load(f).get("zero_optimization", {}).get("stage", 0)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the DeepSpeed config file {path!r} named by the accelerate config "
                             f"(deepspeed_config_file): {exc}. Fix the path or the JSON.") from exc
        return int(value)
    return 0


def launch_engine_from_env(environ: Mapping[str, str] | None = None) -> LaunchEngine:
    """The `LaunchEngine` of this process, from the variables ``accelerate launch`` (and a PaRO config) set."""
    env = os.environ if environ is None else environ
    deepspeed = _flag(env, "ACCELERATE_USE_DEEPSPEED")
    fsdp = _flag(env, "ACCELERATE_USE_FSDP")
    paro = _paro_requested(env)
    if _flag(env, "ACCELERATE_USE_MEGATRON_LM"):
        raise ValueError("the accelerate config sets `distributed_type: MEGATRON_LM`, which PPOTrainer cannot honour. "
                         "Use `distributed_type: DEEPSPEED` (TRL's deepspeed_zero{1,2,3}.yaml), `FSDP` with "
                         "`fsdp_version: 2` (fsdp2.yaml), or a multi-process config with a PaRO config file.")
    if paro and (deepspeed or fsdp):
        other = "DEEPSPEED" if deepspeed else "FSDP"
        raise ValueError(f"PARO_CONFIG_FILE / PARO_STRATEGY is set together with an accelerate config of "
                         f"`distributed_type: {other}`: both name the engine that trains the models. Launch the PaRO "
                         "config with a plain multi-process accelerate config (`distributed_type: MULTI_CPU` or "
                         "`MULTI_GPU`, e.g. examples/ppo/multi_gpu.yaml), or unset the PARO_* variables.")
    if deepspeed:
        stage = _zero_stage(env)
        return LaunchEngine("deepspeed", source=f"accelerate config with DeepSpeed ZeRO-{stage}", zero_stage=stage)
    if fsdp:
        version = str(env.get("FSDP_VERSION", "1")).strip()
        if version != "2":
            raise ValueError(f"the accelerate config runs FSDP version {version} (fsdp_config.fsdp_version); "
                             "PPOTrainer trains with FSDP2 only. Set `fsdp_version: 2` in the accelerate config "
                             "(as TRL's fsdp2.yaml does).")
        return LaunchEngine("fsdp2", source="ACCELERATE_USE_FSDP=true, FSDP_VERSION=2")
    if paro:
        from accelerate_plugins import ParoPlugin

        plugin = ParoPlugin.from_env(dict(env))
        if plugin.strategy == "auto":
            raise ValueError("the PaRO config asks for strategy 'auto', which PPOTrainer does not resolve (the "
                             "guideline needs a calibrated step). Name a strategy, e.g. `strategy: IIG` in the PaRO "
                             "config file or PARO_STRATEGY=IIG; `python -m paro_zero_backend advise` ranks them.")
        return LaunchEngine("paro", source=f"PaRO config (strategy {plugin.strategy})", paro_strategy=plugin.strategy,
                            paro_group_size=plugin.group_size)
    return LaunchEngine()
