"""tea_pipeline's memory-saving paths against the computations they replace, on small generated data.

* `propagate` writing into a preallocated ``E_bar``, in row blocks, equals the list-and-concatenate version;
* the label block kept by its labelled rows (`propagate_labels`) gives the same triple-view operands and sums as the
  dense ``E_bar``, with few labels (sparse label rows) and with many (label block gathered densely), fp32 products
  through the first-hop matrix and bf16 products alike;
* the chunked gathers (`gather_rows`, `nonzero_rows`) equal plain indexing;
* the triple view stored in fp16 equals the fp32 one up to fp16 rounding, and falls back to fp32 where fp16 would
  overflow; the second aspect added into the first as it is summed equals the fold of two stored matrices;
* the featured rows moved to the front of the feature matrix in place equal the copied rows, and a run that moves
  them aligns exactly as one that copies them;
* fp16-stored features are searched and re-scored in fp32 (scores, values), native and PyTorch paths alike;
* a whole run with fp16 features aligns like one with fp32 features, and the config validates the field;
* the faiss search (skipped without faiss) reads fp16 features like fp32 ones.
"""

from __future__ import annotations

import pytest
import torch

import tea_pipeline.ann as ann
import tea_pipeline.engine as engine
from tea_pipeline import LightTEA, LightTEAConfig, build_graph, l2n, make_synthetic_pair, propagate, triple_view
from tea_pipeline.engine import FP16_FEATURES_MIN_BYTES
from tea_pipeline.kernels import gathered_dot
from tea_pipeline.propagation import (
    SeedLabels,
    _csr_columns,
    _product,
    csr,
    first_hop_matrix,
    gather_rows,
    l2n_,
    nonzero_rows,
    propagate_labels,
    row_norms,
    seed_labels,
    triple_operands,
    triple_sums,
    triple_sums_into,
)
from tea_pipeline.similarity import blocked_topk, lowrank_topk, project_rows

FAST = {"dim": 96, "top_k": 40, "aspect_dim": 8, "mini_dim": 4}


pytestmark = pytest.mark.usefixtures("one_thread")


def _propagate_with_concat(a_ee, aspect, e0, steps):
    """The earlier `propagate`: every step kept in a list, concatenated at the end."""
    e, x = e0, torch.zeros(aspect.num_nodes, e0.shape[1])
    es, xs = [e], [x]
    a_ee, x_from_head, x_to_tail = (csr(m) for m in (a_ee, aspect.x_from_head, aspect.x_to_tail))
    for _ in range(steps):
        x_new = l2n_(x_from_head @ e)
        e_new = l2n_((a_ee @ e).add_(x_to_tail @ x))
        e, x = e_new, x_new
        es.append(e)
        xs.append(x)
    return l2n_(torch.cat(es, dim=1)), l2n_(torch.cat(xs, dim=1))


