"""PaRO-CC inside FSDP2: hierarchical all-gather / reduce-scatter for modules wrapped with ``fully_shard``.

FSDP2 lets a module replace the collective it issues for its parameter group (``FSDPModule.set_custom_all_gather``
and ``set_custom_reduce_scatter``, protocols ``AllGather`` / ``ReduceScatter`` in
``torch.distributed.fsdp._fully_shard._fsdp_api``). FSDP calls them with exactly the flat-tensor shapes of
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` over its shard group (rank ``r``'s chunk at
``r * numel``), which is what `hierarchical_all_gather` / `hierarchical_reduce_scatter` produce with
``order="rank"``. So FSDP keeps its sharding, prefetching and optimizer; only the wire pattern changes from one flat
ring (every step at inter-node speed) to intra-group + inter-group rings (paper §3.2). No FSDP code is forked.

Why ``set_force_sum_reduction_for_comms(True)``: for fp32/bf16 FSDP asks the reduce-scatter for ``AVG`` or
``PREMUL_SUM(1/f)``; the scale of a ``PREMUL_SUM`` op cannot be read back from Python, so we make FSDP divide outside
the collective and keep the collective a plain sum (what PaRO-CC implements). The result is the same average.

Use::

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    handle = enable_paro_cc(model, group_size=8)   # 8 ranks per node
    ...                                            # train as usual; handle.counter holds intra/inter bytes
    handle.disable()                               # back to FSDP's flat collectives

Only full sharding over the whole world (a 1-D mesh: FULL_SHARD / ZeRO-3) is routed: HSDP already keeps the
per-step collectives inside the node, so PaRO-CC has nothing to change there and the call refuses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hf_placement import build_topology

from .collectives import CommCounter, hierarchical_all_gather, hierarchical_reduce_scatter

__all__ = ["ParoCCAllGather", "ParoCCReduceScatter", "ParoCCHandle", "enable_paro_cc", "fsdp_modules"]

logger = logging.getLogger(__name__)

try:  # recent torch exposes FSDP2's custom-collective protocols; the package must still import without them
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed torch
    FSDPModule = AllGather = ReduceScatter = DefaultAllGather = DefaultReduceScatter = object
    _IMPORT_ERROR = exc


def _require_hooks() -> None:
    if _IMPORT_ERROR is not None:
        raise ImportError(
            f"PaRO-CC for FSDP2 needs fully_shard's custom collective hooks (set_custom_all_gather / "
            f"set_custom_reduce_scatter); torch {torch.__version__} does not have them ({_IMPORT_ERROR}). Upgrade "
            "torch, or use ParoEngine (paro_cc=True) instead."
        )


def _check_group(group: dist.ProcessGroup | None, topology, who: str) -> None:
    """The collective's group must be the topology's world (same ranks, same order) for the block layout to match."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if ranks != list(topology.ranks):
        raise ValueError(
            f"{who}: PaRO-CC got a collective over ranks {ranks}, but its topology spans ranks "
            f"{list(topology.ranks)}. Only full sharding over the whole world (a 1-D device mesh) is supported; "
            "with HSDP (2-D mesh) the shard group is already inside one node, so leave PaRO-CC off there."
        )


def _reduce_op_kind(op) -> str:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    raise ValueError(f"PaRO-CC reduce-scatter supports SUM and AVG, got {op!r}. Call "
                     "module.set_force_sum_reduction_for_comms(True) (enable_paro_cc does) so FSDP scales outside "
                     "the collective.")


class ParoCCAllGather(AllGather):
    """FSDP2 ``AllGather``: PaRO-CC all-gather (inter-group, then intra-group) into FSDP's output buffer."""

    def __init__(self, topology, counter: CommCounter | None = None):
        self.topology = topology
        self.counter = counter if counter is not None else CommCounter()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        _check_group(group, self.topology, "all-gather")
        hierarchical_all_gather(input_tensor, self.topology, order="rank", counter=self.counter, out=output_tensor)
        return None  # completed: FSDP treats a missing work handle as a synchronous collective


class ParoCCReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter``: PaRO-CC reduce-scatter (intra-group, then inter-group) into FSDP's output buffer."""

    def __init__(self, topology, counter: CommCounter | None = None):
        self.topology = topology
        self.counter = counter if counter is not None else CommCounter()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op,
                 async_op: bool = False):
        kind = _reduce_op_kind(op)
        _check_group(group, self.topology, "reduce-scatter")
        hierarchical_reduce_scatter(input_tensor, self.topology, order="rank", counter=self.counter,
                                    out=output_tensor)
        if kind == "avg":
            output_tensor.div_(self.topology.world_size)
        return None


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` (itself included) wrapped with ``fully_shard``."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@dataclass
class ParoCCHandle:
    """Result of `enable_paro_cc`: the modules it changed, the shared byte counter, and `disable()`."""

    modules: list[FSDPModule]
    topology: object
    counter: CommCounter = field(default_factory=CommCounter)
    active: bool = True

    def disable(self) -> None:
        """Give the modules back FSDP's default (flat) collectives and FSDP's own reduce-op choice."""
        if not self.active:
            return
        for m in self.modules:
            m.set_custom_all_gather(DefaultAllGather())
            m.set_custom_reduce_scatter(DefaultReduceScatter())
            m.set_force_sum_reduction_for_comms(False)
        self.active = False


def enable_paro_cc(model: nn.Module, group_size: int | None = None, *, topology=None,
                   counter: CommCounter | None = None, timeout_s: float = 600.0) -> ParoCCHandle:
    """Route the all-gathers and reduce-scatters of every ``fully_shard`` module in ``model`` through PaRO-CC.

    Collective: every rank must call it, after ``fully_shard`` (or ``accelerator.prepare`` with FSDP2) and before
    the first forward.

    Args:
        model (`nn.Module`): a model containing modules wrapped with ``torch.distributed.fsdp.fully_shard``.
        group_size (`int`, *optional*): ranks per group (node); defaults to ``LOCAL_WORLD_SIZE``. Must divide the
            world size.
        topology (`hf_placement.Topology`, *optional*): reuse existing intra/inter groups instead.
        counter (`CommCounter`, *optional*): where to count the bytes each rank sends (intra / inter).
        timeout_s (`float`, *optional*): timeout of the intra/inter process groups created here.

    Returns:
        `ParoCCHandle`: ``handle.counter`` (bytes by link), ``handle.disable()``.
    """
    _require_hooks()
    if not dist.is_initialized():
        raise RuntimeError("enable_paro_cc needs torch.distributed: initialize the process group (torchrun / "
                           "accelerate launch) and call fully_shard first.")
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no module wrapped with fully_shard: apply "
                         "torch.distributed.fsdp.fully_shard (or prepare the model with Accelerate's FSDP2 plugin, "
                         "fsdp_version=2) before enable_paro_cc.")
    if topology is None:
        topology = build_topology(group_size=group_size, timeout_s=timeout_s)
    elif group_size is not None and topology.group_size != group_size:
        raise ValueError(f"group_size={group_size} disagrees with the given topology's group size "
                         f"{topology.group_size}; pass one or the other.")
    counter = counter if counter is not None else CommCounter()
    for m in modules:
        for pg in m._get_fsdp_state()._fsdp_param_groups:
            info = getattr(pg, "mesh_info", None)
            if getattr(info, "replicate_process_group", None) is not None:
                raise ValueError(f"fully_shard module {type(m).__name__} uses HSDP (a 2-D mesh): its shard group is "
                                 "already inside a node; PaRO-CC only applies to full sharding over the world.")
            shard_pg = getattr(info, "shard_process_group", None)
            if shard_pg is not None:
                _check_group(shard_pg, topology, f"fully_shard module {type(m).__name__}")
    ag, rs = ParoCCAllGather(topology, counter), ParoCCReduceScatter(topology, counter)
    for m in modules:
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        m.set_force_sum_reduction_for_comms(True)
    logger.info("PaRO-CC enabled on %d fully_shard modules (n=%d, m=%d)", len(modules), topology.world_size,
                topology.group_size)
    return ParoCCHandle(modules=modules, topology=topology, counter=counter)
