"""PaRO-CC inside DeepSpeed ZeRO: route ZeRO's parameter all-gathers and gradient reduce-scatters through PaRO-CC.

Where ZeRO-3 communicates (DeepSpeed 0.16-0.19): parameters are fetched by ``partition_parameters._dist_allgather_fn``
-> ``deepspeed.comm.allgather_fn`` -> ``deepspeed.comm.all_gather_into_tensor`` (also called directly by
``_allgather_param``), and gradients are reduced by ``coalesced_collectives.reduce_scatter_coalesced`` ->
``deepspeed.comm.reduce_scatter_fn`` -> ``deepspeed.comm.reduce_scatter_tensor``. Every one of these ends in the
communication backend object (``deepspeed.comm.comm.cdb``, a ``deepspeed.comm.torch.TorchBackend``), so that is where
we hook: ``TorchBackend.all_gather_into_tensor`` and ``TorchBackend.reduce_scatter_tensor`` are replaced, while the
patch is active, by PaRO-CC versions (inter- then intra-group all-gather; intra- then inter-group reduce-scatter,
paper §3.2). Like the paper authors' DeepSpeed fork, a collective is only rerouted when its group is the whole world
in rank order (ZeRO's data-parallel group); anything else (sub-groups, MAX reductions, tiny tensors below
``min_numel``) goes to DeepSpeed's original method unchanged. Unlike the fork we patch the tensor APIs that ZeRO-3
actually uses, keep ``m`` configurable, and issue no barriers.

The patch is version-guarded (`SUPPORTED_DEEPSPEED`; a clear error names the installed version otherwise) and is
undone exactly on exit. DeepSpeed's CPU shared-memory op is only used by ``inference_all_reduce``, which ZeRO training
does not call, so CPU runs still go through the process groups (the benchmark checks the bytes on the wire).

Use::

    with deepspeed_paro_cc(group_size=8) as cc:     # after deepspeed.init_distributed, on every rank
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        ...train...
    print(cc.counter.bytes)                         # {'intra': ..., 'inter': ..., ...}

or from a DeepSpeed JSON with a ``"paro": {"paro_cc": true, "group_size": 8}`` section, via
`paro_zero_backend.ds_config.initialize`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import torch.distributed as dist

from hf_placement import build_topology

from .collectives import CommCounter, hierarchical_all_gather, hierarchical_reduce_scatter

__all__ = ["SUPPORTED_DEEPSPEED", "DeepSpeedParoCC", "UnsupportedDeepSpeedError", "check_deepspeed_version",
           "deepspeed_paro_cc"]

logger = logging.getLogger(__name__)

# Versions whose ZeRO call chain was read and tested (see the module docstring).
SUPPORTED_DEEPSPEED = (">=0.16", "<0.20")
_MIN, _MAX = (0, 16), (0, 20)

_LOCK = threading.Lock()
_ACTIVE: DeepSpeedParoCC | None = None


class UnsupportedDeepSpeedError(RuntimeError):
    """The installed DeepSpeed is outside the versions whose communication call sites the patch was written for."""


def _parse(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedDeepSpeedError(f"cannot parse the DeepSpeed version {version!r}.") from exc


def check_deepspeed_version(version: str | None = None) -> str:
    """Raise `UnsupportedDeepSpeedError` unless DeepSpeed ``version`` (default: the installed one) is supported."""
    if version is None:
        try:
            import deepspeed
        except ImportError as exc:
            raise UnsupportedDeepSpeedError("PaRO-CC for DeepSpeed needs deepspeed: pip install "
                                            "'hf-scale-plugins[deepspeed]' (deepspeed>=0.16,<0.20).") from exc
        version = deepspeed.__version__
    if not _MIN <= _parse(version) < _MAX:
        raise UnsupportedDeepSpeedError(
            f"DeepSpeed {version} is not supported by the PaRO-CC patch (supported: deepspeed"
            f"{','.join(SUPPORTED_DEEPSPEED)}): its ZeRO communication call sites were not checked. Install a "
            "supported version (pip install 'deepspeed>=0.16,<0.20'), or use paro_zero_backend.ParoEngine / FSDP2 with "
            "enable_paro_cc instead."
        )
    return version


def _check_call_sites() -> type:
    """The functions ZeRO-3 goes through must still be there; return the backend class to patch."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import partition_parameters

    missing = [name for obj, name in ((TorchBackend, "all_gather_into_tensor"),
                                      (TorchBackend, "reduce_scatter_tensor"),
                                      (TorchBackend, "_reduce_op"),
                                      (ds_comm, "allgather_fn"), (ds_comm, "reduce_scatter_fn"),
                                      (partition_parameters, "_dist_allgather_fn"),
                                      (coalesced_collectives, "reduce_scatter_coalesced"))
               if not hasattr(obj, name)]
    if missing:
        raise UnsupportedDeepSpeedError(f"this DeepSpeed lacks {missing}: its ZeRO communication path changed; the "
                                        "PaRO-CC patch cannot hook it.")
    backend = getattr(ds_comm, "cdb", None)
    if backend is not None and not isinstance(backend, TorchBackend):
        raise UnsupportedDeepSpeedError(f"DeepSpeed's communication backend is {type(backend).__name__}; PaRO-CC "
                                        "hooks the torch.distributed backend (TorchBackend) only.")
    return TorchBackend


