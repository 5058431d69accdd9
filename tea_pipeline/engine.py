"""`LightTEA`: temporal iterative learning around label propagation, sparse similarity and Sinkhorn.

Per round (reference main loop of ``LightTEA.py``): features of both aspects are recomputed from scratch with
fresh random labels on the current seeds, the test set is evaluated, and (except in the last round) source entities
whose best Sinkhorn score exceeds the threshold become pseudo seeds. Evaluation and the pseudo-seed search of a
round share one blocked similarity pass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .ann import faiss_available, ivf_topk
from .config import LightTEAConfig
from .data import TKGPair
from .graph import AspectGraph, build_graph, time_counts
from .memory import reuse_freed_memory, trim_freed_memory
from .precision import matmul_dtype, search_dtype
from .propagation import (
    SeedLabels,
    csr,
    l2n_,
    nonzero_rows,
    propagate_labels,
    triple_layout,
    triple_operands,
    triple_sums,
    triple_sums_into,
)
from .similarity import TemporalSimilarity, TopK, blocked_topk, candidate_recall, lowrank_topk
from .sinkhorn import sparse_sinkhorn

logger = logging.getLogger(__name__)

FP16_FEATURES_MIN_BYTES = 768 << 20
"""``feature_dtype="auto"`` stores fp16 features from this many bytes of one fp32 feature matrix (entities x feature
width): a YAGO-WIKI50K-sized pair and larger, not YAGO-WIKI20K (bench/tea/README.md has the time and memory of both)."""


@dataclass
class RoundMetrics:
    round: int
    hits_at_1: float
    hits_at_10: float
    mrr: float
    num_train_pairs: int
    pseudo_seeds_added: int = 0
    pseudo_seed_precision: float | None = None
    seconds: float = 0.0
    candidate_recall: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"round": d.pop("round"), "hits@1": d.pop("hits_at_1"), "hits@10": d.pop("hits_at_10"),
                "mrr": d.pop("mrr"), **d}


@dataclass
class AlignmentResult:
    """What `LightTEA.fit` found.

    ``predicted`` is an ``(n_test, 2)`` array of (test source entity, predicted target entity) from the last round,
    ``scores`` the Sinkhorn score of that prediction, ``truth`` the test pairs; ``timings`` are seconds per stage.
    """

    rounds: list[RoundMetrics]
    predicted: np.ndarray
    scores: np.ndarray
    truth: np.ndarray
    pseudo_seeds: np.ndarray
    timings: dict[str, float]
    config: dict[str, Any]
    device: str
    data_summary: dict[str, int] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, float]:
        last = self.rounds[-1]
        return {"hits@1": last.hits_at_1, "hits@10": last.hits_at_10, "mrr": last.mrr}

    def to_dict(self) -> dict[str, Any]:
        return {"final": self.final, "rounds": [r.as_dict() for r in self.rounds], "timings_s": self.timings,
                "device": self.device, "data": self.data_summary, "config": self.config}

    def save(self, output_dir: str | Path, pair: TKGPair | None = None) -> Path:
        """Write ``metrics.json`` and ``alignment.tsv`` (source id/name, predicted id/name, score, true id,
        correct) to ``output_dir``."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        names = pair.entity_names if pair is not None else None
        with (out / "alignment.tsv").open("w") as fh:
            fh.write("source_id\tsource_name\tpredicted_id\tpredicted_name\tscore\ttrue_id\tcorrect\n")
            for (src, pred), score, true in zip(self.predicted.tolist(), self.scores.tolist(),
                                                self.truth[:, 1].tolist()):
                sn = names[src] if names else ""
                pn = names[pred] if names and pred >= 0 else ""
                fh.write(f"{src}\t{sn}\t{pred}\t{pn}\t{score:.6g}\t{true}\t{int(pred == true)}\n")
        return out


