"""The sparse graph views LightTEA propagates labels over, built once per TKG pair (reference: ``utils.load_graph``).

Legend: N entities, X aspect nodes (2R relations incl. inverses, or T time ids), Q distinct (head, tail) tuples.
Every fact ``(h, r, t, times)`` becomes the quadruples ``(h, t, 2r, tau)`` and ``(t, h, 2r+1, tau)`` for each of its
time stamps (one in ICEWS; begin and end in YAGO-WIKI, both kept even when equal or unknown), deduplicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .data import TKGPair


@dataclass
class AspectGraph:
    """One aspect (relational or temporal) of the three views.

    ``x_from_head`` (X x N): 1 where aspect node x has head e; ``x_to_tail`` (N x X): 1 where e is the tail of a
    quadruple with x; ``tuple_x`` (Q x X): 1 where tuple (h, t) carries x (binary even if x occurs several times).
    """

    num_nodes: int
    x_from_head: torch.Tensor
    x_to_tail: torch.Tensor
    tuple_x: torch.Tensor


@dataclass
class TKGGraph:
    num_entities: int
    entity_entity: torch.Tensor  # N x N sparse: diagonal = 2 deg(e), (h, t) = distinct quadruples h -> t
    tuple_head: torch.Tensor  # Q, sorted by (head, tail)
    tuple_tail: torch.Tensor  # Q
    relation: AspectGraph
    time: AspectGraph
    num_quadruples: int

    def to(self, device: torch.device) -> TKGGraph:
        def asp(a: AspectGraph) -> AspectGraph:
            return AspectGraph(a.num_nodes, a.x_from_head.to(device), a.x_to_tail.to(device), a.tuple_x.to(device))

        return TKGGraph(self.num_entities, self.entity_entity.to(device), self.tuple_head.to(device),
                        self.tuple_tail.to(device), asp(self.relation), asp(self.time), self.num_quadruples)


def fact_times(facts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fact index, time id) for every time stamp of every fact, not deduplicated (time_end = -1 means none)."""
    idx = np.arange(len(facts))
    has_end = facts[:, 5] >= 0
    fi = np.concatenate([idx, idx[has_end]])
    tau = np.concatenate([facts[:, 4], facts[has_end, 5]])
    order = np.argsort(fi, kind="stable")
    return fi[order], tau[order]


def build_graph(pair: TKGPair) -> TKGGraph:
    """All sparse matrices of the relational and temporal aspects (float32 coalesced COO, on CPU)."""
    n = pair.num_entities
    num_rel = 2 * pair.num_relations
    num_times = pair.num_times
    fi, tau = fact_times(pair.facts)
    h, r, t = pair.facts[fi, 1], pair.facts[fi, 2], pair.facts[fi, 3]
    qh = np.concatenate([h, t])
    qt = np.concatenate([t, h])
    qr = np.concatenate([2 * r, 2 * r + 1])
    qtau = np.concatenate([tau, tau])
    key = ((qh * n + qt) * num_rel + qr) * num_times + qtau
    key = sorted_unique(key)  # sorted by (head, tail, rel, time), like the reference
    qtau = key % num_times
    rest = key // num_times
    qr = rest % num_rel
    rest //= num_rel
    qt = rest % n
    qh = rest // n

    # entity-entity view: self loop carries the head and tail counts; off-diagonal counts distinct quadruples
    diag = np.bincount(qh, minlength=n) + np.bincount(qt, minlength=n)
    off = qh != qt
    ht_key, ht_count = sorted_unique(qh[off] * n + qt[off], return_counts=True)
    rows = np.concatenate([np.arange(n), ht_key // n])
    cols = np.concatenate([np.arange(n), ht_key % n])
    vals = np.concatenate([diag, ht_count]).astype(np.float32)
    a_ee = _sparse(rows, cols, vals, (n, n))

    tuple_key, tuple_of_quad = sorted_unique(qh * n + qt, return_inverse=True)
    num_tuples = len(tuple_key)

    def aspect(x: np.ndarray, num_x: int) -> AspectGraph:
        return AspectGraph(
            num_nodes=num_x,
            x_from_head=_binary(x, qh, (num_x, n)),
            x_to_tail=_binary(qt, x, (n, num_x)),
            tuple_x=_binary(tuple_of_quad, x, (num_tuples, num_x)),
        )

    return TKGGraph(
        num_entities=n,
        entity_entity=a_ee,
        tuple_head=torch.from_numpy(tuple_key // n),
        tuple_tail=torch.from_numpy(tuple_key % n),
        relation=aspect(qr, num_rel),
        time=aspect(qtau, num_times),
        num_quadruples=len(key),
    )


def time_counts(pair: TKGPair, unknown_time_id: int | None, relation_id_quirk: bool = False) -> torch.Tensor:
    """N x T sparse multiset counts: how often entity e carries time id tau over its facts (reference ``cal_simt``).

    Every fact adds each of its time stamps (not deduplicated) to both endpoints; ``unknown_time_id`` is left out.
    ``relation_id_quirk`` reproduces the reference bug that also adds them to the entities whose ids equal the
    relation ids 2r and 2r+1.
    """
    n, num_times = pair.num_entities, pair.num_times
    fi, tau = fact_times(pair.facts)
    keep = tau != unknown_time_id if unknown_time_id is not None else np.ones(len(tau), dtype=bool)
    fi, tau = fi[keep], tau[keep]
    ents = [pair.facts[fi, 1], pair.facts[fi, 3]]
    if relation_id_quirk:
        r = pair.facts[fi, 2]
        ents += [np.where(2 * r < n, 2 * r, -1), np.where(2 * r + 1 < n, 2 * r + 1, -1)]
    e = np.concatenate(ents)
    tt = np.concatenate([tau] * len(ents))
    ok = e >= 0
    key, count = sorted_unique(e[ok] * num_times + tt[ok], return_counts=True)
    return _sparse(key // num_times, key % num_times, count.astype(np.float32), (n, num_times))


def sorted_unique(keys: np.ndarray, return_counts: bool = False, return_inverse: bool = False):
    """``np.unique`` for integer keys by one sort. NumPy >= 2.3's ``np.unique`` hashes first (``_unique_hash``),
    which is slower than a single sort for these int64 keys and dominated the graph build (bench/tea/README.md).
    Same results, same order; one optional extra like np.unique."""
    if return_inverse:
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
    else:
        ordered = np.sort(keys)
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    uniq = ordered[first]
    if return_counts:
        starts = np.flatnonzero(first)
        return uniq, np.diff(np.append(starts, len(ordered)))
    if return_inverse:
        inverse = np.empty(len(keys), dtype=np.intp)
        inverse[order] = np.cumsum(first) - 1
        return uniq, inverse
    return uniq


def _binary(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    key = sorted_unique(rows.astype(np.int64) * shape[1] + cols)
    return _sparse(key // shape[1], key % shape[1], np.ones(len(key), dtype=np.float32), shape)


def _sparse(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    """A coalesced (row-major sorted) COO matrix: torch's CSR layout is still beta and warns on construction."""
    order = np.lexsort((cols, rows))
    idx = np.stack([rows[order], cols[order]]).astype(np.int64)
    return torch.sparse_coo_tensor(torch.from_numpy(idx), torch.from_numpy(np.ascontiguousarray(vals[order])),
                                   size=shape, is_coalesced=True, check_invariants=False)
