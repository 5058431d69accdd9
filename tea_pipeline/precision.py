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
import logging
from pathlib import Path

import torch

from .config import MATMUL_PRECISIONS

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU flags /proc/cpuinfo lists (Linux; elsewhere none, i.e. stay on the fp32 paths)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="ignore")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists AMX-BF16 or AVX512-BF16."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def cpu_has_int8_dot() -> bool:
    """True when the CPU has int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX-INT8). Without them PyTorch's
    int8 products run several times slower than fp32 ones (``bench/tea/README.md``)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & _cpu_flags())


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
        if not cpu_has_int8_dot():
            _warn_slow_int8()
        return torch.int8
    return matmul_dtype(precision, device)


@functools.lru_cache(maxsize=1)
def _warn_slow_int8() -> None:
    logger.warning("matmul_precision='int8' on a CPU without int8 dot-product units (AVX512-VNNI, AVX-VNNI or "
                   "AMX-INT8): the search's int8 products run several times slower than fp32 here. Use "
                   "matmul_precision='auto' (fp32 on this CPU).")
