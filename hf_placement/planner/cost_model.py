"""The placement planner: a pure cost model of one PPO iteration per placement plan.

Inputs are a `Workload` (model sizes, global batch ``S`` of sequences with prompt ``p`` and response ``r`` tokens, PPO
epochs, micro-batches ``K``), a `Hardware` description (devices, per-device memory cap, peak FLOP/s ``F``, memory
bandwidth ``W``, link bandwidth ``β`` and latency ``α``, efficiencies, a fixed overhead per model call) and an
optional `Calibration` (phase times measured on one device for the whole batch, which rescale the analytic phase
costs). `estimate` prices one `PlacementPlan`; `rank_plans` prices the candidate plans (`candidate_plans`:
co-located, interleaved and every disaggregated train/inference split, each also with its models sharded) and ranks
them: plans within the memory cap first, by predicted iteration time.

Phase costs (per device, batch ``b`` on that device, model of ``Φ`` parameters, ``w`` bytes per weight):

- generation: prefill ``2Φ·b·p/(F·η_i)`` + ``r`` decode steps of ``max((w·Φ + KV)/W, 2Φ·b/(F·η_i)) + o``;
- experience forward of model ``m``: ``2Φ_m·b·(p+r)/(F·η_i) + K·o``;
- training (actor + critic): ``c·(Φ_a+Φ_c)·b·(p+r)·epochs/(F·η) + 3·K·epochs·o`` (``c`` = 6, or 8 with
  recomputation) + optimizer steps ``16·Φ·…/W``;
- collectives over ``n`` ranks: all-reduce ``2(n-1)/n·B/β + 2(n-1)α``, all-gather ``(n-1)/n·B/β + (n-1)α``,
  broadcast / point-to-point ``B/β + α``.

Sharded roles are priced with the schedule of the PaRO engine that shards them
(`hf_placement.partition.collectives`: which collective, over which group, how often, for the role's
strategy): the trained models pay it for every optimizer step of the iteration; every phase that runs a sharded
model without gradients (generation, the experience forwards, the trainer's side of a weight sync) pays one
parameter gather of it, because the trainer pins the full weights for the whole phase.

Plans:

- not disaggregated: ``T = T_gen + T_inf + T_train``; ref and reward on disjoint owner sets run concurrently
  (``max`` instead of sum), each on ``S / owners`` sequences;
- disaggregated with ``n_inf`` inference and ``n_train`` training ranks: ``A = T_gen + T_inf`` on the inference group,
  ``B = T_train`` on the trainers, pipelined over ``K`` micro-batches for the first PPO epoch:
  ``T = max(A, B₁) + min(A, B₁)/K + (B - B₁) + T_sync + T_experience``, with ``T_sync`` a broadcast of the actor and
  critic weights (or only LoRA adapters); ``Workload.max_staleness`` selects a synchronous or one-step-off schedule.

Memory per device is the analytic model state of `hf_placement.planner.memory`; a plan whose largest rank exceeds
``Hardware.memory_cap_bytes`` is marked over the cap and ranked after every plan that fits.

The CPU constant set describes one core of a small x86 machine; `Calibration` replaces guesses by measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..partition import collectives as partition_collectives
from ..plan import BASE_ROLES, DEFAULT_SHARD_STRATEGY, PlacementPlan
from .memory import ModelSizes, model_state_bytes

__all__ = ["Calibration", "Hardware", "PlanEstimate", "Workload", "candidate_plans", "compare_to_measured", "estimate",
           "rank_plans"]


@dataclass(frozen=True)
class Workload:
    """One PPO iteration: sizes of the four models and the batch shape."""

    actor_params: float = field(metadata={"help": "Actor parameters (Φ_a)."})
    critic_params: float | None = field(default=None, metadata={"help": "Critic parameters; defaults to actor."})
    ref_params: float | None = field(default=None, metadata={"help": "Reference parameters; defaults to actor."})
    reward_params: float | None = field(default=None, metadata={"help": "Reward parameters; defaults to critic."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per iteration (global batch S)."})
    prompt_len: int = field(default=16, metadata={"help": "Prompt tokens p."})
    response_len: int = field(default=32, metadata={"help": "Generated tokens r."})
    ppo_epochs: int = field(default=1, metadata={"help": "PPO epochs over the batch."})
    micro_batches: int = field(default=4, metadata={"help": "Micro-batches K (forward chunks, pipeline depth)."})
    mini_batches: int = field(default=1, metadata={
        "help": "Optimizer steps per PPO epoch (TRL's num_mini_batches): each one synchronises the gradients "
                "(all-reduce, or reduce-scatter for a sharded role) and steps the optimizer."})
    num_layers: int | None = field(default=None, metadata={"help": "Layers L (KV cache); derived from Φ if unset."})
    hidden_size: int | None = field(default=None, metadata={"help": "Hidden size h (KV cache); derived if unset."})
    lora_fraction: float | None = field(default=None, metadata={"help": "Adapter params / model params with LoRA."})
    train_flops_factor: float = field(default=6.0, metadata={"help": "FLOPs per param per token in training (6, "
                                                                     "or 8 with activation recomputation)."})
    max_staleness: int | None = field(default=None, metadata={
        "help": "Disaggregated schedule: None = a micro-batch pipeline (generation of micro-batch i+1 overlaps "
                "training of i); 0 = synchronous (training starts when the whole batch has arrived, as whole-batch "
                "advantage whitening requires); 1 = one-step off-policy (the next batch is generated while this "
                "one trains)."})

    def __post_init__(self) -> None:
        if self.max_staleness not in (None, 0, 1):
            raise ValueError(f"Workload.max_staleness={self.max_staleness!r} must be None (pipelined), 0 or 1.")
        for name in ("batch_size", "prompt_len", "response_len", "ppo_epochs", "micro_batches", "mini_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Workload.{name}={v!r} must be a positive integer.")
        if self.micro_batches > self.batch_size:
            raise ValueError(f"Workload.micro_batches={self.micro_batches} exceeds batch_size={self.batch_size}; a "
                             "micro-batch holds at least one sequence.")
        _ = self.sizes  # validates the parameter counts

    @property
    def sizes(self) -> ModelSizes:
        return ModelSizes(actor=self.actor_params, critic=self.critic_params, ref=self.ref_params,
                          reward=self.reward_params, lora_fraction=self.lora_fraction)

    def shape(self) -> tuple[int, int]:
        """(layers, hidden) of the actor: given, or from Φ ≈ 12·L·h² with h ≈ 100·L (GPT/Llama-like aspect)."""
        phi = self.sizes.actor
        if self.num_layers and self.hidden_size:
            return self.num_layers, self.hidden_size
        if self.num_layers:
            return self.num_layers, max(1, int(math.sqrt(phi / (12 * self.num_layers))))
        layers = max(1, round((phi / 1.2e5) ** (1 / 3)))
        return layers, self.hidden_size or max(1, int(math.sqrt(phi / (12 * layers))))


@dataclass(frozen=True)
class Hardware:
    """Devices and links. Use `Hardware.cpu` / `Hardware.gpu` for the constant sets."""

    devices: int = field(metadata={"help": "Number of devices (ranks)."})
    memory_cap_bytes: float | None = field(default=None, metadata={"help": "Per-device model-state cap (bytes)."})
    peak_flops: float = field(default=1e11, metadata={"help": "Peak FLOP/s per device (F)."})
    mem_bandwidth: float = field(default=5e9, metadata={"help": "Memory bandwidth per device, bytes/s (W)."})
    link_bandwidth: float = field(default=1e9, metadata={"help": "Intra-node link bandwidth, bytes/s (β)."})
    inter_link_bandwidth: float | None = field(default=None, metadata={"help": "Inter-node bandwidth; default β."})
    devices_per_node: int | None = field(default=None, metadata={"help": "Devices per node (for inter links)."})
    link_latency_s: float = field(default=3e-4, metadata={"help": "Per-message latency (α), seconds."})
    reduce_scatter_bandwidth: float | None = field(default=None, metadata={
        "help": "Bandwidth of a reduce-scatter, bytes/s, in the all-gather convention ((n-1)/n x total bytes / "
                "time); default β. Set it from hf_placement.planner.calibrate.measure_links: gloo has no native "
                "reduce-scatter and runs it several times slower than an all-gather of the same size."})
    all_reduce_bandwidth: float | None = field(default=None, metadata={
        "help": "Bandwidth of an all-reduce, bytes/s, in the ring convention (2 (n-1)/n x bytes / time); default β. "
                "gloo's native all-reduce of large buffers runs faster than its all-gather of the same size "
                "(hf_placement.planner.calibrate.measure_links)."})
    collective_overhead_s: float = field(default=0.0, metadata={
        "help": "Fixed seconds every collective issued between bursts of compute costs on top of its bytes (waking "
                "the communication threads); measured by hf_placement.planner.calibrate.busy_collective_latency. "
                "It matters for plans that gather and reduce per unit and micro-step (sharded roles)."})
    mfu_train: float = field(default=0.5, metadata={"help": "Training efficiency η (fraction of F)."})
    mfu_infer: float = field(default=0.5, metadata={"help": "Inference efficiency η_i (fraction of F)."})
    call_overhead_s: float = field(default=5e-3, metadata={"help": "Fixed cost per model call / decode step (o)."})
    precision: str = field(default="fp32", metadata={"help": "'fp32' (CPU) or 'bf16' (GPU mixed precision)."})
    name: str = field(default="custom", metadata={"help": "Label of the constant set."})
    parallel_efficiency: float = field(default=1.0, metadata={
        "help": "Throughput of all devices computing at once / (devices x one alone), as measured by "
                "hf_placement.planner.calibrate.parallel_efficiency: 1 for GPUs; below 1 on a shared or "
                "oversubscribed CPU, where phases that keep every device busy run 1/efficiency slower."})

    def __post_init__(self) -> None:
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"Hardware.devices={self.devices!r} must be a positive integer.")
        for f in ("peak_flops", "mem_bandwidth", "link_bandwidth", "mfu_train", "mfu_infer"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be positive.")
        if self.collective_overhead_s < 0:
            raise ValueError(f"Hardware.collective_overhead_s={self.collective_overhead_s!r} must be >= 0 (seconds).")
        for f in ("inter_link_bandwidth", "reduce_scatter_bandwidth", "all_reduce_bandwidth"):
            if getattr(self, f) is not None and not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f}={getattr(self, f)!r} must be positive (or None for the default).")
        if self.memory_cap_bytes is not None and not self.memory_cap_bytes > 0:
            raise ValueError(f"Hardware.memory_cap_bytes={self.memory_cap_bytes!r} must be positive (or None).")
        if not 0 < self.parallel_efficiency <= 1.5:
            raise ValueError(f"Hardware.parallel_efficiency={self.parallel_efficiency!r} must be in (0, 1.5] "
                             "(measured concurrent / ideal throughput).")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"Hardware.precision={self.precision!r} must be 'fp32' or 'bf16'.")

    @classmethod
    def cpu(cls, devices: int, **overrides: Any) -> Hardware:
        """One CPU core per rank, fp32 + Adam, gloo on loopback: order-of-magnitude constants of a small x86 core
        and loopback gloo (all-gathers far slower per byte than broadcasts). Calibrate for real predictions
        (`hf_placement.planner.calibrate`, `Calibration`)."""
        base = dict(peak_flops=1e11, mem_bandwidth=5e9, link_bandwidth=1e9, link_latency_s=3e-4, mfu_train=0.5,
                    mfu_infer=0.5, call_overhead_s=5e-3, precision="fp32", name="cpu")
        base.update(overrides)
        return cls(devices=devices, **base)

    @classmethod
    def gpu(cls, devices: int, **overrides: Any) -> Hardware:
        """H100-class GPUs, bf16 mixed precision, NVLink inside a node of 8, 400 Gb/s InfiniBand between nodes."""
        base = dict(peak_flops=989e12, mem_bandwidth=3.35e12, link_bandwidth=450e9, inter_link_bandwidth=50e9,
                    devices_per_node=8, link_latency_s=1e-5, mfu_train=0.4, mfu_infer=0.3, call_overhead_s=2e-4,
                    precision="bf16", name="gpu")
        base.update(overrides)
        return cls(devices=devices, **base)

    @property
    def weight_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def bandwidth(self, ranks: list[int]) -> float:
        """β of a group: inter-node bandwidth when it spans nodes."""
        if self.devices_per_node and self.inter_link_bandwidth and len({r // self.devices_per_node
                                                                        for r in ranks}) > 1:
            return self.inter_link_bandwidth
        return self.link_bandwidth


@dataclass(frozen=True)
class Calibration:
    """Measured phase times on ONE device for the whole global batch of the workload (seconds), optionally also for
    half of it.

    One time per phase rescales that phase's analytic cost by measured / predicted, so the analytic model still
    decides how the phase scales with the per-device batch. On hardware where the constants are off, that split
    between per-call (fixed) and per-sample work is what goes wrong: on a CPU core, decoding a small model at batch
    8-16 costs in proportion to the batch, while the default constants call it weight-read bound and predict no
    saving from halving the batch. The ``*_half_s`` times, measured the same way on half the batch, fix the split from
    measurements: ``t(b) = t(S) * (f + (1 - f) * b / S)`` with the fixed fraction ``f = 2 t(S/2) / t(S) - 1``
    (clamped to [0, 1]).

    The ``*_concurrent_s`` times are the whole-batch phase again, on one device while every other device runs the
    same work at once. Their ratio to the alone time is that phase's slowdown under contention, which the model
    applies to the phases in which all devices compute together (in place of ``Hardware.parallel_efficiency``, a
    matmul loop's figure, which on a shared host can read high while the real phases slow down far more; see
    ``bench/placement/README.md``).
    """

    generate_s: float | None = field(default=None, metadata={"help": "Generation of the whole batch, one device."})
    inference_s: float | None = field(default=None, metadata={"help": "All four experience forwards, one device."})
    train_s: float | None = field(default=None, metadata={"help": "Actor+critic training, one device."})
    generate_half_s: float | None = field(default=None, metadata={"help": "Generation of half the batch."})
    inference_half_s: float | None = field(default=None, metadata={"help": "The four forwards on half the batch."})
    train_half_s: float | None = field(default=None, metadata={"help": "Training on half the batch."})
    generate_concurrent_s: float | None = field(default=None, metadata={
        "help": "Generation of the whole batch on one device while every device generates at once."})
    inference_concurrent_s: float | None = field(default=None, metadata={
        "help": "The four forwards on the whole batch, on one device while every device runs them at once."})
    train_concurrent_s: float | None = field(default=None, metadata={
        "help": "Training on the whole batch, on one device while every device trains at once."})
    train_sharded_s: float | None = field(default=None, metadata={
        "help": "Training on the whole batch, one device, through the sharding engine (its hooks, flat-buffer "
                "copies and allocations; over one rank it communicates nothing): what sharding adds to the compute "
                "of a sharded plan's training."})

    def __post_init__(self) -> None:
        for f in ("generate_s", "inference_s", "train_s", "generate_half_s", "inference_half_s", "train_half_s",
                  "generate_concurrent_s", "inference_concurrent_s", "train_concurrent_s", "train_sharded_s"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"Calibration.{f}={v!r} must be a positive number of seconds.")
        for phase in ("generate", "inference", "train"):
            for kind, why in (("half", "the two together split the phase into fixed and per-sample work"),
                              ("concurrent", "their ratio is the phase's slowdown when every device computes")):
                if getattr(self, f"{phase}_{kind}_s") is not None and getattr(self, f"{phase}_s") is None:
                    raise ValueError(f"Calibration.{phase}_{kind}_s needs {phase}_s (the whole-batch time alone) as "
                                     f"well: {why}.")
        if self.train_sharded_s is not None and self.train_s is None:
            raise ValueError("Calibration.train_sharded_s needs train_s as well: their ratio is the sharding "
                             "engine's overhead on the training compute.")

    def fixed_fraction(self, phase: str) -> float | None:
        """Share of ``phase``'s whole-batch time that does not shrink with the batch; None without a half-batch
        time."""
        full, half = getattr(self, f"{phase}_s"), getattr(self, f"{phase}_half_s")
        if full is None or half is None:
            return None
        return min(1.0, max(0.0, 2.0 * half / full - 1.0))

    def sharded_train_factor(self) -> float:
        """Training compute through the sharding engine / plain training compute (1 without a sharded time)."""
        if self.train_sharded_s is None or self.train_s is None:
            return 1.0
        return self.train_sharded_s / self.train_s

    def concurrent_slowdown(self, phase: str) -> float | None:
        """How much slower ``phase`` runs when every device runs it at once than on one device alone; None without
        a concurrent time."""
        full, together = getattr(self, f"{phase}_s"), getattr(self, f"{phase}_concurrent_s")
        if full is None or together is None:
            return None
        return together / full


@dataclass
class PlanEstimate:
    """Predicted iteration time and memory of one plan."""

    name: str
    plan: PlacementPlan
    time_s: float
    phases: dict[str, float]
    memory_per_rank: dict[int, float]
    fits: bool
    samples_per_s: float
    notes: str = ""

    @property
    def memory_max_bytes(self) -> float:
        return max(self.memory_per_rank.values())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "strategy": self.plan.strategy, "plan": self.plan.to_dict(),
                "time_s": self.time_s, "samples_per_s": self.samples_per_s, "phases": self.phases,
                "memory_max_bytes": self.memory_max_bytes,
                "memory_per_rank": {str(k): v for k, v in self.memory_per_rank.items()}, "fits": self.fits,
                "notes": self.notes}


class _Costs:
    """Phase cost functions for one workload on one hardware (calibration scales applied)."""

    def __init__(self, w: Workload, hw: Hardware, cal: Calibration | None):
        self.w, self.hw = w, hw
        self.sizes = w.sizes
        self.layers, self.hidden = w.shape()
        self.scale = {"generate": 1.0, "inference": 1.0, "train": 1.0}
        # Two-point calibration: the measured fixed fraction per phase, replacing the analytic batch scaling.
        self.fixed: dict[str, float] = {}
        S = float(w.batch_size)
        self.S = S
        if cal is not None:
            if cal.generate_s:
                self.scale["generate"] = cal.generate_s / self._gen(S)
            if cal.inference_s:
                ref = sum(self._fwd(self.sizes.params(m), S) for m in ("actor", "critic", "ref", "reward"))
                self.scale["inference"] = cal.inference_s / ref
            if cal.train_s:
                self.scale["train"] = cal.train_s / self._train(S)
            for phase in self.scale:
                f = cal.fixed_fraction(phase)
                if f is not None:
                    self.fixed[phase] = f

    def _batch_factor(self, phase: str, b: float) -> float | None:
        """t(b) / t(S) from the two-point calibration of ``phase``, or None (analytic scaling)."""
        if phase not in self.fixed:
            return None
        f = self.fixed[phase]
        return f + (1.0 - f) * b / self.S

    # raw (unscaled) compute costs
    def _gen(self, b: float) -> float:
        w, hw = self.w, self.hw
        phi = self.sizes.actor
        wb = hw.weight_bytes
        prefill = 2 * phi * b * w.prompt_len / (hw.peak_flops * hw.mfu_infer) + hw.call_overhead_s
        ctx = w.prompt_len + w.response_len / 2
        kv = 2 * self.layers * self.hidden * ctx * b * wb
        step = max((wb * phi + kv) / hw.mem_bandwidth, 2 * phi * b / (hw.peak_flops * hw.mfu_infer))
        return prefill + w.response_len * (step + hw.call_overhead_s)

    def _fwd(self, phi: float, b: float) -> float:
        w, hw = self.w, self.hw
        chunks = min(w.micro_batches, max(1, math.ceil(b)))
        return 2 * phi * b * (w.prompt_len + w.response_len) / (hw.peak_flops * hw.mfu_infer) \
            + chunks * hw.call_overhead_s

    def _train(self, b: float) -> float:
        w, hw = self.w, self.hw
        phi = self.sizes.actor + self.sizes.critic
        trainable = phi * (w.lora_fraction or 1.0)
        tokens = b * (w.prompt_len + w.response_len) * w.ppo_epochs
        steps = w.ppo_epochs * w.mini_batches
        micro = min(w.micro_batches, max(1, math.ceil(b))) * w.ppo_epochs
        return (w.train_flops_factor * phi * tokens / (hw.peak_flops * hw.mfu_train)
                + steps * 16 * trainable * 2 / hw.mem_bandwidth + 3 * micro * hw.call_overhead_s)

    # scaled compute
    def gen(self, b: float) -> float:
        k = self._batch_factor("generate", b)
        if k is None:
            return self.scale["generate"] * self._gen(b)
        return self.scale["generate"] * self._gen(self.S) * k

    def fwd(self, role: str, b: float) -> float:
        k = self._batch_factor("inference", b)
        if k is None:
            return self.scale["inference"] * self._fwd(self.sizes.params(role), b)
        return self.scale["inference"] * self._fwd(self.sizes.params(role), self.S) * k

    def train(self, b: float) -> float:
        k = self._batch_factor("train", b)
        if k is None:
            return self.scale["train"] * self._train(b)
        return self.scale["train"] * self._train(self.S) * k

    # communication
    def all_reduce(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n <= 1:
            return 0.0
        bw = self.hw.all_reduce_bandwidth or self.hw.bandwidth(ranks)
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * self.hw.link_latency_s + self.hw.collective_overhead_s

    def all_gather(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n <= 1:
            return 0.0
        return ((n - 1) / n * nbytes / self.hw.bandwidth(ranks) + (n - 1) * self.hw.link_latency_s
                + self.hw.collective_overhead_s)

    def reduce_scatter(self, nbytes: float, ranks: list[int]) -> float:
        n = len(ranks)
        if n <= 1:
            return 0.0
        bw = self.hw.reduce_scatter_bandwidth or self.hw.bandwidth(ranks)
        return (n - 1) / n * nbytes / bw + (n - 1) * self.hw.link_latency_s + self.hw.collective_overhead_s

    def p2p(self, nbytes: float, ranks: list[int]) -> float:
        return nbytes / self.hw.bandwidth(ranks) + self.hw.link_latency_s

    def weights(self, role: str) -> float:
        return self.sizes.params(role) * self.hw.weight_bytes

    # sharded roles: the PaRO engine's schedule for the role's strategy
    def _schedule(self, plan: PlacementPlan, role: str, trainable: bool, micro_steps: float) -> list[dict]:
        psi = self.sizes.params(role)
        psi_t = psi * (self.w.lora_fraction or 1.0) if trainable else 0.0
        ranks = plan.ranks(role)
        m = plan.role_group_size(role, self.hw.devices_per_node)
        wb = self.hw.weight_bytes
        # PPO shards whole models (one unit each), which keep their gathered weights from forward to backward
        return partition_collectives(plan.sharded_roles[role], psi, psi_t, len(ranks), m, max(1, round(micro_steps)),
                                bytes_param=wb, bytes_grad=wb, reshard_after_forward=False)

    def _price(self, plan: PlacementPlan, role: str, records: list[dict], scale: float = 1.0) -> float:
        """Seconds of a list of collective records (bytes sent per rank summed over ``calls``) on ``role``'s ranks:
        intra-group records on one group of ``m`` consecutive ranks, inter-group records across the groups."""
        ranks = sorted(plan.ranks(role))
        m = plan.role_group_size(role, self.hw.devices_per_node)
        groups = {"intra": ranks[:m], "inter": ranks[::m], "flat": ranks}
        op_time = {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter,
                   "all_reduce": self.all_reduce}
        total = 0.0
        for r in records:
            group = groups[r["link"]]
            k = len(group)
            if k <= 1 or r["calls"] <= 0:
                continue
            calls = r["calls"] * scale
            share = (2 if r["op"] == "all_reduce" else 1) * (k - 1) / k  # bytes sent per buffer byte
            total += calls * op_time[r["op"]](r["bytes"] * scale / calls / share, group)
        return total

    def gather(self, plan: PlacementPlan, role: str) -> float:
        """One gather of a sharded role's full weights (the phase pins them); 0 when the role is not sharded."""
        if role not in plan.sharded_roles:
            return 0.0
        params = [r for r in self._schedule(plan, role, False, 1) if r["term"] == "t_param"]
        return self._price(plan, role, params)  # one micro-step's gather

    def train_comm(self, plan: PlacementPlan, role: str, micro_steps: float, syncs: int) -> float:
        """Gradient synchronisation (and, for a sharded role, parameter gathers) of a trained role per iteration."""
        ranks = plan.ranks(role)
        if role not in plan.sharded_roles:
            return syncs * self.all_reduce(self.weights(role) * (self.w.lora_fraction or 1.0), ranks)
        return syncs * self._price(plan, role, self._schedule(plan, role, True, micro_steps / syncs))


