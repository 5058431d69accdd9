"""Native (C++) kernels of hf-scale-plugins, built on first use and cached; importing this never fails.

Why a loader rather than a compiled wheel: the package installs from source on machines whose CPUs differ (AVX2 only,
AVX-512, AMX), and the kernels are small. `load` compiles a kernel file with ``torch.utils.cpp_extension`` for the CPU
it runs on (``-march=native``) into a cache keyed by the torch version and install, the Python version, the CPU's
flags and the source, so a home directory shared by different machines never loads a binary built for another ISA.
When the build cannot run (no compiler, no ninja, a failed compile) or ``HF_SCALE_NATIVE=0`` is set, `load`
returns ``None`` and says why in `status`; every caller keeps a pure-PyTorch path and chooses it then.
``HF_SCALE_NATIVE=1`` makes a failed build an error instead, for checking that the kernels are really used.

Environment:
    HF_SCALE_NATIVE        ``0``: never build or load (PyTorch fallbacks); ``1``: a failed build raises;
                           unset: build when possible, fall back otherwise.
    HF_SCALE_NATIVE_CACHE  build cache root (default ``~/.cache/hf_scale_plugins/csrc``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["KERNEL_FILES", "cache_dir", "load", "native_mode", "status"]

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_FILES: dict[str, str] = {"tea_kernels": "tea_kernels.cpp"}
_MODES = ("auto", "off", "require")

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_status: dict[str, str] = {}


def native_mode() -> str:
    """``"off"``, ``"require"`` or ``"auto"`` from ``HF_SCALE_NATIVE`` (``0`` / ``1`` / unset)."""
    raw = os.environ.get("HF_SCALE_NATIVE", "").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("0", "off", "false", "no"):
        return "off"
    if raw in ("1", "on", "true", "yes", "require"):
        return "require"
    raise ValueError(f"HF_SCALE_NATIVE={raw!r} is not understood: use 0 (PyTorch fallbacks only), 1 (native kernels "
                     "required) or leave it unset (native when they build).")


def _cpu_key() -> str:
    """A short hash of what ``-march=native`` depends on: the CPU's model name and flags."""
    text = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="ignore").splitlines():
            if line.startswith(("flags", "model name")):
                text += line
            if line.startswith("flags"):
                break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_dir(name: str) -> Path:
    """Build folder of kernel ``name`` for this torch, Python and CPU."""
    import torch  # noqa: PLC0415

    root = Path(os.environ.get("HF_SCALE_NATIVE_CACHE", Path.home() / ".cache" / "hf_scale_plugins" / "csrc"))
    source = (SOURCE_DIR / KERNEL_FILES[name]).read_bytes()
    # The environment's path is part of the key: torch's build check includes the include and library paths, so
    # two virtual environments sharing one folder would rebuild it for each other in turn.
    env = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-cpu{_cpu_key()}" \
          f"-env{env}-src{hashlib.sha256(source).hexdigest()[:10]}"
    return root / name / tag


def load(name: str) -> ModuleType | None:
    """The compiled kernel module ``name`` (see `KERNEL_FILES`), or ``None`` when it is disabled or cannot build."""
    if name not in KERNEL_FILES:
        raise KeyError(f"unknown native kernel {name!r}; known: {sorted(KERNEL_FILES)}")
    with _lock:
        if name in _loaded:
            return _loaded[name]
        mode = native_mode()
        module = None
        if mode == "off":
            _status[name] = "fallback: disabled by HF_SCALE_NATIVE=0"
        else:
            try:
                module = _build(name)
                _status[name] = "native"
            except Exception as exc:  # a missing compiler shows up as several exception types
                if mode == "require":
                    raise RuntimeError(f"native kernel {name!r} failed to build and HF_SCALE_NATIVE=1 requires it: "
                                       f"{exc}. Install g++ and ninja, or unset HF_SCALE_NATIVE.") from exc
                _status[name] = f"fallback: build failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                logger.warning("native kernel %s unavailable, using the PyTorch path: %s", name, _status[name])
        _loaded[name] = module
        return module


def status() -> dict[str, str]:
    """What `load` decided per kernel so far: ``"native"`` or ``"fallback: <reason>"``."""
    with _lock:
        return dict(_status)


def _build(name: str) -> ModuleType:
    from torch.utils import cpp_extension  # noqa: PLC0415

    build = cache_dir(name)
    build.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-march=native", "-fopenmp"]
    return cpp_extension.load(name=f"hf_scale_{name}", sources=[str(SOURCE_DIR / KERNEL_FILES[name])],
                              extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build),
                              verbose=False)