class LightTEA:
    """LightTEA entity alignment between two temporal KGs (Cai et al., IJCAI 2023, arXiv 2307.06013).

    Example:
    ```python
    >>> from tea_pipeline import LightTEA, LightTEAConfig, make_synthetic_pair
    >>> pair = make_synthetic_pair(num_entities=600, seed=0)
    >>> result = LightTEA(LightTEAConfig(dim=128, top_k=50)).fit(pair)
    >>> result.final["hits@1"] > 0.9
    True
    ```
    """

    def __init__(self, config: LightTEAConfig | None = None) -> None:
        self.config = config or LightTEAConfig()
        self.timings: dict[str, float] = defaultdict(float)
        self._bar = None
        self._round = 0
        self._kept_bytes: int | None = None  # set while fit keeps freed memory (reuse_freed_memory)
        self.current_stage: str | None = None  # the stage running now (read by memory samplers in benchmarks)

    # --------------------------------------------------------------------------------------------------------
    @contextmanager
    def _stage(self, name: str, device: torch.device):
        if self._bar is not None:
            self._bar.set_description(f"LightTEA round {self._round}: {name}")
        if self._kept_bytes is not None:
            # What the last stage freed is reused only in part by the next one (other shapes), so above the limit
            # it goes back to the OS here rather than adding to this stage's peak RSS.
            trim_freed_memory(self._kept_bytes)
        start = time.perf_counter()
        self.current_stage = name
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.timings[name] += time.perf_counter() - start
            self.current_stage = None

    def resolve_device(self) -> torch.device:
        want = self.config.device
        if want == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if want.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"LightTEAConfig.device={want!r} but CUDA is not available in this torch build; "
                               "use device='cpu' or 'auto'.")
        return torch.device(want)

    def aspect_dim(self, pair: TKGPair) -> int:
        if self.config.aspect_dim is not None:
            return self.config.aspect_dim
        # The reference keys on '"ICEWS" in dataset': d//2 there, d//3 for YAGO-WIKI. ICEWS is the data set whose
        # time id 0 is a real day rather than "unknown".
        return self.config.dim // 2 if pair.detected_unknown_time_id is None else self.config.dim // 3

    def candidate_search(self, n_test: int) -> str:
        """``"exact"`` or ``"faiss"``: the search a run over ``n_test`` test pairs uses (see
        `LightTEAConfig.candidate_search`). ``"auto"`` takes faiss from ``faiss_min_rows`` on when it imports."""
        cfg = self.config
        if cfg.reference_compat or cfg.candidate_search == "exact":
            return "exact"
        if cfg.candidate_search == "faiss":
            if not faiss_available():
                raise ImportError("LightTEAConfig.candidate_search='faiss' but faiss is not installed: pip install "
                                  "'hf-scale-plugins[scale]' (or faiss-cpu), or use candidate_search='auto'.")
            return "faiss"
        if n_test < cfg.faiss_min_rows:
            return "exact"
        if not faiss_available():
            logger.warning("%d test pairs: above faiss_min_rows=%d the faiss search would be used, but faiss is not "
                           "installed (pip install 'hf-scale-plugins[scale]'); using the exact PyTorch search.",
                           n_test, cfg.faiss_min_rows)
            return "exact"
        return "faiss"

    def feature_dtype(self, aspect_dim: int, num_entities: int) -> torch.dtype:
        """Storage dtype of the features (see `LightTEAConfig.feature_dtype`). ``auto`` halves them only where they
        are large (`FP16_FEATURES_MIN_BYTES` of fp32 per feature matrix): the widening and rounding cost time on every
        pass, which small runs, far from any memory limit, should not pay."""
        cfg = self.config
        if cfg.reference_compat or cfg.feature_dtype == "float32":
            return torch.float32
        if cfg.feature_dtype == "float16":
            return torch.float16
        width = aspect_dim * cfg.mini_dim * (2 if cfg.fusion == "concat" else 1)
        subspace = cfg.candidate_dim is not None and cfg.candidate_dim < width
        large = num_entities * width * 4 >= FP16_FEATURES_MIN_BYTES
        return torch.float16 if subspace and large else torch.float32

    def unknown_time_id(self, pair: TKGPair) -> int | None:
        if self.config.reference_compat:
            return 0  # the reference drops time 0 everywhere, also ICEWS's first day
        if self.config.unknown_time_id is not None:
            return self.config.unknown_time_id
        return pair.detected_unknown_time_id

    # --------------------------------------------------------------------------------------------------------
    def fit(self, pair: TKGPair, progress: bool = False) -> AlignmentResult:
        """Align the test pairs of ``pair``; returns per-round metrics, pseudo seeds, predictions and timings."""
        reuse = self.config.reuse_freed_memory
        if reuse and pair.num_entities > self.config.reuse_freed_memory_max_entities:
            logger.info("%d entities > reuse_freed_memory_max_entities=%d: freed memory goes back to the OS at once",
                        pair.num_entities, self.config.reuse_freed_memory_max_entities)
            reuse = False
        with reuse_freed_memory(reuse) as active:
            self._kept_bytes = int(self.config.kept_memory_gb * 2**30) if active else None
            try:
                return self._fit(pair, progress)
            finally:
                self._kept_bytes = None

    def _fit(self, pair: TKGPair, progress: bool) -> AlignmentResult:
        cfg = self.config
        self.timings = defaultdict(float)
        device = self.resolve_device()
        compat = cfg.reference_compat
        aspect_dim = self.aspect_dim(pair)
        low = torch.float32 if compat else matmul_dtype(cfg.matmul_precision, device)
        low_search = torch.float32 if compat else search_dtype(cfg.matmul_precision, device)
        # fp32 products read their operands from fp16 storage: half the memory and the bytes (`triple_operands`)
        operand = torch.float16 if low == torch.float32 and not compat else low
        store = self.feature_dtype(aspect_dim, pair.num_entities)
        fold_in_place = cfg.fusion == "sum" and store != torch.float32
        bar = self._bar = _progress(progress, cfg.rounds)
        self._round = 0

        with self._stage("graph", device):
            graph = build_graph(pair).to(device)
            counts = time_counts(pair, self.unknown_time_id(pair), relation_id_quirk=compat).to(device)
        test = torch.from_numpy(pair.test).to(device)
        test_left, test_right = test[:, 0], test[:, 1]
        n_test = len(test)
        search_kind = self.candidate_search(n_test)
        rows = torch.cat([test_left, test_right])
        with self._stage("graph", device):
            # which tuples feed which output row depends on the graph only: laid out once for all rounds
            layouts = [triple_layout(graph, a, rows) for a in (graph.relation, graph.time)]
            # The propagation products run on CSR copies, converted once rather than in every round. The COO
            # originals go: from here on only the CSR copies and the layouts (which hold the selected tuples'
            # aspect nodes) are read, and the graph's matrices are the largest structures that live through a run.
            a_ee = csr(graph.entity_entity)
            spread = [_propagation_only(a) for a in (graph.relation, graph.time)]
            graph = dataclasses.replace(graph, relation=spread[0], time=spread[1])
            aspects = list(zip(spread, layouts))
        with self._stage("temporal_similarity", device):
            simt = TemporalSimilarity(counts, test_right)
        train = torch.from_numpy(pair.seeds).to(device)
        open_left = torch.ones(n_test, dtype=torch.bool, device=device)  # Cx (by test position)
        open_right = torch.ones(n_test, dtype=torch.bool, device=device)  # Cy
        top_k = cfg.top_k
        rounds: list[RoundMetrics] = []
        pseudo_all: list[np.ndarray] = []
        predicted = scores = None
        for rnd in range(1, cfg.rounds + 1):
            t_round = time.perf_counter()
            self._round = rnd
            # Both aspects' operands first, then their sums: an aspect's operands (its tail rows of E_bar, in the
            # product dtype) are smaller than its features, so the second aspect's E_bar, the largest matrix of a
            # round, never lives next to the first aspect's features.
            operands = []
            for a, (aspect, layout) in enumerate(aspects):
                with self._stage("label_propagation", device):
                    e0 = SeedLabels.draw(graph.num_entities, train.cpu(), cfg.dim,
                                         _stream(cfg.seed, rnd, 2 * a)).to(device)
                    prop = propagate_labels(a_ee, spread[a], e0, cfg.lp_steps)
                with self._stage("triple_view", device):
                    operands.append(triple_operands(graph, aspect, prop, prop.x_cat, aspect_dim, cfg.mini_dim,
                                                    _stream(cfg.seed, rnd, 2 * a + 1), rows, label_dim=cfg.dim,
                                                    matmul_dtype=low, operand_dtype=operand, layout=layout,
                                                    first_hop=None if compat else (graph.entity_entity, e0)))
                    del e0, prop  # the sums read only the gathered tail rows
            feats = []
            for a in range(len(operands)):
                with self._stage("triple_view", device):
                    ops, operands[a] = operands[a], None
                    # Large (narrow-stored) runs add the second aspect into the first as it is summed, so the two
                    # feature matrices are never held at once (one more pass over the tuples instead).
                    fold = a == 1 and fold_in_place and feats[0].dtype == store  # (not if kept in fp32)
                    if not (fold and triple_sums_into(ops, feats[0], 1 - cfg.alpha, cfg.alpha)):
                        feats.append(triple_sums(ops, out_dtype=store))
                    del ops
                if cfg.fusion == "sum" and len(feats) == 2:  # fold the second aspect in at once: one matrix left
                    with self._stage("fusion", device):
                        feats = [feats[0].mul_(1 - cfg.alpha).add_(feats[1], alpha=cfg.alpha)]
            with self._stage("fusion", device):
                if cfg.fusion == "sum":
                    fused = feats[0]  # already weighted and summed above
                else:
                    fused = torch.cat([feats[0].mul_(1 - cfg.alpha), feats[1].mul_(cfg.alpha)], dim=1)
                del feats
                fused = l2n_(fused)  # row-wise, so the same as normalising each side
                left, right = fused[:n_test], fused[n_test:]
            last = rnd == cfg.rounds
            with self._stage("similarity_topk", device):
                # Entities without any fact have all-zero features: no candidate can be told apart for them, so
                # (featureless_rows="exclude") they are searched for nobody and kept out of Sinkhorn.
                if compat or cfg.featureless_rows == "include":
                    active = has_facts = None
                    k_eval = min(top_k, n_test)
                    masked_k = min(top_k, int(open_right.sum()))
                else:
                    active, has_facts = nonzero_rows(left), nonzero_rows(right)
                    k_eval = min(top_k, int(has_facts.sum()))
                    masked_k = min(top_k, int((open_right & has_facts).sum()))
                # While nothing is masked (round 1) the pseudo-seed search is the evaluation search itself.
                unmasked = bool(open_left.all()) and bool(open_right.all()) and masked_k == k_eval
                subspace = not compat and cfg.candidate_dim is not None and cfg.candidate_dim < left.shape[1]
                stream = _stream(cfg.seed, rnd, 4)

                def search(lhs, rhs, k, masked_rows, allowed_cols, mk, subspace=subspace, stream=stream):
                    if search_kind == "faiss":  # faiss scans fp32: only its basis/projections take `low`
                        return ivf_topk(lhs, rhs, k, cfg.block_rows, cfg.candidate_dim if subspace else None,
                                        cfg.rescore_top if subspace else 0, stream, masked_rows, allowed_cols, mk,
                                        matmul_dtype=low if subspace else None, nlist=cfg.faiss_nlist,
                                        nprobe=cfg.faiss_nprobe)
                    # int32 candidate columns while the features are alive (`_FoundRows.widen` makes them int64)
                    if not subspace:
                        return blocked_topk(lhs, rhs, k, cfg.block_rows, masked_rows, allowed_cols, mk,
                                            index_dtype=torch.int32)
                    return lowrank_topk(lhs, rhs, k, cfg.block_rows, cfg.candidate_dim, cfg.rescore_top, stream,
                                        masked_rows, allowed_cols, mk, matmul_dtype=low_search,
                                        index_dtype=torch.int32)

                check_after = bool(cfg.candidate_check_rows) and (subspace or search_kind == "faiss")
                found = _search_rows_with_facts(
                    search, left, right, k_eval, None if last or unmasked else open_left,
                    None if last or unmasked else open_right, masked_k, active, has_facts,
                    features=None if check_after else fused)
                if not check_after:
                    # not read again: the features go before the candidates are widened to all rows, the largest
                    # allocations of the search at scale
                    del left, right, fused
                full, masked = found.widen()
                del found
                if unmasked and not last:
                    masked = full
            check = None
            if check_after:
                with self._stage("candidate_check", device):
                    pick = torch.randperm(n_test, generator=torch.Generator().manual_seed(cfg.seed + rnd)).to(device)
                    if active is not None:  # rows without facts have placeholder candidates, nothing to check
                        pick = pick[active[pick]]
                    check = candidate_recall(left, right, full, pick[: cfg.candidate_check_rows], has_facts)
                del left, right, fused
            with self._stage("temporal_similarity", device):
                sims = self._with_time(full.values, simt(test_left, full.index))
            with self._stage("sinkhorn", device):
                m = sparse_sinkhorn(sims, full.index, n_test, cfg.sinkhorn_temperature, cfg.sinkhorn_iterations,
                                    active)
            with self._stage("evaluation", device):
                h1, h10, mrr = _evaluate(m, full.index, cfg.tie_break, _stream(cfg.seed, rnd, 5))
                best = m.argmax(dim=1)
                predicted = test_right[full.index.gather(1, best[:, None])[:, 0]]
                scores = m.gather(1, best[:, None])[:, 0]
            metrics = RoundMetrics(rnd, h1, h10, mrr, num_train_pairs=len(train), candidate_recall=check)
            if not last:
                with self._stage("pseudo_seeds", device):
                    new = self._pseudo_seeds(masked, open_left, open_right, test_left, test_right, simt, active,
                                             round1=bool(open_left.all()))
                if compat:
                    top_k = min(top_k, int(open_left.sum()))  # the reference shrinks top_k for good
                if len(new):
                    open_left[new[:, 2]] = False
                    open_right[new[:, 3]] = False
                    correct = (test_right[new[:, 2]] == new[:, 1]).float().mean().item()
                    train = torch.cat([train, new[:, :2]])
                    pseudo_all.append(new[:, :2].cpu().numpy())
                    metrics.pseudo_seeds_added, metrics.pseudo_seed_precision = len(new), correct
            del full, masked, sims, m, best  # round-sized results not needed any more: free before the next round
            metrics.seconds = time.perf_counter() - t_round
            rounds.append(metrics)
            logger.info("round %d: H@1 %.4f H@10 %.4f MRR %.4f (+%d pseudo seeds)", rnd, h1, h10, mrr,
                        metrics.pseudo_seeds_added)
            if bar is not None:
                bar.set_postfix({"H@1": f"{h1:.3f}", "pseudo": metrics.pseudo_seeds_added})
                bar.update(1)
            if not last and metrics.pseudo_seeds_added == 0:
                break
        if bar is not None:
            bar.close()
            self._bar = None
        return AlignmentResult(
            rounds=rounds,
            predicted=torch.stack([test_left, predicted], dim=1).cpu().numpy(),
            scores=scores.float().cpu().numpy(),
            truth=pair.test.copy(),
            pseudo_seeds=np.concatenate(pseudo_all) if pseudo_all else np.zeros((0, 2), dtype=np.int64),
            timings={k: round(v, 4) for k, v in self.timings.items()},
            config=cfg.to_dict() | {"aspect_dim_used": aspect_dim, "candidate_search_used": search_kind,
                                    "feature_dtype_used": str(store).removeprefix("torch."),
                                    "unknown_time_id_used": self.unknown_time_id(pair)},
            device=str(device),
            data_summary=pair.summary(),
        )

    # --------------------------------------------------------------------------------------------------------
    def _with_time(self, structural: torch.Tensor, temporal: torch.Tensor) -> torch.Tensor:
        beta = self.config.beta
        return (1 - beta) * structural + beta * temporal if beta > 0 else structural

    def _pseudo_seeds(self, masked, open_left, open_right, test_left, test_right, simt, active, round1: bool):
        """New pseudo seeds as rows (source, target, source test position, target test position).

        A source qualifies when its best Sinkhorn score exceeds the threshold; the result is one-to-one."""
        cfg = self.config
        left_pos = torch.nonzero(open_left)[:, 0]
        cand = masked.index
        if cfg.reference_compat and round1:
            # Reference bug: in round 1 the dense simt (test-pair order) is indexed with positions in sorted-id
            # order, so the time term of row i / column j comes from test pair i / j instead of the entity itself.
            rank_left = torch.argsort(torch.argsort(test_left))
            rank_right = torch.argsort(torch.argsort(test_right))
            temporal = simt(test_left[rank_left[left_pos]], rank_right[cand])
        else:
            temporal = simt(test_left[left_pos], cand)
        sims = self._with_time(masked.values, temporal)
        m = sparse_sinkhorn(sims, cand, len(test_right), cfg.sinkhorn_temperature, cfg.sinkhorn_iterations,
                            None if active is None else active[left_pos])
        best_score, best = m.max(dim=1)
        chosen = torch.nonzero(best_score > cfg.pseudo_seed_threshold)[:, 0]
        target_pos = cand[chosen, best[chosen]]
        # Column sums are 1 after the last Sinkhorn step, so with a threshold > 0.5 no column is chosen twice;
        # for lower thresholds keep the highest-scoring row of each column.
        order = torch.argsort(best_score[chosen], descending=True)
        chosen, target_pos = chosen[order], target_pos[order]
        uniq, first = _first_occurrence(target_pos)
        chosen, target_pos = chosen[first], target_pos[first]
        src_pos = left_pos[chosen]
        return torch.stack([test_left[src_pos], test_right[target_pos], src_pos, target_pos], dim=1)