def estimate(plan: PlacementPlan, workload: Workload, hardware: Hardware, calibration: Calibration | None = None,
             name: str | None = None) -> PlanEstimate:
    """Predicted iteration time (with its phases) and model-state bytes per rank of ``plan``."""
    if plan.world_size != hardware.devices:
        raise ValueError(f"plan is for {plan.world_size} ranks but hardware.devices={hardware.devices}; build the "
                         "plan for the hardware's device count.")
    c = _Costs(workload, hardware, calibration)
    # sharded trained roles run their training through the sharding engine: its own work on top of the compute
    train_factor = calibration.sharded_train_factor() if calibration is not None and "actor" in plan.sharded_roles \
        else 1.0
    w, S, K = workload, float(workload.batch_size), workload.micro_batches
    # Phases during which every device computes at once pay the contention between devices: the phase's measured
    # concurrent slowdown where the calibration has one, else the machine's parallel efficiency. The synchronous
    # disaggregated schedule alternates between its sides instead.
    if hardware.devices > 1 and not (plan.is_disaggregated and w.max_staleness == 0):
        for k in c.scale:
            slowdown = calibration.concurrent_slowdown(k) if calibration is not None else None
            c.scale[k] *= slowdown if slowdown is not None else 1.0 / hardware.parallel_efficiency
    syncs = w.ppo_epochs * w.mini_batches  # gradient synchronisations (optimizer steps) per iteration
    phases: dict[str, float] = {}
    if not plan.is_disaggregated:
        actor, critic = plan.ranks("actor"), plan.ranks("critic")
        b = S / len(actor)
        phases["generate"] = c.gen(b) + c.gather(plan, "actor")

        def frozen(role: str) -> float:
            ranks = plan.ranks(role)
            t = c.fwd(role, S / len(ranks)) + c.gather(plan, role)
            if len(ranks) < len(actor):  # owners receive partners' tokens and send results back
                t += c.p2p(S / len(actor) * (w.prompt_len + w.response_len) * 8, ranks) * 2
            return t

        inf = c.fwd("actor", b) + c.fwd("critic", S / len(critic)) + c.gather(plan, "critic")
        t_ref, t_rw = frozen("ref"), frozen("reward")
        disjoint = not set(plan.ranks("ref")) & set(plan.ranks("reward"))
        inf += max(t_ref, t_rw) if disjoint else t_ref + t_rw
        phases["inference"] = inf
        micro_steps = min(K, max(1, math.ceil(b))) * w.ppo_epochs
        phases["train"] = c.train(b) * train_factor + sum(c.train_comm(plan, role, micro_steps, syncs)
                                                          for role in ("actor", "critic"))
        phases["sync"] = 0.0
        total = phases["generate"] + phases["inference"] + phases["train"]
    else:
        infer, trainers = plan.ranks("rollout"), plan.ranks("actor")
        gen = c.gen(S / len(infer))
        inf = sum(c.fwd(role, S / len(plan.ranks(role))) for role in ("rollout", "value", "ref", "reward"))
        inf += sum(c.gather(plan, role) for role in ("value", "ref", "reward"))
        b_train = S / len(trainers)
        micro_steps = min(K, max(1, math.ceil(b_train))) * w.ppo_epochs
        train = c.train(b_train) * train_factor + sum(c.train_comm(plan, role, micro_steps, syncs)
                                                      for role in ("actor", "critic"))
        sync_bytes = (c.weights("actor") + c.weights("critic")) * (w.lora_fraction or 1.0)
        # a sharded trainer gathers its full weights for the sync source to send them
        sync = c.p2p(sync_bytes, sorted(set(trainers) | set(infer))) + c.gather(plan, "actor") \
            + c.gather(plan, "critic")
        experience = c.p2p(S * (w.prompt_len + w.response_len) * (8 + 3 * 4), sorted(set(trainers) | set(infer)))
        a = gen + inf
        phases.update({"generate": gen, "inference": inf, "train": train, "sync": sync + experience})
        if w.max_staleness == 0:
            total = a + experience + train + sync
        elif w.max_staleness == 1:
            total = max(a + experience, train) + sync
        else:
            b1 = train / w.ppo_epochs
            overlapped = max(a, b1) + min(a, b1) / K
            total = overlapped + (train - b1) + sync + experience
    report = model_state_bytes(plan, workload.sizes, hardware.precision, hardware.devices_per_node)
    mem = {r: report.rank_bytes(r) for r in report.per_rank}
    cap = hardware.memory_cap_bytes
    fits = cap is None or max(mem.values()) <= cap
    return PlanEstimate(name=name or plan.strategy, plan=plan, time_s=total, phases=phases, memory_per_rank=mem,
                        fits=fits, samples_per_s=S / total,
                        notes="" if fits else f"over the {cap / 1e9:.3g} GB per-device cap: must shard")