@pytest.mark.parametrize("steps,chunk_rows", [(1, None), (2, None), (3, None), (2, 7), (2, 1)])
def test_preallocated_propagation_equals_concatenation(small_pair, steps: int, chunk_rows: int | None) -> None:
    """Also with the entity product split into blocks of 7 rows, and of 1 row (the default is one block here)."""
    g = build_graph(small_pair)
    e0 = seed_labels(g.num_entities, torch.from_numpy(small_pair.seeds), 24, torch.Generator().manual_seed(0))
    extra = {} if chunk_rows is None else {"chunk_bytes": chunk_rows * 24 * 4}
    for aspect in (g.relation, g.time):
        got = propagate(g.entity_entity, aspect, e0, steps, **extra)
        want = _propagate_with_concat(g.entity_entity, aspect, e0, steps)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_seed_labels_by_rows_equal_the_dense_matrix_in_propagation_and_the_first_hop(small_pair) -> None:
    """`SeedLabels` (E0 by its labelled rows) draws the dense E0's values and gives the same propagation, first-hop
    matrix and triple view; an entity in two seed pairs keeps the later pair's vector, as the dense assignment does."""
    g = build_graph(small_pair)
    seeds = torch.from_numpy(small_pair.seeds)
    seeds = torch.cat([seeds, seeds[:1].flip(1), seeds[3:4]])  # repeated entities, one pair twice
    labels = SeedLabels.draw(g.num_entities, seeds, 16, torch.Generator().manual_seed(3))
    dense = seed_labels(g.num_entities, seeds, 16, torch.Generator().manual_seed(3))
    assert torch.equal(labels.dense(), dense)
    assert torch.equal(labels.rows, torch.nonzero(dense.abs().amax(1) > 0)[:, 0])
    e_bar, x_cat = propagate(g.entity_entity, g.relation, labels, 2)
    e_bar_d, x_cat_d = propagate(g.entity_entity, g.relation, dense, 2)
    assert torch.equal(e_bar, e_bar_d) and torch.equal(x_cat, x_cat_d)
    tails = torch.arange(g.num_entities)
    got = first_hop_matrix(g.entity_entity, labels, tails, row_norms(e_bar[:, 16:32], tails), max_share=1.0)
    want = first_hop_matrix(g.entity_entity, dense, tails, row_norms(e_bar[:, 16:32], tails), max_share=1.0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].to_dense(), want[0].to_dense())
    views = [triple_view(g, g.relation, e_bar, x_cat, 4, 4, torch.Generator().manual_seed(5), label_dim=16,
                         first_hop=(g.entity_entity, e0)) for e0 in (labels, dense)]
    assert torch.equal(views[0], views[1])


def test_csr_columns_equal_dense_column_selection() -> None:
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(13, 17, generator=gen) * (torch.rand(13, 17, generator=gen) < 0.3)
    cols = torch.tensor([0, 3, 4, 9, 16])
    got = _csr_columns(csr(m.to_sparse_coo()), cols)
    assert torch.equal(got.to_dense(), m[:, cols])
    assert _csr_columns(csr(m.to_sparse_coo()), cols[:0]).to_dense().shape == (13, 0)


