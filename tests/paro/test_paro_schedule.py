"""The schedule table (the one copy of the N / I / G semantics): its phases reach the right levels, its slices nest,
its price is the paper's closed-form formulas, and no other engine module does its own case analysis on levels."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest

from hf_placement.partition import VALID_STRATEGY_NAMES, Level, Span, divisor, slice_range
from paro_zero_backend import bytes_per_element, memory_bytes, schedule_for, traffic

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (32, 8), (6, 3))


def _walk(phase) -> Level:
    level = phase.input_level
    for c in phase.collectives:
        level = c.output_level(level)
    return level


@pytest.mark.parametrize("name", VALID_STRATEGY_NAMES)
def test_every_phase_leaves_the_level_it_promises(name):
    sched = schedule_for(name)
    st = sched.strategy
    assert (sched.param.input_level, sched.param.output_level) == (st.p, Level.N)
    assert (sched.gradient.input_level, sched.gradient.output_level) == (Level.N, st.g)
    assert (sched.sync_g.input_level, sched.sync_g.output_level) == (st.g, st.os)
    assert (sched.sync_p.input_level, sched.sync_p.output_level) == (st.os, st.p)
    for phase in sched.phases:
        assert _walk(phase) == phase.output_level, (name, phase.term)


@pytest.mark.parametrize("n, m", LAYOUTS)
def test_slices_nest_and_partition_the_buffer(n, m):
    size = 7 * n
    ng = n // m
    for rank in range(n):
        full, chunk, block = (slice_range(level, size, n, m, rank) for level in Level)
        assert full == (0, size)
        assert full[0] <= chunk[0] and chunk[1] <= full[1] and chunk[0] <= block[0] and block[1] <= chunk[1]
        assert chunk[1] - chunk[0] == size // divisor(Level.I, n, m) and block[1] - block[0] == size // n
    # the I chunks of one group, and the G blocks of all ranks, cover the buffer exactly once
    for group in range(ng):
        chunks = sorted(slice_range(Level.I, size, n, m, group * m + j) for j in range(m))
        assert [c[0] for c in chunks] == [k * size // m for k in range(m)]
    blocks = sorted(slice_range(Level.G, size, n, m, r) for r in range(n))
    assert [b[0] for b in blocks] == [k * size // n for k in range(n)]


def _closed_form(name: str, n: int, m: int, s: int, psi: float, psi_t: float) -> dict[str, float]:
    """The paper's terms written out by hand (PaRO-CC, 1 byte per element), independent of the table."""
    ng = n // m
    a_i, a_e = (m - 1) / m, (ng - 1) / n
    p, g, o = name
    t_param = {"N": 0, "I": 2 * a_i, "G": 2 * (a_i + a_e)}[p] * s * psi
    t_grad = {"N": 0, "I": a_i, "G": a_i + a_e}[g] * s * psi_t
    t_sync_g = {"NN": 2 * a_i + 2 * a_e, "NI": a_i + 2 * a_e, "NG": a_i + a_e, "II": 2 * a_e, "IG": a_e,
                "GG": 0}[g + o] * psi_t
    t_sync_p = {"NI": a_i, "NG": a_i + a_e, "IG": a_e}.get(p + o, 0) * psi_t
    return {"t_param": t_param, "t_gradient": t_grad, "t_sync_g": t_sync_g, "t_sync_p": t_sync_p}


@pytest.mark.parametrize("name", VALID_STRATEGY_NAMES)
def test_the_price_of_the_table_is_the_closed_form(name):
    for (n, m), s in itertools.product(LAYOUTS, (1, 3)):
        got = traffic(name, 1000.0, 600.0, n, m, s, bytes_param=1, bytes_grad=1)
        want = _closed_form(name, n, m, s, 1000.0, 600.0)
        for term, v in want.items():
            assert math.isclose(sum(got[term].values()), v, abs_tol=1e-9), (name, n, m, s, term, got[term], v)
        assert math.isclose(got["intra"] + got["inter"], sum(want.values()), abs_tol=1e-9)
        # without PaRO-CC a global collective is one flat ring: a_F instead of a_I + a_E per element
        flat = traffic(name, 1000.0, 600.0, n, m, s, bytes_param=1, bytes_grad=1, paro_cc=False)
        delta = sum(_global_elements(name, s, 1000.0, 600.0)) * ((n - 1) / n - (m - 1) / m - (n // m - 1) / n)
        assert math.isclose(flat["intra"] + flat["inter"] + flat["flat"], sum(want.values()) + delta, abs_tol=1e-6)


def _global_elements(name: str, s: int, psi: float, psi_t: float) -> list[float]:
    """Elements times multiplicity of each global collective (x2 for an all-reduce) of the schedule."""
    out = []
    for phase in schedule_for(name).phases:
        elements = psi_t if phase.trainable_only else psi
        calls = phase.repeats * (s if phase.per_micro_step else 1)
        for c in phase.collectives:
            if c.span == Span.GLOBAL:
                out.append(elements * calls * (2 if c.op.value == "all_reduce" else 1))
    return out


def test_bytes_per_element_of_the_engine():
    assert bytes_per_element() == {"bytes_param": 4.0, "bytes_grad": 4.0, "bytes_os": 8.0}  # master = params
    assert bytes_per_element("bf16") == {"bytes_param": 2.0, "bytes_grad": 2.0, "bytes_os": 12.0}
    assert bytes_per_element("bf16", reduce_dtype="fp32")["bytes_grad"] == 4.0
    assert bytes_per_element("fp16", optimizer_state_bytes=4)["bytes_os"] == 8.0  # SGD momentum + master
    # unsharded fp32 + Adam: 16 bytes per trainable parameter, like plain torch
    assert memory_bytes("NNN", 10, 10, 4, 2, **bytes_per_element())["total"] == 160


def test_levels_are_analysed_only_in_the_schedule():
    """The N/I/G semantics are written once (`hf_placement.partition`): the engine, the guideline, the placement
    planner and the trainer look them up instead of branching on levels."""
    pattern = re.compile(r"Level\.I|Level\.G|\(N, I\)|\(I, G\)")
    partition = ROOT / "hf_placement" / "partition"
    allowed = {partition / "schedule.py", partition / "strategies.py"}
    packages = ("hf_placement", "paro_zero_backend", "trl_trainers", "accelerate_plugins")
    offenders = [f"{path.relative_to(ROOT)}:{k + 1}" for package in packages
                 for path in sorted((ROOT / package).rglob("*.py")) if path not in allowed
                 for k, line in enumerate(path.read_text().splitlines()) if pattern.search(line)]
    assert offenders == []
