"""Two-aspect three-view label propagation (reference: ``get_features_r`` / ``get_features_t``).

Random unit labels are put on the seed pairs and spread over the entity-entity and entity-aspect views; the
relation/time-triple view then turns every entity's outgoing (tail, aspect) tuples into a ``mini_dim * D_x`` wide
feature. No parameter is trained, so the whole aspect is a handful of sparse-dense products.

Legend: N entities, X aspect nodes, Q tuples, d label width, L = lp_steps, D = D_x.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .graph import AspectGraph, TKGGraph
from .kernels import weighted_segment_sum

EPS = 1e-12  # TensorFlow's l2_normalize floor on the squared norm: zero rows stay zero


def l2n(x: torch.Tensor) -> torch.Tensor:
    """Row-wise L2 normalisation with TF's epsilon (a zero row stays zero)."""
    return l2n_(x.clone())


def l2n_(x: torch.Tensor) -> torch.Tensor:
    """`l2n` in place, for temporaries: allocating a second feature-sized matrix costs more than the arithmetic."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x.mul_(torch.rsqrt(torch.clamp(norm * norm, min=EPS)))


def seed_labels(num_entities: int, seed_pairs: torch.Tensor, dim: int, generator: torch.Generator) -> torch.Tensor:
    """E0 (N x d): both entities of seed pair i get the same random unit Gaussian vector V_i (not orthogonalised)."""
    v = l2n(torch.randn(len(seed_pairs), dim, generator=generator))
    e0 = torch.zeros(num_entities, dim)
    e0[seed_pairs[:, 0]] = v
    e0[seed_pairs[:, 1]] = v
    return e0


def csr(m: torch.Tensor) -> torch.Tensor:
    """``m`` in CSR layout (torch marks CSR construction as beta with a warning; the products are stable)."""
    if m.layout != torch.sparse_coo:
        return m
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        return m.to_sparse_csr()


def propagate(a_ee: torch.Tensor, aspect: AspectGraph, e0: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """L steps of entity/aspect propagation; returns (E_bar N x (L+1)d, X_cat X x (L+1)d), both row-normalised."""
    e, x = e0, torch.zeros(aspect.num_nodes, e0.shape[1], device=e0.device)
    es, xs = [e], [x]
    # CSR times a dense matrix is faster than coalesced COO for these products (bench/tea/README.md): convert once
    # here and reuse the CSR matrices in every step.
    a_ee, x_from_head, x_to_tail = (csr(m) for m in (a_ee, aspect.x_from_head, aspect.x_to_tail))
    for _ in range(steps):
        x_new = l2n_(x_from_head @ e)  # aspect nodes gather from their head entities
        e_new = l2n_((a_ee @ e).add_(x_to_tail @ x))  # entities gather from neighbours (+ self) and aspect nodes
        e, x = e_new, x_new
        es.append(e)
        xs.append(x)
    return l2n_(torch.cat(es, dim=1)), l2n_(torch.cat(xs, dim=1))


@dataclass(frozen=True)
class TripleLayout:
    """The tuples of one aspect whose head is an output row, grouped by output row, and the distinct tails they reach.

    It depends on the graph and the output rows only, never on the labels, so a run builds it once per aspect and
    every round reuses it: ``crow`` / ``tail_pos`` are the CSR pattern (output row x position in ``tails``) shared by
    all projections, ``tuple_x`` (CSR, selected tuples x X) the tuples' aspect nodes in the same order.
    """

    n_out: int
    crow: torch.Tensor
    tail_pos: torch.Tensor
    tails: torch.Tensor
    tuple_x: torch.Tensor


def triple_layout(graph: TKGGraph, aspect: AspectGraph, rows: torch.Tensor | None = None) -> TripleLayout:
    """`TripleLayout` of ``aspect`` for the entity rows ``rows`` (default: all entities, in id order)."""
    head, tail = graph.tuple_head, graph.tuple_tail
    device = head.device
    ids = torch.arange(len(head), device=device)
    n_out = graph.num_entities
    if rows is not None:
        out_of = torch.full((graph.num_entities,), -1, dtype=torch.long, device=device)
        out_of[rows] = torch.arange(len(rows), device=device)
        keep = out_of[head] >= 0
        head, tail, ids = out_of[head[keep]], tail[keep], ids[keep]
        n_out = len(rows)
        order = torch.argsort(head, stable=True)  # CSR needs the tuples grouped by output row
        head, tail, ids = head[order], tail[order], ids[order]
    tails, tail_pos = torch.unique(tail, return_inverse=True)
    crow = torch.zeros(n_out + 1, dtype=torch.long, device=device)
    crow[1:] = torch.cumsum(torch.bincount(head, minlength=n_out), 0)
    # The selected tuples' rows of tuple_x, renumbered in layout order.
    tx = aspect.tuple_x.coalesce()
    t_row, t_col = tx.indices()
    new_row = torch.full((tx.shape[0],), -1, dtype=torch.long, device=device)
    new_row[ids] = torch.arange(len(ids), device=device)
    sel = new_row[t_row] >= 0
    tuple_x = torch.sparse_coo_tensor(torch.stack([new_row[t_row[sel]], t_col[sel]]), tx.values()[sel],
                                      (len(ids), tx.shape[1]), check_invariants=False).coalesce()
    return TripleLayout(n_out, crow, tail_pos.contiguous(), tails, csr(tuple_x))


def triple_view(graph: TKGGraph, aspect: AspectGraph, e_bar: torch.Tensor, x_cat: torch.Tensor, aspect_dim: int,
                mini_dim: int, generator: torch.Generator, rows: torch.Tensor | None = None,
                block: int = 64, label_dim: int | None = None,
                matmul_dtype: torch.dtype = torch.float32, layout: TripleLayout | None = None,
                first_hop: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Relation/time-triple view: F_j[h] = sum_{(h,t)} W[(h,t), j] * (E_bar P_j)[t] for j < D, concatenated.

    ``W = T_x (X_cat Q)`` is the summed aspect embedding of every tuple, and each of the D columns gets its own random
    projection P_j ((L+1)d x mini_dim). Only the entity rows in ``rows`` are returned (default: all); the result is
    row-normalised, ``len(rows) x (mini_dim * D)``. ``layout`` (`triple_layout` of the same graph, aspect and rows)
    saves rebuilding the tuple layout on every call.

    Work layout (why it is fast): ``Z = E_bar P`` is one dense product over the tails that occur, ``block``
    projections at a time; the sum over tuples is then ``out[h, j] = sum_q W[q, j] Z_j[tail(q)]`` for all j of the
    block in one pass over the tuples (`kernels.weighted_segment_sum`), so no Q-row intermediate is ever
    materialised. With ``label_dim``, the first ``label_dim`` columns of ``E_bar`` are the normalised seed labels,
    which are zero outside the seeds: their share of ``Z`` is computed for the seed rows only. ``matmul_dtype`` is
    the dtype of the ``E_bar P`` products (bf16: inputs and outputs rounded to 8 mantissa bits, fp32 accumulation;
    the sparse sums after them stay fp32).

    ``first_hop = (A_ee, E0)``, the adjacency and seed labels `propagate` started from (with ``label_dim``): the
    second block of ``E_bar`` is the normalised ``A_ee E0``, and ``E0`` is zero outside the labelled rows, so its
    share of ``Z`` is computed as ``A_ee (E0 P)`` over the labelled rows (`first_hop_matrix`) instead of as a
    dense product over every tail. It pays while the labelled rows are fewer than the tails (early rounds) and the
    products run in fp32.
    """
    width = e_bar.shape[1]
    device = e_bar.device
    q = l2n(torch.randn(width, aspect_dim, generator=generator)).to(device)
    proj = l2n(torch.randn(aspect_dim, width, mini_dim, generator=generator)).to(device)
    if layout is None:
        layout = triple_layout(graph, aspect, rows)
    w = layout.tuple_x @ (x_cat @ q)  # selected tuples x D
    e_tails = e_bar[layout.tails]
    sparse_rows = None
    if label_dim is not None and 0 < label_dim < width:
        nz = torch.nonzero(e_tails[:, :label_dim].abs().amax(dim=1) > 0)[:, 0]
        if len(nz) < 0.75 * len(e_tails):
            sparse_rows = nz
            e_labels = e_tails[nz, :label_dim].contiguous()
            e_tails = e_tails[:, label_dim:].contiguous()
    hop = None
    # Only for fp32 products: where they run in bf16 on bf16 units the dense product is cheaper than the sparse one.
    if sparse_rows is not None and first_hop is not None and width >= 2 * label_dim and matmul_dtype == e_tails.dtype:
        hop = first_hop_matrix(first_hop[0], first_hop[1], layout.tails, e_bar[layout.tails, label_dim:2 * label_dim])
        if hop is not None:
            hop_matrix, hop_rows = hop
            hop_labels = first_hop[1][hop_rows]
            e_tails = e_tails[:, label_dim:].contiguous()  # what is left dense: blocks 2..L
    low = matmul_dtype != e_tails.dtype
    if low:
        e_tails = e_tails.to(matmul_dtype)
        if sparse_rows is not None:
            e_labels = e_labels.to(matmul_dtype)
        if hop is not None:
            hop_labels = hop_labels.to(matmul_dtype)
    out = torch.empty(layout.n_out, aspect_dim * mini_dim, device=device)
    for j0 in range(0, aspect_dim, block):
        j1 = min(j0 + block, aspect_dim)
        p = proj[j0:j1].permute(1, 0, 2).reshape(width, (j1 - j0) * mini_dim)
        if low:
            p = p.to(matmul_dtype)
        if sparse_rows is None:
            z = e_tails @ p  # |tails| x (b * mini_dim)
        elif hop is None:
            z = e_tails @ p[label_dim:]
            z.index_add_(0, sparse_rows, e_labels @ p[:label_dim])
        else:
            z = e_tails @ p[2 * label_dim:]
            z.index_add_(0, sparse_rows, e_labels @ p[:label_dim])
            if z.dtype != torch.float32:
                z = z.float()
            z.addmm_(hop_matrix, (hop_labels @ p[label_dim:2 * label_dim]).float())  # c * A (E0 P) over the labels
        if z.dtype != torch.float32:
            z = z.float()  # the sparse sums run in fp32
        weighted_segment_sum(layout.crow, layout.tail_pos, w[:, j0:j1], z, mini_dim,
                             out[:, j0 * mini_dim:j1 * mini_dim])
    return l2n_(out)