def _propagation_only(a: AspectGraph) -> AspectGraph:
    """``a`` with CSR copies of the two propagation matrices and an empty ``tuple_x`` (a `TripleLayout` of the same
    aspect holds the rows of it the triple view reads)."""
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long, device=a.tuple_x.device),
                                    torch.zeros(0, dtype=a.tuple_x.dtype, device=a.tuple_x.device),
                                    (0, a.tuple_x.shape[1]), check_invariants=False)
    return AspectGraph(a.num_nodes, csr(a.x_from_head), csr(a.x_to_tail), empty)


@dataclass
class _FoundRows:
    """The candidates of the rows with features (`_search_rows_with_facts`), before they are spread over all rows."""

    full: TopK | None
    masked: TopK | None
    active: torch.Tensor | None = None  # None: the search ran over all rows and columns, nothing to widen
    cols: torch.Tensor | None = None
    masked_rows: torch.Tensor | None = None
    num_rows: int = 0
    num_cols: int = 0

    def widen(self) -> tuple[TopK, TopK | None]:
        """``(full, masked)`` over all rows, with int64 indices (the search may return int32 ones); each searched
        result is dropped as soon as its widened copy exists."""
        full, masked, self.full, self.masked = self.full, self.masked, None, None
        if self.active is None:
            return _long_index(full), (None if masked is None else _long_index(masked))
        device = self.active.device
        full = _widen(full, self.active, torch.arange(self.num_rows, device=device), self.cols, self.num_cols)
        if masked is not None:
            open_rows = torch.nonzero(self.masked_rows)[:, 0]
            masked = _widen(masked, self.active[open_rows], open_rows, self.cols, self.num_cols)
        return full, masked


