"""The PaRO schedule: what the N / I / G levels mean, written once.

A level says over which ranks one model state is split (paper §3.1): N (not split), I (split over the ``m`` ranks of
a group, replicated across the ``ng = n / m`` groups) or G (split over all ``n`` ranks). Everything the engine does
with a strategy, and everything the cost model charges for it, follows from the four tables below. The engine
executes them (`ParoEngine` looks its collectives up here) and `hf_placement.partition.costs` prices them, so the
byte counters the engine keeps and the formulas the guideline ranks by cannot drift apart.

Terms of one optimizer step of ``s`` micro-steps (paper §3.1, procedure per bucket), with the level(s) that key them:

- t_param, every micro-step (forward, and again in backward), key p: N none; I all-gather intra; G all-gather global
  (this rank's p-level slice -> the full working parameters);
- t_gradient, every micro-step, once per complete bucket, key g: N none (summed locally); I reduce-scatter intra;
  G reduce-scatter global (the full local gradient -> the g-level slice);
- t_sync_g, once at the accumulation boundary, key (g, os): (N,N) all-reduce global; (N,I) reduce-scatter intra then
  all-reduce inter; (N,G) reduce-scatter global; (I,I) all-reduce inter; (I,G) reduce-scatter inter; (G,G) none
  (the accumulated g-level slice -> this rank's os-level slice, summed over all ranks);
- t_sync_p, once after the optimizer step, key (p, os): (N,I) all-gather intra; (N,G) all-gather global; (I,G)
  all-gather inter; p == os none (the updated os slice -> the p-level working slice).

"inter" collectives run over the ranks with the same local index on every node (PaRO's "E" groups); "global" ones
over all ``n`` ranks, either as PaRO-CC (intra part + inter part, `paro_zero_backend.collectives`) or as one flat
ring. t_param moves every parameter (``Ψ``), the other terms only trainable ones (``Ψ'``, paper §11).

Slices. Flat buffers are padded to a multiple of ``n`` and laid out device-major (rank ``r = i*m + j`` of group
``i``, local index ``j``, owns block ``k = j*ng + i``), so each level's slice is contiguous and a finer level's slice
lies inside a coarser one's (`slice_range`): the G block of rank ``r`` is inside its I chunk, which is inside the
full buffer. ``d(level)`` (`divisor`) is 1, ``m`` or ``n``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .strategies import Level, Strategy, parse_strategy

__all__ = ["Op", "Span", "Collective", "Phase", "Schedule", "schedule_for", "divisor", "slice_range", "shard_span",
           "gather_to_full", "AG_INTRA", "AG_INTER", "AG_GLOBAL", "RS_INTRA", "RS_INTER", "RS_GLOBAL", "AR_INTER",
           "AR_GLOBAL"]

N, I, G = Level.N, Level.I, Level.G  # noqa: E741 - the paper's letters


class Op(str, enum.Enum):
    """What a collective does to a buffer."""

    ALL_GATHER = "all_gather"  # every rank's slice -> the concatenation (a coarser level)
    REDUCE_SCATTER = "reduce_scatter"  # sum over ranks, each rank keeps its slice (a finer level)
    ALL_REDUCE = "all_reduce"  # sum over ranks, the level stays


class Span(str, enum.Enum):
    """Which ranks a collective runs over."""

    INTRA = "intra"  # the m ranks of this rank's group (one node: fast links)
    INTER = "inter"  # the ng ranks with this rank's local index (one per group: slow links)
    GLOBAL = "global"  # all n ranks: PaRO-CC (intra + inter parts) or a flat ring


@dataclass(frozen=True)
class Collective:
    op: Op
    span: Span

    def output_level(self, level: Level) -> Level:
        """The level of the data after this collective, given the level it was applied to."""
        if self.op == Op.ALL_REDUCE:
            return level
        moves = _GATHER if self.op == Op.ALL_GATHER else _SCATTER
        key = (self.span, level)
        if key not in moves:
            raise ValueError(f"{self.op.value} over {self.span.value} does not apply to a level-{level.name} buffer.")
        return moves[key]

    def __str__(self) -> str:
        return f"{self.op.value}[{self.span.value}]"


AG_INTRA, AG_INTER, AG_GLOBAL = (Collective(Op.ALL_GATHER, s) for s in (Span.INTRA, Span.INTER, Span.GLOBAL))
RS_INTRA, RS_INTER, RS_GLOBAL = (Collective(Op.REDUCE_SCATTER, s) for s in (Span.INTRA, Span.INTER, Span.GLOBAL))
AR_INTER, AR_GLOBAL = Collective(Op.ALL_REDUCE, Span.INTER), Collective(Op.ALL_REDUCE, Span.GLOBAL)

# (span, input level) -> output level: an all-gather coarsens the slice, a reduce-scatter refines it.
_GATHER = {(Span.INTRA, I): N, (Span.INTER, G): I, (Span.GLOBAL, G): N}
_SCATTER = {(Span.INTRA, N): I, (Span.INTER, I): G, (Span.GLOBAL, N): G}

# ---------------------------------------------------------------------------------------------------- the tables
#: t_param: this rank's p-level slice -> the full working parameters (forward, and again in backward).
PARAM_GATHER: dict[Level, tuple[Collective, ...]] = {N: (), I: (AG_INTRA,), G: (AG_GLOBAL,)}
#: t_gradient: the full local gradient of one micro-step -> the g-level slice, summed over the g-level's ranks.
GRADIENT_REDUCE: dict[Level, tuple[Collective, ...]] = {N: (), I: (RS_INTRA,), G: (RS_GLOBAL,)}
#: t_sync_g: the accumulated g-level slice -> this rank's os-level slice, summed over all n ranks.
SYNC_G: dict[tuple[Level, Level], tuple[Collective, ...]] = {
    (N, N): (AR_GLOBAL,),
    (N, I): (RS_INTRA, AR_INTER),
    (N, G): (RS_GLOBAL,),
    (I, I): (AR_INTER,),
    (I, G): (RS_INTER,),
    (G, G): (),
}
#: t_sync_p: the updated os-level slice -> the p-level working slice.
SYNC_P: dict[tuple[Level, Level], tuple[Collective, ...]] = {
    (N, N): (),
    (N, I): (AG_INTRA,),
    (N, G): (AG_GLOBAL,),
    (I, I): (),
    (I, G): (AG_INTER,),
    (G, G): (),
}
#: The span a level is partitioned over (None: every rank holds everything).
SHARD_SPAN: dict[Level, Span | None] = {N: None, I: Span.INTRA, G: Span.GLOBAL}


@dataclass(frozen=True)
class Phase:
    """One term of the schedule: its collectives, when they run and what they move.

    ``input_level`` is the level of the buffer the first collective gets, ``output_level`` the level the last one
    leaves; ``repeats`` is the number of times the phase runs per micro-step (``per_micro_step``) or per step.
    ``trainable_only``: the phase moves only trainable parameters' buckets (``Ψ'``); else every bucket (``Ψ``).
    ``dtype``: ``"param"`` (compute dtype) or ``"grad"`` (gradient-reduction dtype).
    """

    term: str
    when: str
    collectives: tuple[Collective, ...]
    input_level: Level
    output_level: Level
    per_micro_step: bool
    repeats: int
    trainable_only: bool
    dtype: str


@dataclass(frozen=True)
class Schedule:
    """The four phases of one strategy, in the order they run (`schedule_for`)."""

    strategy: Strategy
    param: Phase
    gradient: Phase
    sync_g: Phase
    sync_p: Phase

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self.param, self.gradient, self.sync_g, self.sync_p


def schedule_for(strategy: str | Strategy, reshard_after_forward: bool = True) -> Schedule:
    """The schedule of ``strategy``: which collectives run, over which ranks, at which point of the step.

    ``reshard_after_forward=False`` keeps a unit's gathered parameters from its forward to its backward (FSDP2's
    knob of that name): one parameter gather per micro-step instead of two.
    """
    st = parse_strategy(strategy)
    when = ("every micro-step: gathered for the forward, again for the backward" if reshard_after_forward else
            "every micro-step: gathered for the forward, kept for the backward")
    return Schedule(
        strategy=st,
        param=Phase("t_param", when, PARAM_GATHER[st.p], st.p, N, True, 2 if reshard_after_forward else 1, False,
                    "param"),
        gradient=Phase("t_gradient", "every micro-step, once per bucket when its gradients are complete",
                       GRADIENT_REDUCE[st.g], N, st.g, True, 1, True, "grad"),
        sync_g=Phase("t_sync_g", "once per step, at the accumulation boundary", SYNC_G[(st.g, st.os)], st.g, st.os,
                     False, 1, True, "grad"),
        sync_p=Phase("t_sync_p", "once per step, after the optimizer updated the os shards", SYNC_P[(st.p, st.os)],
                     st.os, st.p, False, 1, True, "param"),
    )


def gather_to_full(level: Level) -> tuple[Collective, ...]:
    """Collectives that turn a level-``level`` slice into the full buffer (the t_param gather of that level)."""
    return PARAM_GATHER[level]


def shard_span(level: Level) -> Span | None:
    """The ranks a level-``level`` state is split over (a norm or a flag over that state reduces over them)."""
    return SHARD_SPAN[level]


def divisor(level: Level, world_size: int, group_size: int) -> int:
    """``d(level)``: a level-``level`` slice holds ``1 / d`` of the buffer: 1 (N), ``m`` (I) or ``n`` (G)."""
    return {N: 1, I: group_size, G: world_size}[level]


def slice_range(level: Level, size: int, world_size: int, group_size: int, rank: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of a padded flat buffer of ``size`` elements that ``rank`` holds at ``level``
    (device-major layout: the I chunk of local index ``j`` is blocks ``j*ng .. j*ng + ng - 1``)."""
    d = divisor(level, world_size, group_size)
    if d == 1:
        return 0, size
    ng = world_size // group_size
    i, j = rank // group_size, rank % group_size
    index = j if level == I else j * ng + i
    c = size // d
    return index * c, (index + 1) * c