def first_hop_matrix(a_ee: torch.Tensor, e0: torch.Tensor, tails: torch.Tensor, e1_tails: torch.Tensor,
                     max_share: float = 0.6) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(C A_ee[tails, L], L)`` with ``C A_ee[tails, L] E0[L] = E_bar[tails, d:2d]``; None when it would not pay.

    ``L`` are the rows where ``e0`` is non-zero and ``C`` the per-row factor that turns ``A_ee E0`` into the second
    block of ``E_bar`` (its own L2 normalisation times the normalisation of the concatenated row), read off
    ``e1_tails`` (that block at the tail rows). The dense product it replaces costs ``|tails| d`` per projection
    column, this one ``|L| d`` plus a sparse product, so it is built only while ``|L| <= max_share |tails|``.
    """
    labelled = e0.abs().amax(dim=1) > 0
    n_lab = int(labelled.sum())
    if n_lab == 0 or n_lab > max_share * len(tails):
        return None
    a = a_ee.to_sparse_coo().coalesce() if a_ee.layout != torch.sparse_coo else a_ee.coalesce()
    row, col = a.indices()
    row_pos = torch.full((a.shape[0],), -1, dtype=torch.long, device=e0.device)
    row_pos[tails] = torch.arange(len(tails), device=e0.device)
    col_pos = torch.full((a.shape[1],), -1, dtype=torch.long, device=e0.device)
    lab_rows = torch.nonzero(labelled)[:, 0]
    col_pos[lab_rows] = torch.arange(n_lab, device=e0.device)
    keep = (row_pos[row] >= 0) & (col_pos[col] >= 0)
    sub = torch.sparse_coo_tensor(torch.stack([row_pos[row[keep]], col_pos[col[keep]]]), a.values()[keep],
                                  (len(tails), n_lab), check_invariants=False).coalesce()
    sub = csr(sub)
    hop = sub @ e0[lab_rows]  # A_ee E0 at the tails, before any normalisation
    scale = torch.linalg.vector_norm(e1_tails, dim=1) * torch.rsqrt(
        torch.clamp(torch.linalg.vector_norm(hop, dim=1).square(), min=EPS))
    crow, cols, vals = sub.crow_indices(), sub.col_indices(), sub.values()
    vals = vals * torch.repeat_interleave(scale, crow[1:] - crow[:-1])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        scaled = torch.sparse_csr_tensor(crow, cols, vals, sub.shape, check_invariants=False)
    return scaled, lab_rows


def aspect_features(graph: TKGGraph, aspect: AspectGraph, train_pairs: torch.Tensor, dim: int, steps: int,
                    aspect_dim: int, mini_dim: int, generator: torch.Generator,
                    rows: torch.Tensor | None = None, matmul_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The output of one aspect: seed labels -> propagation -> triple view (rows ``rows``)."""
    device = graph.entity_entity.device
    e0 = seed_labels(graph.num_entities, train_pairs.cpu(), dim, generator).to(device)
    e_bar, x_cat = propagate(graph.entity_entity, aspect, e0, steps)
    return triple_view(graph, aspect, e_bar, x_cat, aspect_dim, mini_dim, generator, rows, label_dim=dim,
                       matmul_dtype=matmul_dtype, first_hop=(graph.entity_entity, e0))