def _search_rows_with_facts(search, left, right, k, masked_rows, allowed_cols, masked_k, active, has_facts,
                            features: torch.Tensor | None = None) -> _FoundRows:
    """``search(left, right, k, masked_rows, allowed_cols, masked_k)`` over the rows and columns with features only.

    Rows without features (``~active``) get ``k`` placeholder candidates that never include their own truth (they
    are kept out of Sinkhorn and count as misses); columns without features are nobody's candidate. The result is
    widened to all rows by `_FoundRows.widen`, which the caller runs once it has freed what it no longer reads.

    ``features``, when given, is the matrix whose first and last rows ``left`` and ``right`` are, and the caller
    reads neither after this call: the rows with features are then moved to its front in place (`_compact_rows_`)
    instead of copied out, which at scale is nearly a second copy of all features during the search.
    """
    if active is None or (bool(active.all()) and bool(has_facts.all())):
        return _FoundRows(*search(left, right, k, masked_rows, allowed_cols, masked_k))
    rows, cols = torch.nonzero(active)[:, 0], torch.nonzero(has_facts)[:, 0]
    if features is None:
        lhs, rhs = left[rows], right[cols]
    else:
        lhs, rhs = _compact_rows_(features, torch.cat([rows, cols + len(left)]), len(rows))
    sub_full, sub_masked = search(lhs, rhs, k, None if masked_rows is None else masked_rows[rows],
                                  None if allowed_cols is None else allowed_cols[cols], masked_k)
    return _FoundRows(sub_full, sub_masked, active, cols, masked_rows, len(left), len(right))


