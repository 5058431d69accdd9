"""tea_pipeline fast paths against the straightforward computations they replace, on small generated data.

* the CSR triple view with the seed-label shortcut equals the plain tuple loop;
* the subspace candidate search equals the exact top-k when the subspace holds the data or covers the full width,
  and its re-scored candidates carry exact scores;
* the engine's fast default and its exact search both align the synthetic pair and reproduce with one seed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tea_pipeline import LightTEA, LightTEAConfig, build_graph, l2n, make_synthetic_pair, propagate, triple_view
from tea_pipeline.similarity import (
    TopK,
    blocked_topk,
    candidate_recall,
    exact_scores,
    lowrank_topk,
    principal_basis,
    rescore_topk,
)

FAST = {"dim": 96, "top_k": 40, "aspect_dim": 8, "mini_dim": 4}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_pair():
    return make_synthetic_pair(num_entities=300, num_times=25, seed=3)


def _loop_triple_view(g, aspect, e_bar, x_cat, aspect_dim, mini_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = l2n(torch.randn(e_bar.shape[1], aspect_dim, generator=gen))
    proj = l2n(torch.randn(aspect_dim, e_bar.shape[1], mini_dim, generator=gen))
    w = aspect.tuple_x.to_dense() @ (x_cat @ q)
    # every tuple (h, t) adds W[(h,t), j] * (E_bar[t] @ P_j) to F_j[h]
    per_tuple = torch.einsum("qd,jdm->qjm", e_bar[g.tuple_tail], proj) * w[:, :, None]
    want = torch.zeros(g.num_entities, aspect_dim, mini_dim).index_add_(0, g.tuple_head, per_tuple)
    return l2n(want.reshape(g.num_entities, -1))


@pytest.mark.parametrize("use_rows", [True, False])
def test_triple_view_seed_label_shortcut_equals_plain_loop(small_pair, use_rows: bool) -> None:
    g = build_graph(small_pair)
    label_dim = 8
    gen = torch.Generator().manual_seed(5)
    e0 = torch.zeros(g.num_entities, label_dim)
    e0[torch.from_numpy(small_pair.seeds).flatten()] = torch.randn(2 * small_pair.num_seeds, label_dim, generator=gen)
    e_bar, x_cat = propagate(g.entity_entity, g.relation, l2n(e0), steps=2)
    # the seed labels are zero outside the seeds, so the shortcut path is taken
    assert (e_bar[:, :label_dim].abs().amax(dim=1) > 0).float().mean() < 0.75
    rows = torch.from_numpy(small_pair.test[:, ::-1].T.reshape(-1).copy()) if use_rows else None
    want = _loop_triple_view(g, g.relation, e_bar, x_cat, 5, 4, seed=9)
    want = want[rows] if use_rows else want
    for block, ld in ((2, label_dim), (16, label_dim), (3, None)):
        got = triple_view(g, g.relation, e_bar, x_cat, aspect_dim=5, mini_dim=4,
                          generator=torch.Generator().manual_seed(9), rows=rows, block=block, label_dim=ld)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _low_rank_features(n_left: int, n_right: int, dim: int, rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, dim, generator=gen)
    left = l2n(torch.randn(n_left, rank, generator=gen) @ mix)
    right = l2n(torch.randn(n_right, rank, generator=gen) @ mix)
    return left.double(), right.double()


def test_principal_basis_is_orthonormal_and_spans_low_rank_data() -> None:
    left, right = _low_rank_features(50, 60, dim=40, rank=6, seed=0)
    basis = principal_basis(left, right, 6, torch.Generator().manual_seed(1), sample_rows=30)
    assert basis.shape == (40, 6)
    torch.testing.assert_close(basis.T @ basis, torch.eye(6, dtype=basis.dtype), atol=1e-8, rtol=0)
    torch.testing.assert_close(left @ basis @ basis.T, left, atol=1e-6, rtol=0)
    torch.testing.assert_close(right @ basis @ basis.T, right, atol=1e-6, rtol=0)
    assert torch.equal(principal_basis(left, right, 40, torch.Generator()), torch.eye(40, dtype=left.dtype))


@pytest.mark.parametrize("rank,rescore", [(6, 0), (6, 3), (48, 7), (10, 100)])
def test_lowrank_topk_equals_exact_topk_when_the_subspace_covers_the_data(rank: int, rescore: int) -> None:
    left, right = _low_rank_features(37, 29, dim=48, rank=6, seed=2)
    gen = torch.Generator().manual_seed(1)
    rows = torch.rand(37, generator=gen) < 0.5
    cols = torch.rand(29, generator=gen) < 0.6
    want, want_masked = blocked_topk(left, right, 7, 5, masked_rows=rows, allowed_cols=cols, masked_k=4)
    got, got_masked = lowrank_topk(left, right, 7, 5, rank, rescore, torch.Generator().manual_seed(3),
                                   masked_rows=rows, allowed_cols=cols, masked_k=4)
    for g, w in ((got, want), (got_masked, want_masked)):
        assert torch.equal(g.index, w.index)
        torch.testing.assert_close(g.values, w.values, atol=1e-9, rtol=0)
    assert candidate_recall(left, right, got, torch.arange(37)) == {"recall": 1.0, "top1": 1.0, "same_set": 1.0,
                                                                    "rows": 37}


def test_rescored_candidates_carry_exact_scores_and_stay_sorted() -> None:
    gen = torch.Generator().manual_seed(4)
    left, right = l2n(torch.randn(23, 32, generator=gen)), l2n(torch.randn(40, 32, generator=gen))
    found, _ = lowrank_topk(left, right, 9, 8, rank=4, rescore=9, generator=torch.Generator().manual_seed(0))
    exact = left @ right.T
    torch.testing.assert_close(found.values, exact.gather(1, found.index))
    assert torch.all(found.values[:, :-1] >= found.values[:, 1:])
    # the candidate sets of a 4-dim subspace of random 32-dim data are not the exact ones: recall says so
    stats = candidate_recall(left, right, found, torch.arange(23))
    assert 0.0 < stats["recall"] < 1.0 and stats["rows"] == 23
    # partial re-scoring: leading scores exact, the rest from the subspace, rows re-sorted
    approx = TopK(torch.sort(torch.rand(5, 6, generator=gen), dim=1, descending=True).values,
                  torch.stack([torch.randperm(40, generator=gen)[:6] for _ in range(5)]))
    part = rescore_topk(left, right, approx, 2, rows=torch.arange(5) * 3)
    for i in range(5):
        got = dict(zip(part.index[i].tolist(), part.values[i].tolist()))
        for c in range(6):
            col = int(approx.index[i, c])
            want = float(exact[3 * i, col]) if c < 2 else float(approx.values[i, c])
            assert got[col] == pytest.approx(want, abs=1e-6)
    assert torch.equal(exact_scores(left, right, approx.index, torch.arange(5) * 3, chunk=2),
                       exact_scores(left, right, approx.index, torch.arange(5) * 3, chunk=64))


def test_engine_fast_and_exact_search_align_and_reproduce(small_pair) -> None:
    cfg = dict(FAST, candidate_dim=16, rescore_top=8, candidate_check_rows=50, seed=4)
    runs = [LightTEA(LightTEAConfig(**cfg)).fit(small_pair) for _ in range(2)]
    assert [r.as_dict() | {"seconds": 0} for r in runs[0].rounds] == \
           [r.as_dict() | {"seconds": 0} for r in runs[1].rounds]
    assert np.array_equal(runs[0].predicted, runs[1].predicted)
    check = runs[0].rounds[0].candidate_recall
    assert check is not None and check["rows"] == 50 and 0.0 < check["recall"] <= 1.0
    exact = LightTEA(LightTEAConfig(**dict(cfg, candidate_dim=None))).fit(small_pair)
    assert exact.rounds[0].candidate_recall is None
    wide = LightTEA(LightTEAConfig(**dict(cfg, candidate_dim=10_000))).fit(small_pair)
    assert [r.as_dict() for r in exact.rounds] == [r.as_dict() | {"seconds": r2.seconds}
                                                   for r, r2 in zip(wide.rounds, exact.rounds)]
    assert runs[0].final["hits@1"] > 0.7 * exact.final["hits@1"]


def test_synthetic_pair_with_default_subspace_search() -> None:
    pair = make_synthetic_pair(num_entities=800, seed=0)
    result = LightTEA(LightTEAConfig(dim=128, top_k=50, candidate_dim=64)).fit(pair)
    assert result.final["hits@1"] >= 0.9, result.to_dict()


@pytest.mark.parametrize("bad,field", [({"candidate_dim": 0}, "candidate_dim"), ({"rescore_top": -1}, "rescore_top"),
                                       ({"candidate_check_rows": 1.5}, "candidate_check_rows")])
def test_new_config_errors_name_the_field(bad, field) -> None:
    with pytest.raises(ValueError, match=field):
        LightTEAConfig(**bad)
