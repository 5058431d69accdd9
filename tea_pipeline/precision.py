"""Which dtype the large approximate products run in (``LightTEAConfig.matmul_precision``).

Two products dominate a LightTEA round: the candidate search in the principal subspace and the triple view's
random projections ``E_bar P``. Both are approximations by design (the leading candidates are re-scored in full
width; the projections are random), so rounding their inputs to bf16 (fp32 accumulation) barely moves the
alignment, while the products run much faster where bf16 is multiplied natively (CUDA, CPUs with AMX or
AVX512-BF16); ``bench/tea/README.md`` has the measured speed and accuracy. Where bf16 is not native it is emulated
and slower than fp32, so ``"auto"`` keeps fp32 there. A CPU whose bf16 units are switched off for oneDNN
(``ONEDNN_MAX_CPU_ISA`` below AVX512_CORE_BF16, as the benchmark's AVX2 variant does) counts as having none.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from .config import MATMUL_PRECISIONS


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16 (Linux; elsewhere False, i.e. stay in fp32)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool({"amx_bf16", "avx512_bf16"} & flags)
    return False


def matmul_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype for the triple view's random projections under ``precision`` on ``device`` (`search_dtype` gives
    the candidate search's)."""
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision={precision!r} is not supported: use one of {MATMUL_PRECISIONS}.")
    if precision in ("float32", "int8"):
        return torch.float32
    if precision == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() and onednn_runs_bf16() else torch.float32


def onednn_runs_bf16() -> bool:
    """Whether oneDNN, which runs PyTorch's bf16 CPU products, may use the bf16 units (honours its ISA cap)."""
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if probe is None:
        return True  # an older/newer build without the probe: trust the CPU flags
    try:
        return bool(probe())
    except RuntimeError:
        return True


def search_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the subspace candidate search's block products under ``precision`` on ``device``: int8 (per-row
    scales, int32 accumulation) for ``"int8"`` on CPU, else the same as `matmul_dtype` (fp32 on CUDA for
    ``"int8"``: measured and tested on CPU only). The search only chooses candidates, whose leading scores are then
    re-scored in full width, so it tolerates int8's rounding where the triple view, whose products become the
    features, is kept in fp32."""
    if precision == "int8" and torch.device(device).type == "cpu":
        return torch.int8
    return matmul_dtype(precision, device)