def _widen(sub: TopK, keep: torch.Tensor, out_rows: torch.Tensor, cols: torch.Tensor, num_cols: int,
           chunk: int = 16384) -> TopK:
    """The candidates ``sub`` of the kept rows (bool ``keep`` over ``out_rows``), in columns ``cols``, spread back
    over all of ``out_rows``: the other rows get placeholder columns ``i+1, i+2, ...`` (mod ``num_cols``), valid
    positions that are never row ``i``'s own truth (column ``i``), with value 0."""
    width = sub.index.shape[1]
    steps = 1 + torch.arange(width, device=out_rows.device)[None, :]
    index = torch.empty(len(out_rows), width, dtype=torch.long, device=out_rows.device)
    values = torch.zeros(len(out_rows), width, dtype=sub.values.dtype, device=out_rows.device)
    sub_pos = torch.cumsum(keep, 0) - 1  # the row of `sub` that holds each kept row
    # a block of rows at a time: full-height temporaries would be as large as the result
    for r0 in range(0, len(out_rows), chunk):
        r1 = min(r0 + chunk, len(out_rows))
        torch.remainder(out_rows[r0:r1, None] + steps, num_cols, out=index[r0:r1])
        kept = r0 + torch.nonzero(keep[r0:r1])[:, 0]
        if len(kept):
            src = sub_pos[kept]
            index[kept] = cols[sub.index[src]]
            values[kept] = sub.values[src]
    return TopK(values, index)