@pytest.mark.parametrize("share", [0.2, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_labels_by_rows_give_the_operands_and_sums_of_the_dense_e_bar(small_pair, share: float,
                                                                         dtype: torch.dtype) -> None:
    """``share`` of the entities labelled: 0.2 keeps the label rows sparse, 1.0 gathers the label block densely."""
    g = build_graph(small_pair)
    gen = torch.Generator().manual_seed(4)
    n_pairs = max(1, int(share * g.num_entities / 2))
    ids = torch.randperm(g.num_entities, generator=gen)[:2 * n_pairs].view(-1, 2)
    labels = SeedLabels.draw(g.num_entities, ids, 16, gen)
    rows = torch.from_numpy(small_pair.test.reshape(-1))
    prop = propagate_labels(g.entity_entity, g.time, labels, 2)
    dense = prop.dense()
    e_bar, x_cat = propagate(g.entity_entity, g.time, labels, 2)
    assert torch.equal(dense, e_bar) and torch.equal(prop.x_cat, x_cat)
    assert not bool(dense[:, :16].abs().amax(1)[~torch.isin(torch.arange(g.num_entities), labels.rows)].any())
    kw = {"rows": rows, "label_dim": 16, "matmul_dtype": dtype, "first_hop": (g.entity_entity, labels)}
    ops = [triple_operands(g, g.time, e, x_cat, 6, 4, torch.Generator().manual_seed(5), **kw) for e in (prop, dense)]
    for name in ("e_tails", "sparse_rows", "e_labels", "hop_labels", "proj", "xq"):
        a, b = getattr(ops[0], name), getattr(ops[1], name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert ops[0].col0 == ops[1].col0 == (16 if share < 0.5 and dtype != torch.float32 else
                                          32 if share < 0.5 else 0)
    assert torch.equal(triple_sums(ops[0], block=2), triple_sums(ops[1], block=2))


@pytest.mark.parametrize("share", [0.2, 1.0])
def test_fp16_operands_of_fp32_products_equal_fp32_operands_up_to_rounding(small_pair, share: float) -> None:
    """fp16 storage of the gathered rows (what the engine uses with fp32 products): the same operands rounded, the
    same sums up to that rounding, with sparse (0.2) and dense (1.0) label rows and the first-hop matrix."""
    g = build_graph(small_pair)
    gen = torch.Generator().manual_seed(4)
    n_pairs = max(1, int(share * g.num_entities / 2))
    ids = torch.randperm(g.num_entities, generator=gen)[:2 * n_pairs].view(-1, 2)
    labels = SeedLabels.draw(g.num_entities, ids, 16, gen)
    prop = propagate_labels(g.entity_entity, g.time, labels, 2)
    kw = {"rows": torch.from_numpy(small_pair.test.reshape(-1)), "label_dim": 16,
          "first_hop": (g.entity_entity, labels)}
    full, half = (triple_operands(g, g.time, prop, prop.x_cat, 6, 4, torch.Generator().manual_seed(5),
                                  operand_dtype=dt, **kw) for dt in (None, torch.float16))
    assert half.e_tails.dtype == torch.float16 and full.e_tails.dtype == torch.float32
    assert torch.equal(half.e_tails, full.e_tails.half()) and half.col0 == full.col0
    if share < 0.5:
        assert half.hop_matrix is not None and torch.equal(half.e_labels, full.e_labels.half())
    want = triple_sums(full, block=2)
    torch.testing.assert_close(triple_sums(half, block=2), want, rtol=0, atol=2e-3)
    # the chunked widening is the same product as widening all rows at once
    p = torch.randn(half.e_tails.shape[1], 8, generator=gen)
    torch.testing.assert_close(_product(half.e_tails, p, chunk=7), half.e_tails.float() @ p, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="operand_dtype"):
        triple_operands(g, g.time, prop, prop.x_cat, 6, 4, torch.Generator().manual_seed(5),
                        matmul_dtype=torch.bfloat16, operand_dtype=torch.float16, **kw)


def test_chunked_gathers_equal_plain_indexing() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(97, 30, generator=gen)
    x[::7] = 0
    rows = torch.randint(0, 97, (61,), generator=gen)
    for col0, dtype in ((0, None), (12, None), (12, torch.bfloat16), (29, torch.float16)):
        got = gather_rows(x, rows, col0, dtype, chunk=8)
        assert torch.equal(got, x[rows][:, col0:].to(dtype or x.dtype)) and got.is_contiguous()
    assert torch.equal(nonzero_rows(x, chunk=5), x.abs().amax(dim=1) > 0)
    assert torch.equal(nonzero_rows(x, rows, chunk=5), x[rows].abs().amax(dim=1) > 0)


def test_fp16_l2n_normalises_in_fp32() -> None:
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(1)) * 100
    x[3] = 0
    got = l2n_(x.half(), chunk=7)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), l2n(x.half().float()), rtol=0, atol=1e-3)


def _views(pair, seed=0):
    g = build_graph(pair)
    gen = torch.Generator().manual_seed(seed)
    e0 = l2n(torch.randn(g.num_entities, 16, generator=gen))
    e_bar, x_cat = propagate(g.entity_entity, g.time, e0, steps=2)
    rows = torch.from_numpy(pair.test.reshape(-1))
    return g, e_bar, x_cat, rows