def candidate_plans(devices: int, devices_per_node: int | None = None) -> list[tuple[str, PlacementPlan]]:
    """The plans the planner compares for ``devices`` ranks, each one that `trl_trainers.PPOTrainer` runs.

    Disaggregated splits whose training ranks do not divide the device count are left out: the global batch is cut
    into one shard per device and every trainer takes the same number of shards.

    Every strategy comes plain and, as ``*-sharded``, with its base models sharded ZeRO-3-style (``"GGG"``) inside
    their own rank sets: all four over the world when co-located; under interleaving actor and critic over the
    world and ref / reward over their owner halves; when disaggregated actor and critic over the training ranks and
    ref / reward over the inference ranks (shadow models stay whole: the weight sync overwrites them). A role on a
    single rank has nothing to shard, and a sharded variant is left out when a sharded role's ranks do not split
    into equal groups of ``devices_per_node`` (its intra-node group, `PlacementPlan.role_group_size`).
    """

    def sharded(plan: PlacementPlan) -> dict[str, str]:
        roles = {r: DEFAULT_SHARD_STRATEGY for r in BASE_ROLES if len(plan.roles[r]) > 1}
        try:
            for r in roles:
                plan.role_group_size(r, devices_per_node)
        except ValueError:
            return {}
        return roles

    plan = PlacementPlan.colocated(devices)
    out = [("colocated", plan)]
    if sharded(plan):
        out.append(("colocated-sharded", PlacementPlan.colocated(devices, sharded=True)))
    if devices >= 2 and devices % 2 == 0:
        plan = PlacementPlan.interleaved(devices)
        out.append(("interleaved", plan))
        if sharded(plan):
            out.append(("interleaved-sharded", PlacementPlan.interleaved(devices, sharded_roles=sharded(plan))))
    for n_train in range(1, devices):
        if devices % n_train:  # each trainer takes the same number of the batch's per-rank shards
            continue
        plan = PlacementPlan.disaggregated(devices, train_ranks=list(range(n_train)))
        out.append((f"disaggregated-{n_train}t{devices - n_train}i", plan))
        if sharded(plan):
            out.append((f"disaggregated-{n_train}t{devices - n_train}i-sharded", PlacementPlan.disaggregated(
                devices, train_ranks=list(range(n_train)), sharded_roles=sharded(plan))))
    return out