def _long_index(found: TopK) -> TopK:
    return found if found.index.dtype == torch.long else TopK(found.values, found.index.long())


def _compact_rows_(x: torch.Tensor, rows: torch.Tensor, split: int,
                   chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves ``x[rows]`` (``rows`` ascending) to the first ``len(rows)`` rows of ``x``, in place, and returns them as
    ``(first split rows, the rest)``; ``x``'s other rows are left undefined.

    Row ``rows[i] >= i`` goes to row ``i``, in ascending order and ``chunk`` rows at a time: every chunk is read
    before it is written, and a later chunk's rows lie beyond the rows written so far, so nothing is read after it
    was overwritten.
    """
    for r0 in range(0, len(rows), chunk):
        part = rows[r0:r0 + chunk]
        x[r0:r0 + len(part)] = x.index_select(0, part)
    return x[:split], x[split:len(rows)]


def _stream(seed: int, round_: int, purpose: int) -> torch.Generator:
    """An independent random stream per (seed, round, purpose).

    One generator for the whole run would make every later draw depend on how many numbers earlier draws took, so a
    single extra pseudo seed would change all labels and projections that follow. Separate streams keep the effect
    of a small change small: with one more seed pair, only that pair's label is new.
    """
    state = np.random.SeedSequence([seed, round_, purpose]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)  # < 2**63


def _first_occurrence(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    uniq, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((len(uniq),), len(values), dtype=torch.long, device=values.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(values), device=values.device), reduce="amin")
    return uniq, torch.sort(first).values


def _evaluate(m: torch.Tensor, index: torch.Tensor, tie_break: str, gen: torch.Generator):
    """H@1, H@10, MRR with the truth of row i in column i; a truth outside the k candidates is a miss."""
    n = m.shape[0]
    truth = torch.arange(n, device=index.device)[:, None]
    is_truth = index == truth
    found = is_truth.any(dim=1)
    pos = is_truth.float().argmax(dim=1)
    s_true = m.gather(1, pos[:, None])
    greater = (m > s_true).sum(dim=1)
    equal = (m == s_true).sum(dim=1) - 1
    if tie_break == "random":
        u = torch.rand(n, generator=gen).to(m.device)
        ties = torch.floor(u * (equal + 1).float()).long()
    else:  # the earlier candidate wins, as with the reference's argsort
        col = torch.arange(m.shape[1], device=m.device)[None, :]
        ties = ((m == s_true) & (col < pos[:, None])).sum(dim=1)
    rank = (1 + greater + ties).float()
    rr = torch.where(found, 1.0 / rank, torch.zeros_like(rank))
    h1 = (found & (rank <= 1)).float().mean().item()
    h10 = (found & (rank <= 10)).float().mean().item()
    return h1, h10, rr.mean().item()


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, desc="LightTEA rounds", unit="round")
