"""``strategy="auto"``: the guideline picks a concrete strategy before an engine is built.

Integrations call `resolve_strategy` while they resolve their configuration (`accelerate_plugins.ParoAccelerator`,
`paro_zero_backend.deepspeed_initialize`, the example scripts); `ParoEngine` itself only takes concrete strategies.
The guideline (paper §3.1.3, `paro_zero_backend.advise`) needs the model's size, the layout and the bandwidths of the
two kinds of links: bandwidths not given in the config are measured here, on the topology the engine will run on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hf_placement import Topology, build_topology, check_collective_device, collective_device

from .collectives import _all_gather_single
from .config import ParoConfig
from .cost_model import GuidelineInputs, GuidelineTable, advise, bytes_per_element

__all__ = ["ResolvedStrategy", "measure_bandwidths", "resolve_strategy"]

logger = logging.getLogger(__name__)

_PROBE_ELEMENTS = 1 << 20  # 4 MiB of fp32 per rank: large enough to be bandwidth-bound on both kinds of link


class ResolvedStrategy(NamedTuple):
    """A config whose strategy is concrete, and the guideline table behind the pick (None when not ``"auto"``)."""

    config: ParoConfig
    guideline: GuidelineTable | None


def measure_bandwidths(topology: Topology, repeats: int = 3, device: torch.device | str | None = None
                       ) -> tuple[float, float]:
    """Gbit/s per rank of an all-gather over the intra group and over the inter group (member 0's figures, sent to
    every member so they all take the same decision). Collective over the topology's members; a group of one rank
    has no link to measure and reports 1e6. ``device``: where the probe tensors live, which should be where the
    engine's buffers will (the model's device: NCCL over GPUs measures other links than gloo over the CPUs);
    defaults to the accelerator the world group's backend serves (`hf_placement.collective_device` with
    ``accelerator_first``), else the CPU."""
    device = (torch.device(device) if device is not None
              else collective_device(topology.world_group, accelerator_first=True))
    check_collective_device(device, topology.world_group, "the bandwidth probe")
    x = torch.ones(_PROBE_ELEMENTS, dtype=torch.float32, device=device)
    out = []
    for group, k in ((topology.intra_group, topology.group_size), (topology.inter_group, topology.num_groups)):
        if k == 1:
            out.append(1e6)
            continue
        buf = x.new_empty(x.numel() * k)
        _all_gather_single(buf, x, group=group)  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            _all_gather_single(buf, x, group=group)
        dt = (time.perf_counter() - t0) / repeats
        out.append((k - 1) * x.numel() * 4 * 8 / dt / 1e9)
    t = torch.tensor(out, dtype=torch.float64, device=device)
    if topology.world_size > 1:
        dist.broadcast(t, src=topology.global_rank(0), group=topology.world_group)
    return float(t[0]), float(t[1])


def resolve_strategy(config: ParoConfig, model: nn.Module, topology: Topology | None = None) -> ResolvedStrategy:
    """``config`` with ``strategy="auto"`` replaced by the guideline's pick for ``model`` on ``topology``.

    Args:
        config (`ParoConfig`): a concrete strategy is returned unchanged (no collective, no table).
        model (`nn.Module`): counts Ψ (all parameters) and Ψ' (trainable ones).
        topology (`hf_placement.Topology`, *optional*): the ranks the engine will run on; defaults to the whole world
            with ``config.group_size`` ranks per group (the engine's default).

    Collective over the topology's members when a bandwidth must be measured: call it on every member. Raises
    `ValueError` when no strategy fits in ``config.device_memory_gb``.

    Example:

    ```python
    resolved = resolve_strategy(ParoConfig(strategy="auto", gradient_accumulation_steps=8), model)
    engine = ParoEngine(model, optimizer, resolved.config)
    print(resolved.guideline.format())
    ```
    """
    if config.strategy != "auto":
        return ResolvedStrategy(config, None)
    if topology is None:
        if not dist.is_initialized():
            raise RuntimeError("strategy='auto' measures the links between ranks: call dist.init_process_group first, "
                               "or give bandwidth_intra_gbps and bandwidth_inter_gbps and a topology.")
        world = dist.get_world_size()
        topology = build_topology(group_size=config.resolve_group_size(world), timeout_s=config.timeout_s)
    if not topology.is_member:
        raise ValueError(f"resolve_strategy runs on the topology's members {list(topology.ranks)}; this process "
                         f"(global rank {dist.get_rank()}) is not one of them.")
    intra, inter = config.bandwidth_intra_gbps, config.bandwidth_inter_gbps
    params = list(model.parameters())
    if intra is None or inter is None:
        m_intra, m_inter = measure_bandwidths(topology, device=params[0].device if params else None)
        intra = intra if intra is not None else m_intra
        inter = inter if inter is not None else m_inter
    table = advise(GuidelineInputs(
        num_params=sum(p.numel() for p in params), trainable_params=sum(p.numel() for p in params if p.requires_grad),
        world_size=topology.world_size, group_size=topology.group_size, bandwidth_intra_gbps=intra,
        bandwidth_inter_gbps=inter, accumulation_steps=config.gradient_accumulation_steps,
        device_memory_gb=config.device_memory_gb, working_memory_gb=config.working_memory_gb,
        compute_time_s=config.compute_time_s, **bytes_per_element(config.mixed_precision, config.reduce_dtype)))
    if table.recommended is None:
        raise ValueError("strategy='auto': no PaRO strategy fits in device_memory_gb="
                         f"{config.device_memory_gb} for this model; raise the memory, lower working_memory_gb, "
                         "freeze parameters or add ranks.\n" + table.format())
    logger.info("strategy='auto' picked %s\n%s", table.recommended, table.format())
    return ResolvedStrategy(dataclasses.replace(config, strategy=table.recommended), table)
