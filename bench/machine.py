"""What a benchmark ran on: the CPU model and the vector / matrix units its kernels may use.

Every result records it, because a speed-up measured on one CPU family does not carry over to another: bf16 matmuls
are fast only with AVX512-BF16 or AMX, and gloo's collectives depend on the memory system as much as on the link.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_info() -> dict:
    """``{"model", "flags" (those of FLAGS the CPU has), "cpus"}`` from /proc/cpuinfo (platform data elsewhere)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model": model, "flags": [f for f in FLAGS if f in flags], "cpus": os.cpu_count()}
