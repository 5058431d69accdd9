"""`ParoPlugin`: PaRO-DP settings for Accelerate, from kwargs, a YAML/JSON file or ``PARO_*`` environment variables.

Why a separate file/env route: ``accelerate launch`` validates its YAML against its own dataclasses and rejects unknown
keys, so PaRO settings cannot live in the Accelerate config. ``PARO_CONFIG_FILE=paro.yaml accelerate launch ...`` (or
``PARO_STRATEGY=IIG ...``) reaches every worker because the launcher passes the environment on.
Precedence: explicit argument > ``PARO_<FIELD>`` variable > ``PARO_CONFIG_FILE`` file > default.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from paro_zero_backend import ParoConfig

__all__ = ["ParoPlugin"]

ENV_PREFIX = "PARO_"
CONFIG_FILE_ENV = "PARO_CONFIG_FILE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass
class ParoPlugin:
    """PaRO-DP settings used by `ParoAccelerator` / `ParoTrainer` (converted to `paro_zero_backend.ParoConfig`).

    Build it with keyword arguments, `ParoPlugin.from_file(path)` (YAML or JSON), or `ParoPlugin.from_env()`
    (``PARO_CONFIG_FILE`` and ``PARO_<FIELD>`` variables, e.g. ``PARO_STRATEGY=NIG``, ``PARO_GROUP_SIZE=2``).
    """

    strategy: str = field(default="IIG", metadata={"help": "PaRO strategy (p, g, os levels from N/I/G, e.g. 'IIG', "
                                                           "'NNN' = DDP) or 'auto' for the guideline."})
    group_size: int | None = field(default=None, metadata={"help": "Ranks per group m (usually processes per node); "
                                                                     "defaults to LOCAL_WORLD_SIZE."})
    paro_cc: bool = field(default=True, metadata={"help": "Hierarchical (PaRO-CC) global collectives."})
    bucket_size: int = field(default=50_000_000, metadata={"help": "Maximum elements per flat bucket."})
    mixed_precision: str | None = field(default=None, metadata={"help": "'no', 'bf16' or 'fp16'; defaults to the "
                                                                         "Accelerator's mixed_precision."})
    reduce_dtype: str | None = field(default=None, metadata={"help": "Gradient communication dtype."})
    bandwidth_intra_gbps: float | None = field(default=None, metadata={"help": "Intra-group Gbit/s ('auto')."})
    bandwidth_inter_gbps: float | None = field(default=None, metadata={"help": "Inter-group Gbit/s ('auto')."})
    device_memory_gb: float | None = field(default=None, metadata={"help": "Device memory in GB ('auto')."})
    working_memory_gb: float | None = field(default=None, metadata={"help": "Activation/buffer GB ('auto')."})
    compute_time_s: float = field(default=0.0, metadata={"help": "Compute seconds per optimizer step ('auto')."})
    timeout_s: float = field(default=600.0, metadata={"help": "Timeout of the engine's process groups (s)."})

    def __post_init__(self) -> None:
        if self.mixed_precision is not None:
            self.mixed_precision = str(self.mixed_precision).lower()
        # ParoConfig holds the real validation (strategy names, group size, dtypes); run it now so errors show at
        # configuration time rather than at prepare().
        self.strategy = self.to_paro_config().strategy

    # --------------------------------------------------------------------------------------------- conversion
    def to_paro_config(self, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1) -> ParoConfig:
        """The engine config; ``mixed_precision`` (the Accelerator's) is used when this plugin does not set one."""
        mp = self.mixed_precision if self.mixed_precision is not None else (mixed_precision or "no")
        return ParoConfig(strategy=self.strategy, group_size=self.group_size, bucket_size=self.bucket_size,
                          paro_cc=self.paro_cc, mixed_precision=mp, reduce_dtype=self.reduce_dtype,
                          gradient_accumulation_steps=gradient_accumulation_steps,
                          bandwidth_intra_gbps=self.bandwidth_intra_gbps,
                          bandwidth_inter_gbps=self.bandwidth_inter_gbps, device_memory_gb=self.device_memory_gb,
                          working_memory_gb=self.working_memory_gb, compute_time_s=self.compute_time_s,
                          timeout_s=self.timeout_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------------------------------- constructors
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def _check_keys(cls, values: dict[str, Any], source: str) -> None:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{source} has unknown PaRO keys {unknown}; valid keys are {cls.field_names()}.")

    @classmethod
    def read_file(cls, path: str | os.PathLike) -> dict[str, Any]:
        """The key/value pairs of a YAML (``.yaml``/``.yml``) or JSON file, checked against the plugin's fields."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"PaRO config file {str(p)!r} does not exist (set by argument or "
                                    f"{CONFIG_FILE_ENV}); point it at a YAML or JSON file with keys "
                                    f"{cls.field_names()}.")
        text = p.read_text()
        if p.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"PaRO config file {str(p)!r}: unknown extension {p.suffix!r}; use .yaml, .yml or .json.")
        if not isinstance(data, dict):
            raise ValueError(f"PaRO config file {str(p)!r} must hold a mapping of keys to values, got "
                             f"{type(data).__name__}.")
        if "paro" in data and isinstance(data["paro"], dict) and len(data) == 1:
            data = data["paro"]  # allow a top-level ``paro:`` section
        cls._check_keys(data, f"PaRO config file {str(p)!r}")
        return data

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> ParoPlugin:
        values = cls.read_file(path)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def read_env(cls, environ: dict[str, str] | None = None) -> dict[str, Any]:
        """Values from ``PARO_CONFIG_FILE`` then ``PARO_<FIELD>`` variables (variables win), converted by field type."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        if env.get(CONFIG_FILE_ENV):
            values.update(cls.read_file(env[CONFIG_FILE_ENV]))
        names = {f"{ENV_PREFIX}{name.upper()}": name for name in cls.field_names()}
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in names and k != CONFIG_FILE_ENV)
        if unknown:
            raise ValueError(f"unknown PaRO environment variables {unknown}; valid ones are {sorted(names)} and "
                             f"{CONFIG_FILE_ENV}. Unset them or fix the name.")
        types = {f.name: str(f.type) for f in fields(cls)}
        for var, name in names.items():
            if var in env:
                values[name] = _convert(var, env[var], types[name])
        return values

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **explicit: Any) -> ParoPlugin:
        """Defaults < ``PARO_CONFIG_FILE`` < ``PARO_<FIELD>`` variables < ``explicit`` keyword arguments."""
        cls._check_keys(explicit, "ParoPlugin.from_env(...) keyword arguments")
        values = cls.read_env(environ)
        values.update(explicit)
        return cls(**values)


def _convert(var: str, raw: str, type_name: str) -> Any:
    """Parse one environment value by the field's annotated type (annotations are strings here)."""
    text = raw.strip()
    optional = "None" in type_name
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError("expected true/false")
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
    except ValueError as exc:
        raise ValueError(f"environment variable {var}={raw!r} is not a valid {type_name.split(' ')[0]} ({exc}); "
                         "fix or unset it.") from exc
    return text