def test_fp16_triple_view_is_fp32_up_to_fp16_rounding(small_pair) -> None:
    g, e_bar, x_cat, rows = _views(small_pair)
    kw = {"aspect_dim": 10, "mini_dim": 4, "rows": rows, "block": 3}
    want = triple_view(g, g.time, e_bar, x_cat, generator=torch.Generator().manual_seed(5), **kw)
    got = triple_view(g, g.time, e_bar, x_cat, generator=torch.Generator().manual_seed(5), out_dtype=torch.float16,
                      **kw)
    assert got.dtype == torch.float16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-3)
    # raw sums beyond fp16's range (here: labels scaled by 1e6) keep the result in fp32, with the same values
    big = triple_view(g, g.time, e_bar * 1e6, x_cat, generator=torch.Generator().manual_seed(5),
                      out_dtype=torch.float16, **kw)
    assert big.dtype == torch.float32
    torch.testing.assert_close(big, want, rtol=1e-4, atol=1e-5)


def test_second_aspect_added_in_place_equals_the_fold_of_two_matrices(small_pair) -> None:
    g, _, _, rows = _views(small_pair)
    e0 = l2n(torch.randn(g.num_entities, 16, generator=torch.Generator().manual_seed(0)))
    ops = []
    for a, aspect in enumerate((g.relation, g.time)):
        e_bar, x_cat = propagate(g.entity_entity, aspect, e0, steps=2)
        ops.append(triple_operands(g, aspect, e_bar, x_cat, 10, 4, torch.Generator().manual_seed(5 + a), rows))
    alpha = 0.3
    first, second = (triple_sums(o, block=3, out_dtype=torch.float16) for o in ops)
    want = first.clone().mul_(1 - alpha).add_(second, alpha=alpha)  # the engine's fold of two stored matrices
    got = first.clone()
    assert triple_sums_into(ops[1], got, 1 - alpha, alpha, block=3)
    assert got.dtype == torch.float16
    # the values triple_sums stores, each sum rounded once to fp16
    assert torch.equal(got, first.clone().mul_(1 - alpha).float().add_(second.float(), alpha=alpha).half())
    # the fold of two stored matrices may round alpha * value first: at most one fp16 step apart
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-3)
    # sums that could overflow fp16: refused, the matrix left as it was
    ops[1].e_tails = ops[1].e_tails * 1e6
    kept = first.clone()
    assert not triple_sums_into(ops[1], kept, 1 - alpha, alpha, block=3)
    assert torch.equal(kept, first)
    with pytest.raises(ValueError, match="narrow"):
        triple_sums_into(ops[1], first.float(), 1 - alpha, alpha)


def test_large_runs_fold_the_second_aspect_in_place_and_align_alike() -> None:
    pair = make_synthetic_pair(num_entities=700, seed=2)
    cfg = LightTEAConfig(**FAST, candidate_dim=16, rescore_top=20, feature_dtype="float16", rounds=2)
    calls = []
    real = engine.triple_sums_into
    try:
        engine.triple_sums_into = lambda *a, **k: calls.append(1) or real(*a, **k)
        folded = LightTEA(cfg).fit(pair)
        engine.triple_sums_into = lambda *a, **k: False  # as when a sum could overflow: two matrices, then the fold
        stored = LightTEA(cfg).fit(pair)
    finally:
        engine.triple_sums_into = real
    assert len(calls) == 2  # once per round
    # round 1 starts from the same seeds: features at most one fp16 step apart, the same alignment quality; a few
    # pseudo seeds more or less then make later rounds differ on a pair this small
    first = [r.as_dict()["hits@1"] for r in (folded.rounds[0], stored.rounds[0])]
    assert abs(first[0] - first[1]) <= 0.005, first
    assert min(folded.final["hits@1"], stored.final["hits@1"]) > 0.75


def test_rows_moved_to_the_front_in_place_equal_the_copied_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50, 6, generator=gen).half()
    rows = torch.nonzero(torch.rand(20, generator=gen) < 0.7)[:, 0]
    cols = torch.nonzero(torch.rand(30, generator=gen) < 0.6)[:, 0]
    want_left, want_right = x[:20][rows], x[20:][cols]
    left, right = engine._compact_rows_(x, torch.cat([rows, cols + 20]), len(rows), chunk=3)
    assert torch.equal(left, want_left) and torch.equal(right, want_right)
    assert left.data_ptr() == x.data_ptr() and right.is_contiguous()


