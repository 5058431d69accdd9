"""How model states are partitioned over a two-level topology: the strategy space and the one schedule table.

A partitioning strategy (PaRO, NeurIPS 2024) splits parameters, gradients and optimizer states each at a level: N
(not split), I (inside a group of ``m`` ranks: one node) or G (over all ``n`` ranks) of a `hf_placement.Topology`.
This is data, as a `hf_placement.PlacementPlan` is: the engine that executes it (`paro_zero_backend.ParoEngine`) and
the planners that price it (`paro_zero_backend.advise`, `hf_placement.planner`) all read it from here, so the
meaning of N / I / G is written once.

- `Level`, `Strategy`, `parse_strategy`, `VALID_STRATEGIES`: the 14 valid strategies;
- `schedule_for`: which collective each state needs, over which group, at which point of a step;
- `memory_bytes`, `collectives`, `traffic`: what a strategy holds and sends per rank.
"""

from .costs import collectives, memory_bytes, traffic
from .schedule import (
    Collective,
    Op,
    Phase,
    Schedule,
    Span,
    divisor,
    gather_to_full,
    schedule_for,
    shard_span,
    slice_range,
)
from .strategies import KNOWN_EQUIVALENTS, VALID_STRATEGIES, VALID_STRATEGY_NAMES, Level, Strategy, parse_strategy

__all__ = [
    "Collective",
    "KNOWN_EQUIVALENTS",
    "Level",
    "Op",
    "Phase",
    "Schedule",
    "Span",
    "Strategy",
    "VALID_STRATEGIES",
    "VALID_STRATEGY_NAMES",
    "collectives",
    "divisor",
    "gather_to_full",
    "memory_bytes",
    "parse_strategy",
    "schedule_for",
    "shard_span",
    "slice_range",
    "traffic",
]
