"""The PaRO strategy space: three partition levels for each of parameters, gradients and optimizer states.

A strategy is written ``P_{p g os}`` in the paper, e.g. ``"IIG"``: parameters partitioned inside a group of ``m``
ranks, gradients inside the group, optimizer states across all ``n`` ranks. Levels are ordered by fineness
``N < I < G``. The paper's validity rule is that optimizer states must be split at least as finely as both
parameters and gradients: a coarser os copy would cost memory and save no communication. That leaves 14 of the 27
combinations (paper §3.1). What each level means for communication is written once, in
`hf_placement.partition.schedule`.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

__all__ = ["Level", "Strategy", "VALID_STRATEGIES", "parse_strategy", "KNOWN_EQUIVALENTS"]


class Level(enum.IntEnum):
    """How finely one model state is split. The integer value is the fineness order used by the validity rule."""

    N = 0  # not partitioned: every rank holds the full tensor
    I = 1  # noqa: E741 - the paper's letter; partitioned over the m ranks of one group, replicated across groups
    G = 2  # partitioned over all n ranks

    def divisor(self, world_size: int, group_size: int) -> int:
        """``d(level)`` in the memory formula: 1, m or n (`divisor` in `hf_placement.partition.schedule`)."""
        from .schedule import divisor  # the schedule module defines the levels' semantics and imports this one

        return divisor(self, world_size, group_size)


@dataclass(frozen=True)
class Strategy:
    """A valid PaRO strategy (parameters, gradients, optimizer states levels)."""

    p: Level
    g: Level
    os: Level

    def __post_init__(self) -> None:
        if self.os < self.p or self.os < self.g:
            raise ValueError(
                f"strategy {self.name!r} is invalid: optimizer states (os={self.os.name}) must be partitioned at least "
                f"as finely as parameters (p={self.p.name}) and gradients (g={self.g.name}) (order N < I < G); a "
                f"coarser os copy costs memory and saves no communication. Valid strategies: "
                f"{', '.join(VALID_STRATEGY_NAMES)}."
            )

    @property
    def name(self) -> str:
        return f"{self.p.name}{self.g.name}{self.os.name}"

    def __str__(self) -> str:
        return self.name

    @property
    def partitions_params(self) -> bool:
        return self.p != Level.N


def _valid(p: Level, g: Level, os: Level) -> bool:
    return os >= p and os >= g


# Paper order: grouped by os level, then p, then g.
VALID_STRATEGY_NAMES: tuple[str, ...] = tuple(
    f"{p.name}{g.name}{o.name}"
    for o in Level
    for p, g in itertools.product(Level, Level)
    if _valid(p, g, o)
)
VALID_STRATEGIES: tuple[Strategy, ...] = tuple(
    Strategy(Level[s[0]], Level[s[1]], Level[s[2]]) for s in VALID_STRATEGY_NAMES
)

KNOWN_EQUIVALENTS: dict[str, str] = {
    "NNN": "DDP (local accumulation, all-reduce at the boundary)",
    "NNG": "ZeRO-1",
    "NGG": "ZeRO-2",
    "GGG": "ZeRO-3 / FSDP FULL_SHARD",
    "III": "MiCS / FSDP HYBRID_SHARD / HSDP",
}


def parse_strategy(value: str | Strategy) -> Strategy:
    """Parse ``"IIG"`` (case-insensitive) into a `Strategy`, with an error that lists the valid choices."""
    if isinstance(value, Strategy):
        return value
    if not isinstance(value, str):
        raise TypeError(f"strategy must be a string such as 'IIG', got {type(value).__name__}.")
    text = value.strip().upper()
    if len(text) != 3 or any(c not in "NIG" for c in text):
        raise ValueError(
            f"strategy={value!r} is not three letters from N/I/G (p, g, os levels). Valid strategies: "
            f"{', '.join(VALID_STRATEGY_NAMES)}, or 'auto' to let the guideline choose."
        )
    return Strategy(Level[text[0]], Level[text[1]], Level[text[2]])
