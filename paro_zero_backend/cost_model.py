"""The PaRO cost model and guideline: memory and traffic formulas per strategy, and a ranked table.

Formulas. `traffic` and `collectives` (`hf_placement.partition.costs`) price the schedule table of
`hf_placement.partition.schedule` (the one the engine executes): each collective there sends a ring's share of its
buffer, so with ``a_I = (m-1)/m``, ``a_E = (ng-1)/n`` and ``a_F = (n-1)/n`` (flat ring), per rank and per
optimizer step of ``s`` micro-steps (the paper's cost terms):

- t_param (every micro-step, forward + backward gathers): p=I: ``2 a_I Ψ`` intra; p=G: ``2 (a_I + a_E) Ψ``;
- t_gradient (every micro-step): g=I: ``a_I Ψ'`` intra; g=G: ``(a_I + a_E) Ψ'``;
- t_sync_g (once): (N,N) ``2a_I + 2a_E``; (N,I) ``a_I + 2a_E``; (N,G) ``a_I + a_E``; (I,I) ``2a_E``; (I,G) ``a_E``;
  (G,G) 0, each times ``Ψ'``;
- t_sync_p (once): (N,I) ``a_I Ψ'``; (N,G) ``(a_I + a_E) Ψ'``; (I,G) ``a_E Ψ'``; otherwise 0.

Without PaRO-CC every global collective is a flat ring: ``a_F`` per element on the ``flat`` link, which runs at
inter-group speed. Memory per rank: ``b_p Ψ/d(p) + b_g Ψ'/d(g) + b_os Ψ'/d(os)`` with ``d(N)=1, d(I)=m, d(G)=n``
(paper: 2, 2 and 12 bytes for mixed-precision Adam; `bytes_per_element` gives the engine's figures).

The guideline (paper §3.1.3) estimates ``T = max(t_comm, t_comp)`` with ``t_comm = (t_param + t_gradient)·s +
t_sync_g + t_sync_p``, drops the strategies that do not fit in memory, and picks the smallest ``T``. Equal ``T`` is
common: several strategies move the same bytes, and once compute hides communication every strategy with
``t_comm <= t_comp`` ties at ``t_comp``. By the model's own assumption the hidden bytes then no longer matter; what
stays exposed is each inter-group collective launch (a cross-node synchronisation point whose latency and stragglers
the bandwidth model ignores) and the memory left for activations. So ties are broken by inter-group launches per
bucket and step, then by model-state memory, then by ``t_comm``. ``t_comp`` can be measured or estimated from FLOPs
with `estimate_compute_time_s`.

Calibrated terms (all off by default, so the paper's model is unchanged). The bandwidth formulas ignore what a real
collective library adds, and on a measured cluster those effects reorder strategies that move similar bytes:

- ``latency_intra_s`` / ``latency_inter_s``: fixed cost per collective call; the calls per step come from the same
  procedure (`collectives`), times ``num_buckets`` (one call per bucket and operation, as the engine issues them).
- ``reduce_scatter_factor`` / ``all_reduce_factor``: time of a reduce-scatter / all-reduce relative to the bandwidth
  formula (gloo, for one, runs ``reduce_scatter_tensor`` as an all-reduce, about 2x the bytes).
- ``optimizer_time_s``: time of one unsharded optimizer step; a strategy pays ``optimizer_time_s / d(os)``.
- ``overlap``: fraction of the shorter of compute and communication that the other hides: 1 is the paper's
  ``max(t_comm, t_comp)``, 0 a synchronous engine (``t_comm + t_comp``).

Measure them with a calibration step (time one all-gather, reduce-scatter and all-reduce of two sizes per link,
and one compute-only step) rather than fitting them to a measured ranking; `bench/paro/` does this.

Working memory. Model states are not all a device holds: activations, temporary all-gather and gradient buffers and
allocator fragmentation come on top, and they decide which strategies run out of memory in practice. The paper's
LLaMA-7B runs (no activation checkpointing) report every NN* strategy out of memory although NNG's model states are
only 28.5 GiB of 80 GB. So the fit check takes ``working_memory_gb`` as an explicit input (measure it: peak memory
of one micro-step minus model states). The default, 10% of device memory, covers buffers and fragmentation of an
activation-checkpointed run and is deliberately not a guess at activations, which depend on batch and sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from hf_placement.partition import (
    KNOWN_EQUIVALENTS,
    VALID_STRATEGIES,
    collectives,
    divisor,
    memory_bytes,
    parse_strategy,
    traffic,
)

from .config import ParoConfig

__all__ = ["GuidelineInputs", "GuidelineRow", "GuidelineTable", "advise", "bytes_per_element", "memory_bytes",
           "traffic", "collectives", "estimate_compute_time_s", "DEFAULT_WORKING_MEMORY_FRACTION"]

DEFAULT_WORKING_MEMORY_FRACTION = 0.1


def estimate_compute_time_s(num_params: float, trainable_params: float, tokens_per_step: float,
                            peak_tflops: float, mfu: float = 0.4, activation_checkpointing: bool = False) -> float:
    """Compute seconds of one optimizer step from FLOPs: forward ``2Ψ``, backward ``2Ψ`` (activation gradients)
    plus ``2Ψ'`` (weight gradients of trainable parameters only), plus ``2Ψ`` recomputation with activation
    checkpointing, per token, at ``mfu`` of ``peak_tflops``."""
    if peak_tflops <= 0 or not 0 < mfu <= 1 or tokens_per_step <= 0:
        raise ValueError(f"peak_tflops={peak_tflops} and tokens_per_step={tokens_per_step} must be positive and "
                         f"0 < mfu={mfu} <= 1.")
    flops_per_token = 4 * num_params + 2 * trainable_params + (2 * num_params if activation_checkpointing else 0)
    return flops_per_token * tokens_per_step / (peak_tflops * 1e12 * mfu)


def bytes_per_element(mixed_precision: str = "no", reduce_dtype: str | None = None,
                      optimizer_state_bytes: float = 8) -> dict[str, float]:
    """``bytes_param``, ``bytes_grad`` and ``bytes_os`` of `memory_bytes` for a `ParoEngine` with these settings.

    - ``bytes_param``: the compute dtype (4 fp32, 2 bf16/fp16);
    - ``bytes_grad``: the gradient-reduction dtype (``reduce_dtype``, defaults to the compute dtype);
    - ``bytes_os``: the optimizer's per-element state (``optimizer_state_bytes``: 8 for Adam/AdamW's two fp32
      moments, 4 for SGD with momentum) plus 4 for the fp32 master copy under bf16/fp16. Under fp32 the master slice
      *is* part of the working parameters (the os slice lies inside the p slice), so it costs nothing extra.

    Args:
        mixed_precision (`str`, *optional*, defaults to `"no"`): ``ParoConfig.mixed_precision``.
        reduce_dtype (`str`, *optional*): ``ParoConfig.reduce_dtype``.
        optimizer_state_bytes (`float`, *optional*, defaults to `8`): optimizer-state bytes per trainable element.
    """
    cfg = ParoConfig(mixed_precision=mixed_precision, reduce_dtype=reduce_dtype)
    param = torch.empty(0, dtype=cfg.compute_dtype).element_size()
    grad = torch.empty(0, dtype=cfg.grad_dtype).element_size()
    master = 0 if cfg.compute_dtype == torch.float32 else 4
    return {"bytes_param": float(param), "bytes_grad": float(grad), "bytes_os": float(optimizer_state_bytes + master)}


@dataclass
class GuidelineInputs:
    """Inputs of `advise` (sizes in elements, bandwidths per rank in Gbit/s, memory in GB = 1e9 bytes)."""

    num_params: float = field(metadata={"help": "Ψ: total parameters."})
    world_size: int = field(metadata={"help": "n: ranks."})
    group_size: int = field(metadata={"help": "m: ranks per group (node)."})
    bandwidth_intra_gbps: float = field(metadata={"help": "B': intra-group bandwidth per rank, Gbit/s."})
    bandwidth_inter_gbps: float = field(metadata={"help": "B: inter-group bandwidth per rank, Gbit/s."})
    trainable_params: float | None = field(default=None, metadata={"help": "Ψ'; defaults to Ψ."})
    accumulation_steps: int = field(default=1, metadata={"help": "s: micro-steps per optimizer step."})
    device_memory_gb: float | None = field(default=None, metadata={"help": "Memory per device; None: no check."})
    working_memory_gb: float | None = field(
        default=None, metadata={"help": "Activations + buffers + fragmentation per device; default 10% of memory."})
    compute_time_s: float = field(default=0.0, metadata={"help": "Compute time of one optimizer step (s micro)."})
    bytes_param: float = field(default=2, metadata={"help": "Bytes per working parameter element."})
    bytes_grad: float = field(default=2, metadata={"help": "Bytes per gradient element."})
    bytes_os: float = field(default=12, metadata={"help": "Bytes of optimizer state per trainable element."})
    paro_cc: bool = field(default=True, metadata={"help": "Hierarchical collectives (False: flat rings)."})
    overlap: float = field(default=1.0, metadata={
        "help": "Fraction of min(t_comp, t_comm) hidden: 1 = the paper's max(); 0 = a synchronous engine (sum)."})
    latency_intra_s: float = field(default=0.0, metadata={"help": "Fixed seconds per intra-group collective call."})
    latency_inter_s: float = field(default=0.0, metadata={
        "help": "Fixed seconds per inter-group (or flat) collective call."})
    num_buckets: int = field(default=1, metadata={"help": "Buckets per step: each operation is one call per bucket."})
    reduce_scatter_factor: float = field(default=1.0, metadata={
        "help": "Reduce-scatter time relative to the bandwidth formula (calibrated; ~2 when run as an all-reduce)."})
    all_reduce_factor: float = field(default=1.0, metadata={
        "help": "All-reduce time relative to the bandwidth formula (calibrated)."})
    optimizer_time_s: float = field(default=0.0, metadata={
        "help": "Seconds of one unsharded optimizer step; a strategy pays it divided by d(os)."})
    candidates: Sequence[str] | None = field(default=None, metadata={"help": "Strategies to rank; default all 14."})

    def __post_init__(self) -> None:
        if self.trainable_params is None:
            self.trainable_params = self.num_params
        for name in ("num_params", "bandwidth_intra_gbps", "bandwidth_inter_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive.")
        if not 0 <= self.trainable_params <= self.num_params:
            raise ValueError(f"trainable_params={self.trainable_params} must be between 0 and num_params="
                             f"{self.num_params}.")
        if self.world_size < 1 or self.group_size < 1 or self.world_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide world_size={self.world_size} (groups are "
                             "equal sets of consecutive ranks, usually one node each).")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be >= 1.")
        for name in ("compute_time_s", "latency_intra_s", "latency_inter_s", "optimizer_time_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (seconds).")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap} must be in [0, 1] (1: communication fully hidden by compute "
                             "as in the paper, 0: no overlap).")
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets={self.num_buckets} must be >= 1.")
        for name in ("reduce_scatter_factor", "all_reduce_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (1 = the bandwidth formula).")
        if self.working_memory_gb is not None and self.working_memory_gb < 0:
            raise ValueError(f"working_memory_gb={self.working_memory_gb} must be >= 0.")
        if self.candidates is not None:
            self.candidates = [parse_strategy(c).name for c in self.candidates]

    @property
    def effective_working_memory_gb(self) -> float:
        if self.working_memory_gb is not None:
            return self.working_memory_gb
        return DEFAULT_WORKING_MEMORY_FRACTION * self.device_memory_gb if self.device_memory_gb else 0.0


@dataclass
class GuidelineRow:
    rank: int
    strategy: str
    equivalent: str
    model_state_gb: float
    total_memory_gb: float
    fits: bool
    intra_gb: float
    inter_gb: float
    t_comm_s: float
    t_step_s: float
    inter_launches: float


@dataclass
class GuidelineTable:
    inputs: GuidelineInputs
    rows: list[GuidelineRow]
    recommended: str | None

    def to_dict(self) -> dict:
        inputs = asdict(self.inputs)
        inputs["effective_working_memory_gb"] = self.inputs.effective_working_memory_gb
        return {"inputs": inputs, "recommended": self.recommended, "rows": [asdict(r) for r in self.rows]}

    def format(self) -> str:
        head = (f"{'rank':>4} {'strategy':<8} {'model states GB':>15} {'+working GB':>11} {'fits':>4} "
                f"{'intra GB':>9} {'inter GB':>9} {'t_comm s':>9} {'T s':>8}  equivalent")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(f"{r.rank:>4} {r.strategy:<8} {r.model_state_gb:>15.2f} {r.total_memory_gb:>11.2f} "
                         f"{'yes' if r.fits else 'NO':>4} {r.intra_gb:>9.2f} {r.inter_gb:>9.2f} {r.t_comm_s:>9.3f} "
                         f"{r.t_step_s:>8.3f}  {r.equivalent}")
        wm = self.inputs.effective_working_memory_gb
        lines.append(f"working memory assumed: {wm:.1f} GB per device (activations, buffers, fragmentation)")
        lines.append(f"recommended: {self.recommended}" if self.recommended else
                     "recommended: none (no strategy fits in device memory)")
        return "\n".join(lines)


def advise(inputs: GuidelineInputs) -> GuidelineTable:
    """Rank strategies by predicted step time; strategies that do not fit are ranked after those that do."""
    x = inputs
    b_intra = x.bandwidth_intra_gbps * 1e9 / 8
    b_inter = x.bandwidth_inter_gbps * 1e9 / 8
    wm = x.effective_working_memory_gb
    rows = []
    names = x.candidates if x.candidates is not None else [s.name for s in VALID_STRATEGIES]
    for name in names:
        mem = memory_bytes(name, x.num_params, x.trainable_params, x.world_size, x.group_size, x.bytes_param,
                           x.bytes_grad, x.bytes_os)["total"] / 1e9
        tr = traffic(name, x.num_params, x.trainable_params, x.world_size, x.group_size, x.accumulation_steps,
                     x.bytes_param, x.bytes_grad, x.paro_cc)
        t_comm = 0.0
        factor = {"all_gather": 1.0, "reduce_scatter": x.reduce_scatter_factor, "all_reduce": x.all_reduce_factor}
        for c in collectives(name, x.num_params, x.trainable_params, x.world_size, x.group_size,
                             x.accumulation_steps, x.bytes_param, x.bytes_grad, x.paro_cc):
            intra = c["link"] == "intra"
            t_comm += c["bytes"] * factor[c["op"]] / (b_intra if intra else b_inter)
            t_comm += c["calls"] * x.num_buckets * (x.latency_intra_s if intra else x.latency_inter_s)
        t_opt = x.optimizer_time_s / divisor(parse_strategy(name).os, x.world_size, x.group_size)
        t_step = x.compute_time_s + t_comm - x.overlap * min(x.compute_time_s, t_comm) + t_opt
        fits = x.device_memory_gb is None or mem + wm <= x.device_memory_gb
        rows.append(GuidelineRow(0, name, KNOWN_EQUIVALENTS.get(name, ""), mem, mem + wm, fits, tr["intra"] / 1e9,
                                 (tr["inter"] + tr["flat"]) / 1e9, t_comm, t_step, tr["inter_launches"]))

    def key(r: GuidelineRow):
        return (not r.fits, _round(r.t_step_s), r.inter_launches, _round(r.model_state_gb), _round(r.t_comm_s))

    rows.sort(key=key)
    for k, r in enumerate(rows):
        r.rank = k + 1
    best = next((r.strategy for r in rows if r.fits), None)
    return GuidelineTable(x, rows, best)


def _round(v: float) -> float:
    """Compare times to 9 significant digits so that equal formulas tie despite float noise."""
    return float(f"{v:.9g}") if math.isfinite(v) else v