def test_widened_candidates_in_row_blocks_equal_the_one_pass_result() -> None:
    gen = torch.Generator().manual_seed(6)
    out_rows = torch.sort(torch.randperm(40, generator=gen)[:23]).values
    keep = torch.rand(23, generator=gen) < 0.6
    cols = torch.sort(torch.randperm(40, generator=gen)[:30]).values
    sub = engine.TopK(torch.rand(int(keep.sum()), 5, generator=gen), torch.randint(0, 30, (int(keep.sum()), 5),
                                                                                   generator=gen))
    # the one-pass construction the row blocks replace
    index = (out_rows[:, None] + 1 + torch.arange(5)[None, :]) % 40
    values = torch.zeros(23, 5)
    index[keep], values[keep] = cols[sub.index], sub.values
    for chunk in (3, 16384):
        got = engine._widen(sub, keep, out_rows, cols, 40, chunk=chunk)
        assert torch.equal(got.index, index) and torch.equal(got.values, values)


def test_run_moving_featured_rows_in_place_aligns_as_one_copying_them(monkeypatch) -> None:
    pair = make_synthetic_pair(num_entities=700, seed=2)
    cfg = LightTEAConfig(**FAST, candidate_dim=16, rescore_top=20, rounds=2)
    calls = []
    real = engine._compact_rows_
    monkeypatch.setattr(engine, "_compact_rows_", lambda *a, **k: calls.append(1) or real(*a, **k))
    moved = LightTEA(cfg).fit(pair)
    assert calls, "no test entity without facts in this pair: the in-place path did not run"
    monkeypatch.setattr(engine, "_compact_rows_", lambda x, rows, split, chunk=0: (x[rows[:split]], x[rows[split:]]))
    copied = LightTEA(cfg).fit(pair)
    assert [r.as_dict() | {"seconds": 0} for r in moved.rounds] == [r.as_dict() | {"seconds": 0} for r in copied.rounds]
    assert (moved.predicted == copied.predicted).all()


