"""paro_zero_backend: PaRO-DP (Partial Redundancy Optimizer, NeurIPS 2024) for plain torch.distributed.

- `ParoEngine` + `ParoConfig`: all 14 strategies (p, g, os partitioned at N / I / G), on the whole world or a
  sub-group (``hf_placement.build_topology(ranks=...)``), PaRO-CC collectives, fp32 master weights with bf16/fp16
  compute, gradient clipping, inference-only engines for frozen models, pinned full weights (``gathered()``), sharded
  and consolidated checkpoints, byte counters.
- `schedule_for`: the one table of what each level does (collective, group, point of the step), which the engine
  executes and `traffic` / `collectives` / `memory_bytes` price (`bytes_per_element` for an engine's settings).
- `resolve_strategy`: ``strategy="auto"`` -> the guideline's pick, before an engine is built.
- `hierarchical_all_gather` / `hierarchical_reduce_scatter` / `hierarchical_all_reduce`: PaRO-CC on their own.
- `advise`: the guideline (``python -m paro_zero_backend advise --help``).
- PaRO-CC inside the engines users already run: `enable_paro_cc` (FSDP2 ``fully_shard`` modules),
  `deepspeed_paro_cc` (DeepSpeed ZeRO's all-gather / reduce-scatter), and `deepspeed_initialize` for a DeepSpeed JSON
  with a ``"paro"`` section (PaRO-CC inside ZeRO, or the whole job on `ParoEngine` with ``"strategy"``).
"""

from hf_placement.partition import (
    KNOWN_EQUIVALENTS,
    VALID_STRATEGIES,
    Level,
    Schedule,
    Strategy,
    memory_bytes,
    parse_strategy,
    schedule_for,
    traffic,
)

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
from .cost_model import (
    GuidelineInputs,
    GuidelineRow,
    GuidelineTable,
    advise,
    bytes_per_element,
)
from .deepspeed_cc import DeepSpeedParoCC, UnsupportedDeepSpeedError, deepspeed_paro_cc
from .ds_config import DeepSpeedStyleEngine, ParoSection, paro_config_from_deepspeed
from .ds_config import initialize as deepspeed_initialize
from .engine import LocalState, ParoEngine, ShardPiece
from .fsdp2_cc import ParoCCHandle, enable_paro_cc
from .resolve import ResolvedStrategy, measure_bandwidths, resolve_strategy

__all__ = [
    "CollectiveResult",
    "CommCounter",
    "DeepSpeedParoCC",
    "DeepSpeedStyleEngine",
    "GuidelineInputs",
    "GuidelineRow",
    "GuidelineTable",
    "KNOWN_EQUIVALENTS",
    "Level",
    "LocalState",
    "ParoCCHandle",
    "ParoConfig",
    "ParoEngine",
    "ParoSection",
    "ResolvedStrategy",
    "Schedule",
    "ShardPiece",
    "Strategy",
    "VALID_STRATEGIES",
    "UnsupportedDeepSpeedError",
    "advise",
    "bytes_per_element",
    "deepspeed_initialize",
    "deepspeed_paro_cc",
    "enable_paro_cc",
    "flat_all_gather",
    "flat_all_reduce",
    "flat_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_all_gather_coalesced",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "measure_bandwidths",
    "memory_bytes",
    "paro_config_from_deepspeed",
    "parse_strategy",
    "resolve_strategy",
    "schedule_for",
    "traffic",
]