def rank_plans(workload: Workload, hardware: Hardware, calibration: Calibration | None = None) -> list[PlanEstimate]:
    """Every candidate plan, best first: plans within the memory cap by predicted time, then those over it."""
    ests = [estimate(p, workload, hardware, calibration, name=n)
            for n, p in candidate_plans(hardware.devices, hardware.devices_per_node)]
    return sorted(ests, key=lambda e: (not e.fits, e.time_s))


def to_jsonable(workload: Workload, hardware: Hardware, calibration: Calibration | None,
                ranking: list[PlanEstimate]) -> dict[str, Any]:
    return {"workload": asdict(workload), "hardware": asdict(hardware),
            "calibration": asdict(calibration) if calibration else None,
            "ranking": [e.to_dict() for e in ranking],
            "best": next((e.name for e in ranking if e.fits), None)}


def compare_to_measured(predicted_s: dict[str, float], measured_s: dict[str, float]) -> dict[str, Any]:
    """Score the planner against measured iteration times of the same plans (names as keys).

    Returns the relative error ``|predicted - measured| / measured`` per plan and its maximum, the planner's pick
    (argmin predicted) and the measured best, and the *pick regret*: how much slower the picked plan measured than
    the measured best (0 when the pick is the best). It only computes the numbers; judging them is the caller's.
    """
    common = sorted(set(predicted_s) & set(measured_s))
    if not common:
        raise ValueError(f"no plan is both predicted {sorted(predicted_s)} and measured {sorted(measured_s)}; use the "
                         "same plan names on both sides.")
    bad = [n for n in common if not measured_s[n] > 0 or not predicted_s[n] > 0]
    if bad:
        raise ValueError(f"iteration times must be positive; check plans {bad}.")
    rel = {n: abs(predicted_s[n] - measured_s[n]) / measured_s[n] for n in common}
    pick = min(common, key=lambda n: predicted_s[n])
    best = min(common, key=lambda n: measured_s[n])
    return {"plans": common, "rel_error": rel, "max_rel_error": max(rel.values()), "pick": pick,
            "measured_best": best, "pick_regret": measured_s[pick] / measured_s[best] - 1.0}