@pytest.mark.parametrize("native", [True, False])
def test_gathered_dot_widens_fp16_left_rows(native: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    left, right = l2n(torch.randn(40, 24, generator=gen)).half(), l2n(torch.randn(33, 24, generator=gen)).half()
    index = torch.randint(0, 33, (40, 6), generator=gen)
    rows = torch.randint(0, 40, (40,), generator=gen)
    for r in (None, rows):
        got = gathered_dot(left, right, index, r, native=native)
        lr = left.float() if r is None else left.float()[r]
        want = (right.float()[index] * lr[:, None, :]).sum(-1)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp16_features_search_and_rescore_in_fp32() -> None:
    gen = torch.Generator().manual_seed(3)
    left, right = l2n(torch.randn(120, 48, generator=gen)), l2n(torch.randn(90, 48, generator=gen))
    basis = torch.linalg.qr(torch.randn(48, 20, generator=gen)).Q
    torch.testing.assert_close(project_rows(left.half(), basis, torch.float32, block=7), left.half().float() @ basis)
    exact, _ = blocked_topk(left, right, 10, 32)
    half, _ = blocked_topk(left.half(), right.half(), 10, 32)
    assert half.values.dtype == torch.float32
    assert (half.index[:, 0] == exact.index[:, 0]).float().mean() > 0.97
    masked_rows = torch.rand(120, generator=gen) < 0.5
    allowed = torch.rand(90, generator=gen) < 0.7
    for dtype in (None, torch.bfloat16):
        want, want_m = lowrank_topk(left, right, 10, 32, 48, 10, torch.Generator().manual_seed(0), masked_rows,
                                    allowed, 8, matmul_dtype=dtype)
        got, got_m = lowrank_topk(left.half(), right.half(), 10, 32, 48, 10, torch.Generator().manual_seed(0),
                                  masked_rows, allowed, 8, matmul_dtype=dtype)
        for a, b in ((got, want), (got_m, want_m)):
            assert a.values.dtype == torch.float32
            assert (a.index[:, 0] == b.index[:, 0]).float().mean() > 0.95
            torch.testing.assert_close(a.values[:, 0], b.values[:, 0], rtol=0, atol=2e-3)


def test_fp16_and_fp32_features_align_the_synthetic_pair_alike() -> None:
    pair = make_synthetic_pair(num_entities=700, seed=2)
    runs = {}
    for dtype in ("float32", "float16"):
        cfg = LightTEAConfig(**FAST, candidate_dim=16, rescore_top=20, feature_dtype=dtype, rounds=2)
        runs[dtype] = LightTEA(cfg).fit(pair)
        assert runs[dtype].config["feature_dtype_used"] == dtype
    # Round 1 starts from the same seeds in both, so it shows what the storage dtype changes. Later rounds start
    # from pseudo seeds picked at a threshold, and one more or less redraws every label after it: on a pair this
    # small that alone moves H@1 by a few points either way (0.72-0.88 over six config seeds, either dtype).
    first = [runs[d].rounds[0].as_dict()["hits@1"] for d in ("float16", "float32")]
    assert abs(first[0] - first[1]) <= 0.01, first
    assert min(runs["float32"].final["hits@1"], runs["float16"].final["hits@1"]) > 0.7
    # auto: fp16 when the subspace search runs on large features, fp32 for small ones, for the exact full-width
    # search and in reference mode
    big = FP16_FEATURES_MIN_BYTES // (8 * FAST.get("mini_dim", 16) * 4) + 1  # entities whose fp32 features reach it
    assert LightTEA(LightTEAConfig(**FAST, candidate_dim=16)).feature_dtype(8, big) == torch.float16
    assert LightTEA(LightTEAConfig(**FAST, candidate_dim=16)).feature_dtype(8, big // 2) == torch.float32
    assert LightTEA(LightTEAConfig(**FAST, candidate_dim=None)).feature_dtype(8, big) == torch.float32
    assert LightTEA(LightTEAConfig(**FAST, reference_compat=True)).feature_dtype(8, big) == torch.float32


def test_feature_dtype_config() -> None:
    assert LightTEAConfig(feature_dtype="FP16").feature_dtype == "float16"
    with pytest.raises(ValueError, match="feature_dtype"):
        LightTEAConfig(feature_dtype="int8")


@pytest.mark.skipif(not ann.faiss_available(), reason="faiss not installed (extra [scale])")
def test_ivf_search_of_fp16_features_equals_fp32_when_every_list_is_probed() -> None:
    gen = torch.Generator().manual_seed(4)
    left = l2n(torch.randn(600, 40, generator=gen))
    right = l2n(left + 0.5 * torch.randn(600, 40, generator=gen) / 40**0.5)
    masked_rows, allowed = torch.rand(600, generator=gen) < 0.5, torch.rand(600, generator=gen) < 0.6
    runs = [ann.ivf_topk(x, y, 12, 128, 24, 12, torch.Generator().manual_seed(0), masked_rows, allowed, 6, nlist=8,
                     nprobe=8) for x, y in ((left, right), (left.half(), right.half()))]
    (full32, masked32), (full16, masked16) = runs
    for a, b in ((full16, full32), (masked16, masked32)):
        assert a.values.dtype == torch.float32
        assert (a.index[:, 0] == b.index[:, 0]).float().mean() > 0.98
        torch.testing.assert_close(a.values[:, 0], b.values[:, 0], rtol=0, atol=2e-3)
    truth = torch.arange(600)
    assert (full16.index[:, 0] == truth).float().mean() > 0.95  # the planted matches are found