class _DoneWork:
    """Handle of a collective that already completed (DeepSpeed waits on the handles it gets back)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


class DeepSpeedParoCC:
    """Context manager: while active, ZeRO's world all-gathers / reduce-scatters run as PaRO-CC collectives.

    Args:
        group_size (`int`, *optional*): ranks per group (node); defaults to ``LOCAL_WORLD_SIZE``; must divide the
            world size.
        topology (`hf_placement.Topology`, *optional*): reuse existing intra/inter groups.
        counter (`CommCounter`, *optional*): counts this rank's PaRO-CC bytes (intra / inter).
        min_numel (`int`, *optional*, defaults to 0): smaller tensors keep DeepSpeed's flat collective (the authors'
            fork used 2**20; with many tiny parameters the two-level latency can outweigh the bandwidth gain).
        timeout_s (`float`, *optional*): timeout of the intra/inter process groups created here.
    """

    def __init__(self, group_size: int | None = None, *, topology=None, counter: CommCounter | None = None,
                 min_numel: int = 0, timeout_s: float = 600.0):
        if min_numel < 0:
            raise ValueError(f"min_numel={min_numel} must be >= 0 (elements below which the flat collective is kept).")
        self.version = check_deepspeed_version()
        self._backend_cls = _check_call_sites()
        if not dist.is_initialized():
            raise RuntimeError("PaRO-CC for DeepSpeed needs torch.distributed: call deepspeed.init_distributed() (or "
                               "dist.init_process_group) on every rank first.")
        if topology is None:
            topology = build_topology(group_size=group_size, timeout_s=timeout_s)
        elif group_size is not None and group_size != topology.group_size:
            raise ValueError(f"group_size={group_size} disagrees with the topology's group size {topology.group_size}.")
        self.topology = topology
        self.counter = counter if counter is not None else CommCounter()
        self.min_numel = int(min_numel)
        self.routed = {"all_gather": 0, "reduce_scatter": 0}
        self.passed_through = {"all_gather": 0, "reduce_scatter": 0}
        self._saved: dict[str, Any] = {}
        self._world_ranks = list(range(topology.world_size))

    # --------------------------------------------------------------------------------------------- routing
    def _routable(self, group, tensor: torch.Tensor) -> bool:
        if tensor.numel() < self.min_numel:
            return False
        if group is None or group is dist.group.WORLD:
            return dist.get_world_size() == self.topology.world_size
        try:
            return dist.get_process_group_ranks(group) == self._world_ranks
        except (RuntimeError, ValueError):  # a group this rank is not part of
            return False

    def _make_all_gather(self, original):
        def all_gather_into_tensor(backend, output_tensor, input_tensor, group=None, async_op=False):
            if not self._routable(group, output_tensor):
                self.passed_through["all_gather"] += 1
                return original(backend, output_tensor, input_tensor, group=group, async_op=async_op)
            self.routed["all_gather"] += 1
            hierarchical_all_gather(input_tensor, self.topology, order="rank", counter=self.counter,
                                    out=output_tensor)
            return _DoneWork()

        return all_gather_into_tensor

    def _make_reduce_scatter(self, original):
        def reduce_scatter_tensor(backend, output_tensor, input_tensor, op=None, group=None, async_op=False):
            torch_op = backend._reduce_op(op) if op is not None else dist.ReduceOp.SUM
            kind = "sum" if torch_op == dist.ReduceOp.SUM else "avg" if torch_op == dist.ReduceOp.AVG else None
            if kind is None or not self._routable(group, input_tensor):
                self.passed_through["reduce_scatter"] += 1
                kwargs = {} if op is None else {"op": op}
                return original(backend, output_tensor, input_tensor, group=group, async_op=async_op, **kwargs)
            self.routed["reduce_scatter"] += 1
            hierarchical_reduce_scatter(input_tensor, self.topology, order="rank", counter=self.counter,
                                        out=output_tensor)
            if kind == "avg":
                output_tensor.div_(self.topology.world_size)
            return _DoneWork()

        return reduce_scatter_tensor

    # ------------------------------------------------------------------------------------------ patch/undo
    def enable(self) -> DeepSpeedParoCC:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not None:
                raise RuntimeError("PaRO-CC is already patched into DeepSpeed in this process; disable the active "
                                   "patch (or leave its `with` block) before enabling another.")
            cls = self._backend_cls
            self._saved = {"all_gather_into_tensor": cls.__dict__["all_gather_into_tensor"],
                           "reduce_scatter_tensor": cls.__dict__["reduce_scatter_tensor"]}
            cls.all_gather_into_tensor = self._make_all_gather(self._saved["all_gather_into_tensor"])
            cls.reduce_scatter_tensor = self._make_reduce_scatter(self._saved["reduce_scatter_tensor"])
            _ACTIVE = self
        logger.info("PaRO-CC patched into DeepSpeed %s (n=%d, m=%d)", self.version, self.topology.world_size,
                    self.topology.group_size)
        return self

    def disable(self) -> None:
        global _ACTIVE
        with _LOCK:
            if _ACTIVE is not self:
                return
            for name, fn in self._saved.items():
                setattr(self._backend_cls, name, fn)
            self._saved = {}
            _ACTIVE = None

    @property
    def active(self) -> bool:
        return _ACTIVE is self

    def __enter__(self) -> DeepSpeedParoCC:
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()


def deepspeed_paro_cc(group_size: int | None = None, **kwargs: Any) -> DeepSpeedParoCC:
    """`DeepSpeedParoCC` ready for ``with`` (or ``.enable()`` / ``.disable()``); see its arguments."""
    return DeepSpeedParoCC(group_size, **kwargs)
