"""paro_zero_backend: PaRO-DP (Partial Redundancy Optimizer, NeurIPS 2024) for plain torch.distributed.

- `ParoEngine` + `ParoConfig`: all 14 strategies (p, g, os partitioned at N / I / G), PaRO-CC collectives, fp32 master
  weights with bf16/fp16 compute, gradient clipping, sharded and consolidated checkpoints, byte counters.
- `hierarchical_all_gather` / `hierarchical_reduce_scatter` / `hierarchical_all_reduce`: PaRO-CC on their own.
- `advise`: the guideline (``python -m paro_zero_backend advise --help``).
"""

from .collectives import (
    CollectiveResult,
    CommCounter,
    flat_all_gather,
    flat_all_reduce,
    flat_reduce_scatter,
    hierarchical_all_gather,
    hierarchical_all_gather_coalesced,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
)
from .config import ParoConfig
from .cost_model import GuidelineInputs, GuidelineRow, GuidelineTable, advise, memory_bytes, traffic
from .engine import ParoEngine
from .strategies import KNOWN_EQUIVALENTS, VALID_STRATEGIES, Level, Strategy, parse_strategy

__all__ = [
    "CollectiveResult",
    "CommCounter",
    "GuidelineInputs",
    "GuidelineRow",
    "GuidelineTable",
    "KNOWN_EQUIVALENTS",
    "Level",
    "ParoConfig",
    "ParoEngine",
    "Strategy",
    "VALID_STRATEGIES",
    "advise",
    "flat_all_gather",
    "flat_all_reduce",
    "flat_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_all_gather_coalesced",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "memory_bytes",
    "parse_strategy",
    "traffic",
]
