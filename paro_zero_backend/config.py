"""`ParoConfig`: the settings of a PaRO-DP engine (strategy, group size, buckets, PaRO-CC, precision, clipping)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hf_placement.partition import Strategy, parse_strategy

__all__ = ["ParoConfig"]

_PRECISIONS = {"no": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


@dataclass
class ParoConfig:
    """Configuration of `ParoEngine`.

    Paper: "Rethinking Memory and Communication Costs for Efficient Data Parallel Training of Large Language Models"
    (NeurIPS 2024, https://openreview.net/forum?id=4Un2TD9bNe).

    Parameters:
        > Parameters that choose the strategy

        strategy (`str`, *optional*, defaults to `"IIG"`):
            Partition levels of parameters, gradients and optimizer states as three letters from N (replicated),
            I (split inside a group of `group_size` ranks) and G (split over all ranks), e.g. `"NNG"` = ZeRO-1,
            `"GGG"` = ZeRO-3, `"III"` = MiCS/HSDP. `"auto"` lets the guideline (`paro_zero_backend.advise`) pick from
            the real model size and the measured or given bandwidths; it is resolved before the engine is built, by
            `paro_zero_backend.resolve_strategy` (`ParoAccelerator` and `deepspeed_initialize` call it).
        group_size (`int`, *optional*):
            Ranks per group `m` (usually GPUs per node). Defaults to `LOCAL_WORLD_SIZE`, else the world size.
        > Parameters that control communication

        bucket_size (`int`, *optional*, defaults to `50_000_000`):
            Maximum elements per flat bucket. Parameters are packed into buckets per wrapped unit (the root module
            and each child of a `ModuleList`), each padded to a multiple of the world size.
        paro_cc (`bool`, *optional*, defaults to `True`):
            Use hierarchical (intra- then inter-group) collectives for global operations; `False` uses flat
            world-group collectives (the ZeRO baseline).
        > Parameters that control precision

        mixed_precision (`str`, *optional*, defaults to `"no"`):
            `"no"`/`"fp32"`, `"bf16"` or `"fp16"`: dtype of the working parameters used in forward/backward. The
            optimizer always updates an fp32 master copy of this rank's os shard.
        reduce_dtype (`str`, *optional*):
            Dtype of gradient communication and accumulation; defaults to the compute dtype, as in the paper (2 bytes
            per gradient element). `"fp32"` trades memory and traffic for accuracy.
        initial_loss_scale (`float`, *optional*, defaults to `65536.0`): fp16 only: starting dynamic loss scale.
        loss_scale_window (`int`, *optional*, defaults to `1000`): fp16 only: clean steps before the scale doubles.
        min_loss_scale (`float`, *optional*, defaults to `1.0`): fp16 only: lower bound of the loss scale.
        max_grad_norm (`float`, *optional*):
            If set, `step()` clips the global gradient norm to this value (one scalar all-reduce).
        > Parameters for `strategy="auto"` (guideline inputs)

        gradient_accumulation_steps (`int`, *optional*, defaults to `1`): `s` in the cost model.
        bandwidth_intra_gbps (`float`, *optional*): intra-group bandwidth per rank; measured when not given.
        bandwidth_inter_gbps (`float`, *optional*): inter-group bandwidth per rank; measured when not given.
        device_memory_gb (`float`, *optional*): memory per device for the fit check; no check when not given.
        working_memory_gb (`float`, *optional*): activations and buffers on top of model states (see `advise`).
        compute_time_s (`float`, *optional*, defaults to `0.0`): compute time of one optimizer step.
        > Other

        unit_module_classes (`list[str]`, *optional*):
            Class names of modules whose parameters are gathered and released together; defaults to the children
            of every `nn.ModuleList` (transformer blocks) plus the root. `[]`: no such units, so the root and the
            engine's ``extra_units`` are each gathered whole per call (fewer, larger collectives).
        reshard_after_forward (`bool`, *optional*, defaults to `True`):
            FSDP2's knob: release a unit's gathered parameters right after its forward and gather them again for its
            backward (lowest memory), or keep them from the forward to the backward (one parameter gather per
            micro-step instead of two). With whole-model units (``unit_module_classes=[]``) keeping them costs no peak
            memory: the whole unit is gathered during its forward anyway. Forwards without gradients always release.
        timeout_s (`float`, *optional*, defaults to `600.0`): timeout of the process groups the engine creates.
    """

    strategy: str = field(default="IIG", metadata={"help": "PaRO strategy (p, g, os levels from N/I/G) or 'auto'."})
    group_size: int | None = field(default=None, metadata={"help": "Ranks per group m; defaults to LOCAL_WORLD_SIZE."})
    bucket_size: int = field(default=50_000_000, metadata={"help": "Maximum elements per flat bucket."})
    paro_cc: bool = field(default=True, metadata={"help": "Hierarchical (PaRO-CC) global collectives."})
    mixed_precision: str = field(default="no", metadata={"help": "'no'/'fp32', 'bf16' or 'fp16' compute dtype."})
    reduce_dtype: str | None = field(default=None, metadata={"help": "Gradient communication dtype."})
    initial_loss_scale: float = field(default=2.0**16, metadata={"help": "fp16: initial dynamic loss scale."})
    loss_scale_window: int = field(default=1000, metadata={"help": "fp16: clean steps before doubling the scale."})
    min_loss_scale: float = field(default=1.0, metadata={"help": "fp16: minimum loss scale."})
    max_grad_norm: float | None = field(default=None, metadata={"help": "Clip the global grad norm in step()."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "s, for the guideline ('auto')."})
    bandwidth_intra_gbps: float | None = field(default=None, metadata={"help": "Intra-group Gbit/s ('auto')."})
    bandwidth_inter_gbps: float | None = field(default=None, metadata={"help": "Inter-group Gbit/s ('auto')."})
    device_memory_gb: float | None = field(default=None, metadata={"help": "Device memory in GB ('auto')."})
    working_memory_gb: float | None = field(default=None, metadata={"help": "Activation/buffer GB ('auto')."})
    compute_time_s: float = field(default=0.0, metadata={"help": "Compute seconds per optimizer step ('auto')."})
    unit_module_classes: list[str] | None = field(default=None, metadata={"help": "Module classes gathered as one."})
    reshard_after_forward: bool = field(default=True, metadata={
        "help": "Release a unit's gathered parameters after its forward (True) or keep them until its backward."})
    timeout_s: float = field(default=600.0, metadata={"help": "Timeout of engine process groups (s)."})

    def __post_init__(self) -> None:
        if isinstance(self.strategy, Strategy):
            self.strategy = self.strategy.name
        if not isinstance(self.strategy, str):
            raise TypeError(f"strategy must be a string such as 'IIG' or 'auto', got {type(self.strategy).__name__}.")
        self.strategy = self.strategy.strip().upper() if self.strategy.strip().lower() != "auto" else "auto"
        if self.strategy != "auto":
            parse_strategy(self.strategy)  # raises with the list of valid strategies
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"group_size={self.group_size!r} must be a positive integer (ranks per group, usually "
                             "GPUs per node) or None for LOCAL_WORLD_SIZE.")
        if not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"bucket_size={self.bucket_size!r} must be a positive number of elements.")
        self.mixed_precision = str(self.mixed_precision).lower()
        if self.mixed_precision not in _PRECISIONS:
            raise ValueError(f"mixed_precision={self.mixed_precision!r} is not supported; use one of "
                             f"{sorted(_PRECISIONS)}.")
        if self.reduce_dtype is not None and str(self.reduce_dtype).lower() not in _DTYPES:
            raise ValueError(f"reduce_dtype={self.reduce_dtype!r} is not supported; use one of {sorted(_DTYPES)} or "
                             "None (same as the compute dtype).")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be positive, or None to disable clipping.")
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={self.gradient_accumulation_steps} must be >= 1.")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0 or self.loss_scale_window < 1:
            raise ValueError("initial_loss_scale and min_loss_scale must be positive and loss_scale_window >= 1 "
                             f"(got {self.initial_loss_scale}, {self.min_loss_scale}, {self.loss_scale_window}).")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be positive: every process group needs a timeout.")

    # --- derived values ----------------------------------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return _PRECISIONS[self.mixed_precision]

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.compute_dtype if self.reduce_dtype is None else _DTYPES[str(self.reduce_dtype).lower()]

    def resolve_group_size(self, world_size: int) -> int:
        """Explicit value, else ``LOCAL_WORLD_SIZE``, else the world size; checked against ``world_size``."""
        m = self.group_size if self.group_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % m:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(f"group_size={m} does not divide the world size {world_size}: groups must be equal sets "
                             f"of consecutive ranks. Set group_size to one of {divisors} (usually ranks per node).")
        return m

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
