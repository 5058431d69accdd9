"""The PaRO cost model and guideline: memory and traffic formulas per strategy, and a ranked table.

Formulas (``paro.md`` §4.4, derived from the paper's cost terms). With ``a_I = (m-1)/m``, ``a_E = (ng-1)/n`` and
``a_F = (n-1)/n`` (flat ring), per rank and per optimizer step of ``s`` micro-steps:

- t_param (every micro-step, forward + backward gathers): p=I: ``2 a_I Ψ`` intra; p=G: ``2 (a_I + a_E) Ψ``;
- t_gradient (every micro-step): g=I: ``a_I Ψ'`` intra; g=G: ``(a_I + a_E) Ψ'``;
- t_sync_g (once): (N,N) ``2a_I + 2a_E``; (N,I) ``a_I + 2a_E``; (N,G) ``a_I + a_E``; (I,I) ``2a_E``; (I,G) ``a_E``;
  (G,G) 0, each times ``Ψ'``;
- t_sync_p (once): (N,I) ``a_I Ψ'``; (N,G) ``(a_I + a_E) Ψ'``; (I,G) ``a_E Ψ'``; otherwise 0.

Without PaRO-CC every global collective is a flat ring: ``a_F`` per element on the ``flat`` link, which runs at
inter-group speed. Memory per rank: ``b_p Ψ/d(p) + b_g Ψ'/d(g) + b_os Ψ'/d(os)`` with ``d(N)=1, d(I)=m, d(G)=n``
(paper: 2, 2 and 12 bytes for mixed-precision Adam).

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

from .strategies import KNOWN_EQUIVALENTS, VALID_STRATEGIES, Level, Strategy, parse_strategy

__all__ = ["GuidelineInputs", "GuidelineRow", "GuidelineTable", "advise", "memory_bytes", "traffic", "collectives",
           "estimate_compute_time_s", "DEFAULT_WORKING_MEMORY_FRACTION"]

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


def memory_bytes(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int,
                 group_size: int, bytes_param: float = 2, bytes_grad: float = 2, bytes_os: float = 12
                 ) -> dict[str, float]:
    """Model-state bytes per rank by kind (``params``, ``grads``, ``os``) and their ``total``."""
    st = parse_strategy(strategy)
    n, m = world_size, group_size
    out = {"params": bytes_param * num_params / st.p.divisor(n, m),
           "grads": bytes_grad * trainable_params / st.g.divisor(n, m),
           "os": bytes_os * trainable_params / st.os.divisor(n, m)}
    out["total"] = out["params"] + out["grads"] + out["os"]
    return out


def traffic(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int, group_size: int,
            accumulation_steps: int, bytes_param: float = 2, bytes_grad: float = 2, paro_cc: bool = True
            ) -> dict[str, float]:
    """Bytes sent per rank per optimizer step, by link (``intra``, ``inter``, ``flat``), plus the per-term split
    (``t_param``, ``t_gradient``, ``t_sync_g``, ``t_sync_p`` as ``{link: bytes}``) and ``inter_launches`` (inter-group
    or flat collective calls per bucket and step)."""
    st = parse_strategy(strategy)
    n, m, s = world_size, group_size, accumulation_steps
    ng = n // m
    a_i, a_e, a_f = (m - 1) / m, (ng - 1) / n, (n - 1) / n
    psi, psi_t = num_params, trainable_params

    def glob(x: float, count: float = 1.0) -> dict[str, float]:
        """One global (G) collective over x elements: PaRO-CC = intra + inter parts, else a flat ring."""
        return {"intra": count * a_i * x, "inter": count * a_e * x} if paro_cc else {"flat": count * a_f * x}

    terms: dict[str, dict[str, float]] = {}
    launches = 0.0
    # t_param: gather in forward and again in backward, every micro-step.
    if st.p == Level.I:
        terms["t_param"] = {"intra": 2 * s * a_i * psi}
    elif st.p == Level.G:
        terms["t_param"] = glob(psi, 2 * s)
        launches += 2 * s
    # t_gradient: reduce-scatter every micro-step.
    if st.g == Level.I:
        terms["t_gradient"] = {"intra": s * a_i * psi_t}
    elif st.g == Level.G:
        terms["t_gradient"] = glob(psi_t, s)
        launches += s
    key = (st.g, st.os)
    N, I, G = Level.N, Level.I, Level.G  # noqa: E741 - the paper's letters
    ar_g = {"intra": 2 * a_i * psi_t, "inter": 2 * a_e * psi_t} if paro_cc else {"flat": 2 * a_f * psi_t}
    sync_g = {(N, N): ar_g,
              (N, I): {"intra": a_i * psi_t, "inter": 2 * a_e * psi_t},
              (N, G): glob(psi_t), (I, I): {"inter": 2 * a_e * psi_t}, (I, G): {"inter": a_e * psi_t},
              (G, G): {}}[key]
    terms["t_sync_g"] = sync_g
    launches += 0 if key == (G, G) else 1
    pk = (st.p, st.os)
    sync_p = {(N, I): {"intra": a_i * psi_t}, (N, G): glob(psi_t), (I, G): {"inter": a_e * psi_t}}.get(pk, {})
    terms["t_sync_p"] = sync_p
    launches += 1 if pk in ((N, G), (I, G)) else 0
    out: dict[str, float] = {"intra": 0.0, "inter": 0.0, "flat": 0.0}
    for name, term in terms.items():
        nbytes = bytes_param if name in ("t_param", "t_sync_p") else bytes_grad
        for link, v in term.items():
            out[link] += v * nbytes
    result: dict = dict(out)
    result.update({name: {k: v * (bytes_param if name in ("t_param", "t_sync_p") else bytes_grad)
                          for k, v in term.items()} for name, term in terms.items()})
    result["inter_launches"] = launches
    return result


def collectives(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int,
                group_size: int, accumulation_steps: int, bytes_param: float = 2, bytes_grad: float = 2,
                paro_cc: bool = True) -> list[dict]:
    """The collectives one optimizer step issues per bucket: ``{"term", "link", "op", "bytes", "calls"}`` records,
    ``op`` in ``all_gather`` / ``reduce_scatter`` / ``all_reduce``, ``bytes`` sent per rank summed over the
    ``calls``. Summed by link they equal `traffic`; this split is what latency and per-operation factors need."""
    st = parse_strategy(strategy)
    n, m, s = world_size, group_size, accumulation_steps
    ng = n // m
    a_i, a_e, a_f = (m - 1) / m, (ng - 1) / n, (n - 1) / n
    psi, psi_t = num_params, trainable_params
    out: list[dict] = []

    def add(term: str, link: str, op: str, elements: float, calls: float) -> None:
        if elements <= 0 or calls <= 0 or (link == "intra" and m == 1) or (link == "inter" and ng == 1):
            return
        nbytes = bytes_param if term in ("t_param", "t_sync_p") else bytes_grad
        out.append({"term": term, "link": link, "op": op, "bytes": elements * nbytes, "calls": calls})

    def glob(term: str, op: str, x: float, calls: float) -> None:
        """One global collective repeated ``calls`` times: PaRO-CC (intra + inter parts, or RS_I -> AR_E -> AG_I for
        an all-reduce) or a flat ring."""
        if not paro_cc:
            add(term, "flat", op, (2 if op == "all_reduce" else 1) * a_f * x * calls, calls)
        elif op == "all_reduce":
            add(term, "intra", "reduce_scatter", a_i * x * calls, calls)
            add(term, "inter", "all_reduce", 2 * a_e * x * calls, calls)
            add(term, "intra", "all_gather", a_i * x * calls, calls)
        else:
            add(term, "inter", op, a_e * x * calls, calls)
            add(term, "intra", op, a_i * x * calls, calls)

    N, I, G = Level.N, Level.I, Level.G  # noqa: E741 - the paper's letters
    if st.p == I:
        add("t_param", "intra", "all_gather", 2 * s * a_i * psi, 2 * s)
    elif st.p == G:
        glob("t_param", "all_gather", psi, 2 * s)
    if st.g == I:
        add("t_gradient", "intra", "reduce_scatter", s * a_i * psi_t, s)
    elif st.g == G:
        glob("t_gradient", "reduce_scatter", psi_t, s)
    key = (st.g, st.os)
    if key == (N, N):
        glob("t_sync_g", "all_reduce", psi_t, 1)
    elif key == (N, I):
        add("t_sync_g", "intra", "reduce_scatter", a_i * psi_t, 1)
        add("t_sync_g", "inter", "all_reduce", 2 * a_e * psi_t, 1)
    elif key == (N, G):
        glob("t_sync_g", "reduce_scatter", psi_t, 1)
    elif key == (I, I):
        add("t_sync_g", "inter", "all_reduce", 2 * a_e * psi_t, 1)
    elif key == (I, G):
        add("t_sync_g", "inter", "reduce_scatter", a_e * psi_t, 1)
    pk = (st.p, st.os)
    if pk == (N, I):
        add("t_sync_p", "intra", "all_gather", a_i * psi_t, 1)
    elif pk == (N, G):
        glob("t_sync_p", "all_gather", psi_t, 1)
    elif pk == (I, G):
        add("t_sync_p", "inter", "all_gather", a_e * psi_t, 1)
    return out


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
        t_opt = x.optimizer_time_s / parse_strategy(name).os.divisor(x.world_size, x.group_size)
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
