"""tea_pipeline: LightTEA time-aware entity alignment between two temporal knowledge graphs.

LightTEA (Cai et al., IJCAI 2023, arXiv 2307.06013) aligns entities without a neural network: two-aspect
(relational, temporal) three-view label propagation, sparse similarity with temporal constraints, a Sinkhorn
operator and temporal iterative learning. `load_tkg_pair` reads the TEA-GNN/LightTEA folder layout through
`datasets`; `LightTEA(config).fit(pair)` returns an `AlignmentResult`; ``python -m tea_pipeline align`` is the CLI.
"""

from .config import LightTEAConfig
from .data import TKGDataError, TKGPair, load_tkg_pair
from .engine import AlignmentResult, LightTEA, RoundMetrics
from .graph import TKGGraph, build_graph, time_counts
from .kernels import native_kernels
from .propagation import (
    Propagated,
    SeedLabels,
    TripleLayout,
    aspect_features,
    l2n,
    propagate,
    propagate_labels,
    seed_labels,
    triple_layout,
    triple_view,
)
from .similarity import TemporalSimilarity, TopK, blocked_topk
from .sinkhorn import dense_sinkhorn, sparse_sinkhorn
from .synthetic import make_scaled_pair, make_synthetic_pair

__all__ = [
    "AlignmentResult",
    "LightTEA",
    "LightTEAConfig",
    "Propagated",
    "RoundMetrics",
    "SeedLabels",
    "TKGDataError",
    "TKGGraph",
    "TKGPair",
    "TemporalSimilarity",
    "TopK",
    "TripleLayout",
    "aspect_features",
    "blocked_topk",
    "build_graph",
    "dense_sinkhorn",
    "l2n",
    "load_tkg_pair",
    "make_scaled_pair",
    "make_synthetic_pair",
    "native_kernels",
    "propagate",
    "propagate_labels",
    "seed_labels",
    "sparse_sinkhorn",
    "time_counts",
    "triple_layout",
    "triple_view",
]
