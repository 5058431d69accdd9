"""What a partition schedule costs: model-state bytes per rank and bytes sent per collective, priced from the table.

Every planner that weighs partitioning strategies (the PaRO guideline, `paro_zero_backend.advise`; the placement
planner, `hf_placement.planner`, for sharded roles) prices the one schedule table of `hf_placement.partition.schedule`
with these functions, and the engine that executes the table counts the same bytes, so the three cannot drift apart.
With ``a_I = (m-1)/m``, ``a_E = (ng-1)/n`` and ``a_F = (n-1)/n`` (flat ring), a collective sends a ring's share of its
buffer; memory per rank is ``b_p Ψ/d(p) + b_g Ψ'/d(g) + b_os Ψ'/d(os)``.
"""

from __future__ import annotations

from .schedule import Collective, Op, Span, divisor, schedule_for
from .strategies import Level, Strategy, parse_strategy

__all__ = ["collectives", "memory_bytes", "traffic"]


def memory_bytes(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int,
                 group_size: int, bytes_param: float = 2, bytes_grad: float = 2, bytes_os: float = 12
                 ) -> dict[str, float]:
    """Model-state bytes per rank by kind (``params``, ``grads``, ``os``) and their ``total``:
    ``b_p Ψ/d(p) + b_g Ψ'/d(g) + b_os Ψ'/d(os)``.

    For a `paro_zero_backend.ParoEngine` run take the bytes per element from `paro_zero_backend.bytes_per_element`
    (fp32 + Adam: 4, 4, 8; bf16 + Adam: 2, 2, 12) and the padded sizes from ``engine.padded_numel()``:
    ``engine.memory_bytes()["total"]`` then equals ``total`` exactly (after the optimizer's first step, when it has
    allocated its state).
    """
    st = parse_strategy(strategy)
    n, m = world_size, group_size
    out = {"params": bytes_param * num_params / divisor(st.p, n, m),
           "grads": bytes_grad * trainable_params / divisor(st.g, n, m),
           "os": bytes_os * trainable_params / divisor(st.os, n, m)}
    out["total"] = out["params"] + out["grads"] + out["os"]
    return out


def _records(c: Collective, level: Level, n: int, m: int, paro_cc: bool) -> list[tuple[str, str, float]]:
    """``(link, op, elements sent per rank / full buffer size)`` of one collective applied to a level-``level``
    buffer, split the way the engine's PaRO-CC collectives run it (ring send volumes)."""
    ng = n // m
    a_i, a_e, a_f = (m - 1) / m, (ng - 1) / n, (n - 1) / n
    op = c.op.value
    if c.span == Span.INTRA:
        return [("intra", op, a_i)]
    if c.span == Span.INTER:
        # an all-reduce keeps the whole 1/d(level) slice on every rank and sends twice a reduce-scatter's share
        return [("inter", op, 2 * (ng - 1) / ng / divisor(level, n, m) if c.op == Op.ALL_REDUCE else a_e)]
    if not paro_cc:
        return [("flat", op, (2 if c.op == Op.ALL_REDUCE else 1) * a_f)]
    if c.op == Op.ALL_GATHER:
        return [("inter", op, a_e), ("intra", op, a_i)]
    if c.op == Op.REDUCE_SCATTER:
        return [("intra", op, a_i), ("inter", op, a_e)]
    if m == 1:  # PaRO-CC all-reduce with a one-rank part is a single all-reduce over the other part
        return [("inter", op, 2 * a_e)]
    if ng == 1:
        return [("intra", op, 2 * a_i)]
    return [("intra", Op.REDUCE_SCATTER.value, a_i), ("inter", op, 2 * a_e), ("intra", Op.ALL_GATHER.value, a_i)]


def collectives(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int,
                group_size: int, accumulation_steps: int, bytes_param: float = 2, bytes_grad: float = 2,
                paro_cc: bool = True, reshard_after_forward: bool = True) -> list[dict]:
    """The collectives one optimizer step issues per bucket, priced from the schedule table
    (`hf_placement.partition.schedule`): ``{"term", "link", "op", "bytes", "calls"}`` records, ``op`` in
    ``all_gather`` / ``reduce_scatter`` / ``all_reduce``, ``bytes`` sent per rank summed over the ``calls``. Summed
    by link they equal `traffic`; this split is what latency and per-operation factors need. ``reshard_after_forward``:
    see
    `schedule_for`."""
    n, m, s = world_size, group_size, accumulation_steps
    out: list[dict] = []
    for phase in schedule_for(strategy, reshard_after_forward).phases:
        elements = trainable_params if phase.trainable_only else num_params
        nbytes = bytes_param if phase.dtype == "param" else bytes_grad
        calls = phase.repeats * (s if phase.per_micro_step else 1)
        level = phase.input_level
        for c in phase.collectives:
            for link, op, fraction in _records(c, level, n, m, paro_cc):
                if fraction > 0 and elements > 0:
                    out.append({"term": phase.term, "link": link, "op": op,
                                "bytes": fraction * elements * calls * nbytes, "calls": calls})
            level = c.output_level(level)
    return out


def traffic(strategy: str | Strategy, num_params: float, trainable_params: float, world_size: int, group_size: int,
            accumulation_steps: int, bytes_param: float = 2, bytes_grad: float = 2, paro_cc: bool = True
            ) -> dict[str, float]:
    """Bytes sent per rank per optimizer step, by link (``intra``, ``inter``, ``flat``), plus the per-term split
    (``t_param``, ``t_gradient``, ``t_sync_g``, ``t_sync_p`` as ``{link: bytes}``) and ``inter_launches`` (inter-group
    or flat collective calls per bucket and step, whatever their size)."""
    result: dict = {"intra": 0.0, "inter": 0.0, "flat": 0.0}
    for phase in schedule_for(strategy).phases:
        result[phase.term] = {}
    for r in collectives(strategy, num_params, trainable_params, world_size, group_size, accumulation_steps,
                         bytes_param, bytes_grad, paro_cc):
        result[r["link"]] += r["bytes"]
        result[r["term"]][r["link"]] = result[r["term"]].get(r["link"], 0.0) + r["bytes"]
    result["inter_launches"] = float(sum(
        phase.repeats * (accumulation_steps if phase.per_micro_step else 1)
        for phase in schedule_for(strategy).phases for c in phase.collectives if c.span != Span.INTRA))
    return result
