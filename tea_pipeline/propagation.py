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
HALF = (torch.float16, torch.bfloat16)  # storage dtypes whose arithmetic here runs in fp32


def l2n(x: torch.Tensor) -> torch.Tensor:
    """Row-wise L2 normalisation with TF's epsilon (a zero row stays zero)."""
    return l2n_(x.clone())


def l2n_(x: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """`l2n` in place, for temporaries: allocating a second feature-sized matrix costs more than the arithmetic.

    A 16-bit matrix is normalised ``chunk`` rows at a time in fp32 and stored back rounded.
    """
    if x.dtype in HALF and x.dim() == 2:
        for r0 in range(0, x.shape[0], chunk):
            x[r0:r0 + chunk] = l2n_(x[r0:r0 + chunk].float())
        return x
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x.mul_(torch.rsqrt(torch.clamp(norm * norm, min=EPS)))


@dataclass(frozen=True)
class SeedLabels:
    """E0 held by its labelled rows: both entities of seed pair i carry the random unit vector V_i, every other row of
    the N x d matrix is zero. Dense, E0 is N x d fp32 (2 GB at a million entities and d = 512) for a few thousand
    non-zero rows; `propagate` and `first_hop_matrix` read it in this form."""

    num_entities: int
    rows: torch.Tensor  # distinct entity ids, ascending
    values: torch.Tensor  # len(rows) x d

    @classmethod
    def draw(cls, num_entities: int, seed_pairs: torch.Tensor, dim: int, generator: torch.Generator) -> SeedLabels:
        """The labels `seed_labels` returns, drawn from ``generator`` the same way (an entity in two seed pairs keeps
        the later pair's vector, as the dense assignment does)."""
        v = l2n(torch.randn(len(seed_pairs), dim, generator=generator))
        ids = torch.cat([seed_pairs[:, 0], seed_pairs[:, 1]]).long()
        rows, inverse = torch.unique(ids, return_inverse=True)
        last = torch.full((len(rows),), -1, dtype=torch.long).scatter_reduce_(
            0, inverse, torch.arange(len(ids)), reduce="amax")
        order = torch.cat([torch.arange(len(seed_pairs)), torch.arange(len(seed_pairs))])
        return cls(num_entities, rows, v[order[last]])

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def to(self, device: torch.device | str) -> SeedLabels:
        return SeedLabels(self.num_entities, self.rows.to(device), self.values.to(device))

    def dense(self) -> torch.Tensor:
        """The N x d matrix."""
        e0 = torch.zeros(self.num_entities, self.dim, dtype=self.values.dtype, device=self.values.device)
        e0[self.rows] = self.values
        return e0


def seed_labels(num_entities: int, seed_pairs: torch.Tensor, dim: int, generator: torch.Generator) -> torch.Tensor:
    """E0 (N x d): both entities of seed pair i get the same random unit Gaussian vector V_i (not orthogonalised)."""
    return SeedLabels.draw(num_entities, seed_pairs, dim, generator).dense()


def _rows_of(e0: torch.Tensor | SeedLabels, rows: torch.Tensor) -> torch.Tensor:
    """``E0[rows]`` for labelled ``rows``."""
    if isinstance(e0, SeedLabels):
        return e0.values[torch.searchsorted(e0.rows, rows)]
    return e0[rows]


def _labelled(e0: torch.Tensor | SeedLabels) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending ids of the non-zero rows of E0, those rows)."""
    if isinstance(e0, SeedLabels):
        keep = e0.values.abs().amax(dim=1) > 0
        return e0.rows[keep], e0.values[keep]
    rows = torch.nonzero(e0.abs().amax(dim=1) > 0)[:, 0]
    return rows, e0[rows]


def csr(m: torch.Tensor) -> torch.Tensor:
    """``m`` in CSR layout (torch marks CSR construction as beta with a warning; the products are stable)."""
    if m.layout != torch.sparse_coo:
        return m
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        return m.to_sparse_csr()


def csr_row_chunks(m: torch.Tensor, chunk: int) -> list[tuple[int, int, torch.Tensor]]:
    """``(r0, r1, m[r0:r1])`` for consecutive blocks of ``chunk`` rows of the CSR matrix ``m``. Each block shares
    ``m``'s column indices and values (only its row pointers are new), so splitting costs no copy of the matrix."""
    crow, col, val = m.crow_indices(), m.col_indices(), m.values()
    out = []
    for r0 in range(0, m.shape[0], chunk):
        r1 = min(r0 + chunk, m.shape[0])
        a, b = int(crow[r0]), int(crow[r1])
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
            out.append((r0, r1, torch.sparse_csr_tensor(crow[r0:r1 + 1] - a, col[a:b], val[a:b],
                                                         (r1 - r0, m.shape[1]), check_invariants=False)))
    return out


@dataclass
class Propagated:
    """`propagate`'s result with the label block held by its labelled rows: ``E_bar = [labels | rest]``.

    The label block of ``E_bar`` is ``E0`` scaled by each row's normalisation, zero outside the labelled rows, and
    the triple view reads it at those rows only; dense, it would be the largest part of ``E_bar`` that carries
    nothing (an N x d fp32 block: 2 GB at a million entities and d = 512). ``rest`` (N x L d) are the propagated
    blocks, normalised as parts of the whole row; ``labels`` is ``E0`` by its labelled rows as given (not copied:
    late rounds label most entities) and ``label_scale`` each labelled row's normalisation.
    """

    rest: torch.Tensor
    x_cat: torch.Tensor
    labels: SeedLabels
    label_scale: torch.Tensor

    @property
    def width(self) -> int:
        """Columns of the whole ``E_bar``."""
        return self.labels.dim + self.rest.shape[1]

    def label_rows(self, index: torch.Tensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                   at: torch.Tensor | None = None, chunk: int = 16384) -> torch.Tensor:
        """The label block's rows ``labels.rows[index]`` in ``dtype``, ``chunk`` rows at a time: no full-size fp32
        copy of them. With ``out`` they are written into its rows ``at`` (default: its first rows), in its dtype."""
        if out is None:
            out = torch.empty(len(index), self.labels.dim, dtype=dtype or self.labels.values.dtype,
                              device=self.labels.values.device)
        for r0 in range(0, len(index), chunk):
            i = index[r0:r0 + chunk]
            rows = slice(r0, r0 + len(i)) if at is None else at[r0:r0 + chunk]
            out[rows] = (self.labels.values[i] * self.label_scale[i, None]).to(out.dtype)
        return out

    def dense(self) -> torch.Tensor:
        """The whole N x (L+1)d ``E_bar``."""
        d = self.labels.dim
        e_bar = torch.empty(self.rest.shape[0], self.width, dtype=self.rest.dtype, device=self.rest.device)
        e_bar[:, :d] = 0
        e_bar[self.labels.rows, :d] = self.label_rows(torch.arange(len(self.labels.rows)))
        e_bar[:, d:] = self.rest
        return e_bar


def _csr_columns(m: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The CSR matrix ``m[:, cols]`` (``cols`` ascending), columns renumbered ``0..len(cols)-1``. The kept entries
    stay in their order, so a product with it sums the same terms in the same order as ``m`` times a dense matrix
    that is zero outside ``cols``."""
    crow, col, val = m.crow_indices(), m.col_indices(), m.values()
    pos = torch.full((m.shape[1],), -1, dtype=col.dtype, device=col.device)
    pos[cols] = torch.arange(len(cols), dtype=col.dtype, device=col.device)
    new_col = pos[col]
    keep = new_col >= 0
    row_of = torch.repeat_interleave(torch.arange(m.shape[0], device=col.device), crow[1:] - crow[:-1])
    new_crow = torch.zeros(m.shape[0] + 1, dtype=crow.dtype, device=crow.device)
    new_crow[1:] = torch.cumsum(torch.bincount(row_of[keep], minlength=m.shape[0]), 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        return torch.sparse_csr_tensor(new_crow, new_col[keep], val[keep], (m.shape[0], len(cols)),
                                       check_invariants=False)


def propagate_labels(a_ee: torch.Tensor, aspect: AspectGraph, e0: torch.Tensor | SeedLabels, steps: int,
                     chunk_bytes: int = 1 << 28) -> Propagated:
    """L steps of entity/aspect propagation, the label block kept by its labelled rows (see `Propagated`).

    Each step is written into its column block of a preallocated ``rest`` and read from there by the next step (no
    list of steps and no concatenated copy). The first step reads ``E0`` through its labelled columns only
    (``A_ee[:, L] E0[L]``), so ``E0`` is never a dense N x d matrix. The entity product runs ``chunk_bytes`` of
    output rows at a time, written straight into its block: a full-height product would allocate an N x d
    temporary, plus the copy into the block, and those would be the largest allocations of the stage. The aspect
    term is accumulated into each chunk in place (``addmm_``). Every row is normalised as a whole at the end, its
    squared norm summed from the label block's and the propagated blocks'.
    """
    if not isinstance(e0, SeedLabels):
        rows, values = _labelled(e0)
        e0 = SeedLabels(e0.shape[0], rows, values)
    n, d, like = e0.num_entities, e0.dim, e0.values
    rest = torch.empty(n, steps * d, dtype=like.dtype, device=like.device)
    x_cat = torch.zeros(aspect.num_nodes, (steps + 1) * d, dtype=like.dtype, device=like.device)
    # CSR times a dense matrix is faster than coalesced COO for these products (bench/tea/README.md): convert once
    # here and reuse the CSR matrices in every step.
    a_ee, x_from_head, x_to_tail = (csr(m) for m in (a_ee, aspect.x_from_head, aspect.x_to_tail))
    rows = max(1, chunk_bytes // max(1, d * like.element_size()))
    tail_chunks = csr_row_chunks(x_to_tail, rows)
    for s in range(1, steps + 1):
        if s == 1:  # from E0, through its labelled columns
            a, e = _csr_columns(a_ee, e0.rows), e0.values
            x_cat[:, d:2 * d] = l2n_(_csr_columns(x_from_head, e0.rows) @ e)
        else:  # the previous step, read in place from its block (the sparse products take the strided view)
            a, e = a_ee, rest[:, (s - 2) * d:(s - 1) * d]
            x_cat[:, s * d:(s + 1) * d] = l2n_(x_from_head @ e)  # aspect nodes gather from their head entities
        x = x_cat[:, (s - 1) * d:s * d].contiguous()
        # entities gather from neighbours (+ self) and aspect nodes
        for (r0, r1, a_rows), (_, _, t_rows) in zip(csr_row_chunks(a, rows), tail_chunks):
            rest[r0:r1, (s - 1) * d:s * d] = l2n_((a_rows @ e).addmm_(t_rows, x))
        del a
    sumsq = torch.linalg.vector_norm(rest, dim=1).square_()
    sumsq.index_add_(0, e0.rows, torch.linalg.vector_norm(e0.values, dim=1).square_())
    scale = torch.rsqrt(torch.clamp(sumsq, min=EPS))
    rest.mul_(scale[:, None])
    return Propagated(rest, l2n_(x_cat), e0, scale[e0.rows])


def propagate(a_ee: torch.Tensor, aspect: AspectGraph, e0: torch.Tensor | SeedLabels, steps: int,
              chunk_bytes: int = 1 << 28) -> tuple[torch.Tensor, ...]:
    """L steps of entity/aspect propagation; returns (E_bar N x (L+1)d, X_cat X x (L+1)d), both row-normalised.

    `propagate_labels` with its label block written out densely; `LightTEA` keeps the `Propagated` form, which
    `triple_operands` reads as it is.
    """
    p = propagate_labels(a_ee, aspect, e0, steps, chunk_bytes)
    return p.dense(), p.x_cat


def gather_rows(x: torch.Tensor, rows: torch.Tensor, col0: int = 0, dtype: torch.dtype | None = None,
                chunk: int = 16384, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x[rows, col0:]`` as a contiguous matrix in ``dtype`` (default: ``x``'s), gathered ``chunk`` rows at a time.

    Same values as ``x[rows][:, col0:].to(dtype)``, without the full-width copy of the gathered rows and without
    holding the narrower copy in ``x``'s dtype first. With ``out`` (``len(rows)`` rows, may be a column slice of a
    larger matrix) the rows are written there in its dtype.
    """
    src = x[:, col0:]
    if out is None:
        out = torch.empty(len(rows), src.shape[1], dtype=dtype or x.dtype, device=x.device)
    for r0 in range(0, len(rows), chunk):
        out[r0:r0 + chunk] = src.index_select(0, rows[r0:r0 + chunk])
    return out


def row_norms(x: torch.Tensor, rows: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """The L2 norms of ``x[rows]`` (fp32), gathered ``chunk`` rows at a time: no copy of the rows."""
    out = torch.empty(len(rows), dtype=torch.float32, device=x.device)
    for r0 in range(0, len(rows), chunk):
        out[r0:r0 + chunk] = torch.linalg.vector_norm(x.index_select(0, rows[r0:r0 + chunk]).float(), dim=1)
    return out


def nonzero_rows(x: torch.Tensor, rows: torch.Tensor | None = None, chunk: int = 16384) -> torch.Tensor:
    """Bool per row of ``x`` (or per entry of ``rows``): whether the row has a non-zero, in chunks of rows."""
    n = x.shape[0] if rows is None else len(rows)
    out = torch.empty(n, dtype=torch.bool, device=x.device)
    for r0 in range(0, n, chunk):
        block = x[r0:r0 + chunk] if rows is None else x.index_select(0, rows[r0:r0 + chunk])
        out[r0:r0 + chunk] = (block != 0).any(dim=1)
    return out


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


def triple_view(graph: TKGGraph, aspect: AspectGraph, e_bar: torch.Tensor | Propagated, x_cat: torch.Tensor,
                aspect_dim: int, mini_dim: int, generator: torch.Generator, rows: torch.Tensor | None = None,
                block: int | None = None, label_dim: int | None = None,
                matmul_dtype: torch.dtype = torch.float32, layout: TripleLayout | None = None,
                first_hop: tuple[torch.Tensor, torch.Tensor | SeedLabels] | None = None,
                out_dtype: torch.dtype = torch.float32, operand_dtype: torch.dtype | None = None) -> torch.Tensor:
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
    the sparse sums after them stay fp32). ``out_dtype`` is the storage dtype of the result (fp16 halves the
    features' memory; the sums and the row norms are computed in fp32 and only the stored values are rounded; a
    result that would overflow fp16 is kept in fp32).

    The work is split in two (`triple_operands`, then `triple_sums`) so that a caller can free ``E_bar`` and ``E0``
    before the sums run: only the gathered tail rows are read after the first step. ``block`` projections are summed
    at a time (default: as many as keep each ``|tails| x block * mini_dim`` fp32 block near 128 MB, at most 64).

    ``first_hop = (A_ee, E0)``, the adjacency and seed labels `propagate` started from (with ``label_dim``): the
    second block of ``E_bar`` is the normalised ``A_ee E0``, and ``E0`` is zero outside the labelled rows, so its
    share of ``Z`` is computed as ``A_ee (E0 P)`` over the labelled rows (`first_hop_matrix`) instead of as a
    dense product over every tail. It pays while the labelled rows are fewer than the tails (early rounds) and the
    products run in fp32.

    ``operand_dtype`` is the storage dtype of the gathered tail rows (default: ``matmul_dtype``); see
    `triple_operands`.
    """
    ops = triple_operands(graph, aspect, e_bar, x_cat, aspect_dim, mini_dim, generator, rows, label_dim, matmul_dtype,
                          layout, first_hop, operand_dtype)
    return triple_sums(ops, block, out_dtype)


@dataclass
class TripleOperands:
    """What `triple_sums` reads: the random projections and the tail rows of ``E_bar``, gathered once.

    ``e_tails`` holds ``E_bar``'s columns from ``col0`` on at ``layout.tails`` in the product dtype (or in fp16 for
    fp32 products, widened a chunk of rows at a time as they are multiplied: `_product`); with
    ``sparse_rows`` the label block's non-zero rows (positions in the tails) are ``e_labels``, and with
    ``hop_matrix`` the first propagated block is ``hop_matrix @ hop_labels`` (see `first_hop_matrix`).
    """

    layout: TripleLayout
    xq: torch.Tensor  # X x D: the aspect nodes' embeddings times Q; W = tuple_x @ xq, built per block of columns
    proj: torch.Tensor  # D x width x mini_dim
    e_tails: torch.Tensor
    col0: int
    label_dim: int | None
    matmul_dtype: torch.dtype
    sparse_rows: torch.Tensor | None = None
    e_labels: torch.Tensor | None = None
    hop_matrix: torch.Tensor | None = None
    hop_labels: torch.Tensor | None = None


def triple_operands(graph: TKGGraph, aspect: AspectGraph, e_bar: torch.Tensor | Propagated, x_cat: torch.Tensor,
                    aspect_dim: int, mini_dim: int, generator: torch.Generator, rows: torch.Tensor | None = None,
                    label_dim: int | None = None, matmul_dtype: torch.dtype = torch.float32,
                    layout: TripleLayout | None = None,
                    first_hop: tuple[torch.Tensor, torch.Tensor | SeedLabels] | None = None,
                    operand_dtype: torch.dtype | None = None) -> TripleOperands:
    """The first step of `triple_view`: draws the projections and gathers what the sums need from ``E_bar``.

    ``E_bar`` is the whole matrix or its `Propagated` form (then ``label_dim`` is its label block's width); both give
    the same operands. ``operand_dtype`` is the dtype the gathered rows are stored in: ``matmul_dtype`` (default),
    or fp16 when the products run in fp32. The gathered rows are the largest operands of the triple view (most
    entities are tails), and its products are bound by the bytes they read (each block of projections reads all of
    them again), so fp16 storage halves both; the products widen them to fp32 a cache-sized chunk at a time. The
    rows of ``E_bar`` are row-normalised, so fp16 keeps them to about 3 decimal digits and cannot overflow.
    """
    store = operand_dtype or matmul_dtype
    if store != matmul_dtype and not (store == torch.float16 and matmul_dtype == torch.float32):
        raise ValueError(f"operand_dtype={store} with matmul_dtype={matmul_dtype} is not supported: pass "
                         "operand_dtype=None (the product dtype), or torch.float16 with float32 products.")
    split = isinstance(e_bar, Propagated)
    if split:
        if label_dim not in (None, e_bar.labels.dim):
            raise ValueError(f"label_dim={label_dim} but the propagated labels are {e_bar.labels.dim} wide")
        label_dim = e_bar.labels.dim
    width = e_bar.width if split else e_bar.shape[1]
    device = x_cat.device
    q = l2n(torch.randn(width, aspect_dim, generator=generator)).to(device)
    proj = l2n(torch.randn(aspect_dim, width, mini_dim, generator=generator)).to(device)
    if layout is None:
        layout = triple_layout(graph, aspect, rows)
    ops = TripleOperands(layout, x_cat @ q, proj, e_tails=x_cat[:0], col0=0, label_dim=label_dim,
                         matmul_dtype=matmul_dtype)
    tails = layout.tails

    def columns(c0: int, dtype: torch.dtype) -> torch.Tensor:
        """``E_bar[tails, c0:]`` (c0 past the label block when split)."""
        if not split:
            return gather_rows(e_bar, tails, c0, dtype)
        return gather_rows(e_bar.rest, tails, c0 - label_dim, dtype)

    labelled = None  # split: (positions in tails, rows of labels.values) of the labelled tails
    if label_dim is not None and 0 < label_dim < width:
        if split:
            labelled = _positions_in(e_bar.labels.rows, tails)
            nz = labelled[0]
        else:
            nz = torch.nonzero(nonzero_rows(e_bar[:, :label_dim], tails))[:, 0]
        if len(nz) < 0.75 * len(tails):
            ops.sparse_rows = nz
            ops.e_labels = (e_bar.label_rows(labelled[1], store) if split
                            else gather_rows(e_bar[:, :label_dim], tails[nz], dtype=store))
            ops.col0 = label_dim
    # Only for fp32 products: where they run in bf16 on bf16 units the dense product is cheaper than the sparse one.
    dtype_of = e_bar.rest.dtype if split else e_bar.dtype
    if (ops.sparse_rows is not None and first_hop is not None and width >= 2 * label_dim
            and matmul_dtype == dtype_of):
        block = e_bar.rest[:, :label_dim] if split else e_bar[:, label_dim:2 * label_dim]
        hop = first_hop_matrix(first_hop[0], first_hop[1], tails, row_norms(block, tails))
        if hop is not None:
            ops.hop_matrix, hop_rows = hop
            ops.hop_labels = _rows_of(first_hop[1], hop_rows).to(matmul_dtype)
            ops.col0 = 2 * label_dim  # what is left dense: blocks 2..L
    # only the columns multiplied densely, gathered straight into the product dtype
    if not split or ops.col0 >= label_dim:
        ops.e_tails = columns(ops.col0, dtype=store)
    else:  # the label block dense too: written out at the labelled tails
        ops.e_tails = torch.zeros(len(tails), width, dtype=store, device=device)
        e_bar.label_rows(labelled[1], out=ops.e_tails[:, :label_dim], at=labelled[0])
        gather_rows(e_bar.rest, tails, out=ops.e_tails[:, label_dim:])
    return ops


def _positions_in(ids: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(i, j)`` with ``query[i] == ids[j]``, for ascending ``ids``: where ``query`` meets ``ids``, and at which of
    them."""
    j = torch.searchsorted(ids, query).clamp_(max=max(len(ids) - 1, 0))
    i = torch.nonzero(ids[j] == query)[:, 0] if len(ids) else torch.zeros(0, dtype=torch.long, device=query.device)
    return i, j[i]


def _default_block(ops: TripleOperands) -> int:
    """Projections summed per pass: as many as keep the fp32 blocks (z over the tails, the sums over the output
    rows) near 128 MB each, at least 2 and at most 64. Small blocks cost little time (the gathers from a smaller z
    run faster, bench/tea/README.md) and at scale they sit on top of the triple view's peak."""
    layout, mini_dim = ops.layout, ops.proj.shape[2]
    return max(2, min(64, (1 << 25) // (max(len(ops.layout.tails), layout.n_out, 1) * mini_dim)))


def _column_blocks(ops: TripleOperands, block: int, buf: torch.Tensor | None = None,
                   out: torch.Tensor | None = None):
    """``(cols, sums)`` for each block of ``block`` projections: the fp32 sums over the tuples of those output
    columns, unnormalised. They are written into ``out[:, cols]`` (fp32, n_out x D * mini_dim) when given, else
    into ``buf`` (n_out x block * mini_dim fp32), so the caller must use each block before asking for the next."""
    layout, proj, e_tails, col0, label_dim = ops.layout, ops.proj, ops.e_tails, ops.col0, ops.label_dim
    aspect_dim, width, mini_dim = proj.shape
    low = ops.matmul_dtype != torch.float32
    for j0 in range(0, aspect_dim, block):
        j1 = min(j0 + block, aspect_dim)
        p = proj[j0:j1].permute(1, 0, 2).reshape(width, (j1 - j0) * mini_dim)
        if low:
            p = p.to(ops.matmul_dtype)
        z = _product(e_tails, p[col0:])  # |tails| x (b * mini_dim)
        if ops.sparse_rows is not None:
            z.index_add_(0, ops.sparse_rows, _product(ops.e_labels, p[:label_dim]))
        if ops.hop_matrix is not None:
            if z.dtype != torch.float32:
                z = z.float()
            # c * A (E0 P) over the labels
            z.addmm_(ops.hop_matrix, (ops.hop_labels @ p[label_dim:2 * label_dim]).float())
        if z.dtype != torch.float32:
            z = z.float()  # the sparse sums run in fp32
        w = layout.tuple_x @ ops.xq[:, j0:j1].contiguous()  # selected tuples x b
        cols = slice(j0 * mini_dim, j1 * mini_dim)
        part = out[:, cols] if out is not None else buf[:, :(j1 - j0) * mini_dim]
        weighted_segment_sum(layout.crow, layout.tail_pos, w, z, mini_dim, part)
        del z, w
        yield cols, part


def _product(a: torch.Tensor, b: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``a @ b`` in ``b``'s dtype. An ``a`` stored narrower than ``b`` (fp16 operands of fp32 products) is widened
    ``chunk`` rows at a time, each chunk multiplied while it is still in cache: ``a`` is read once at half the
    bytes, and no full-size widened copy exists."""
    if a.dtype == b.dtype:
        return a @ b
    out = torch.empty(a.shape[0], b.shape[1], dtype=b.dtype, device=a.device)
    for r0 in range(0, a.shape[0], chunk):
        torch.mm(a[r0:r0 + chunk].to(b.dtype), b, out=out[r0:r0 + chunk])
    return out


def triple_sums(ops: TripleOperands, block: int | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The second step of `triple_view`: the projected tails summed over the tuples, row-normalised."""
    layout, aspect_dim, mini_dim = ops.layout, ops.proj.shape[0], ops.proj.shape[2]
    device = ops.e_tails.device
    block = block or _default_block(ops)
    out = torch.empty(layout.n_out, aspect_dim * mini_dim, dtype=out_dtype, device=device)
    # With a narrower out_dtype each column block is summed in fp32 into `buf` and stored rounded; the row norms are
    # accumulated in fp32 on the way, and the rows are normalised at the end.
    narrow = out_dtype != torch.float32
    if not narrow:
        for _ in _column_blocks(ops, block, out=out):
            pass
        return l2n_(out)
    buf = torch.empty(layout.n_out, min(block, aspect_dim) * mini_dim, device=device)
    sumsq = torch.zeros(layout.n_out, device=device)
    for cols, part in _column_blocks(ops, block, buf):
        if narrow:
            norms = torch.linalg.vector_norm(part, dim=1)  # a row's norm bounds each of its entries
            if float(norms.max()) > 0.5 * torch.finfo(out_dtype).max:  # could overflow: keep fp32 from here on
                out, narrow = out.float(), False
            else:
                sumsq.add_(norms.square_())
        out[:, cols] = part  # rounded to out_dtype while narrow
    if not narrow:
        return l2n_(out)
    scale = _inverse_norms(sumsq)
    for r0 in range(0, layout.n_out, 16384):
        rows_ = slice(r0, r0 + 16384)
        out[rows_] = out[rows_].float().mul_(scale[rows_, None])
    return out


def _inverse_norms(sumsq: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(torch.clamp(sumsq, min=EPS))


def triple_sums_into(ops: TripleOperands, into: torch.Tensor, keep: float, alpha: float,
                     block: int | None = None) -> bool:
    """``into <- keep * into + alpha * triple_sums(ops, out_dtype=into.dtype)``, without the second matrix.

    Fusing two aspects by a weighted sum otherwise holds both aspects' feature matrices at once, the largest
    allocation of the triple view at scale. The rows are normalised before they are added, and a row's norm is known
    only once all its column blocks are summed, so this runs the sums twice: once for the row norms, once to add the
    normalised blocks (the time of one more pass over the tuples for a matrix less). Each added value is the one
    `triple_sums` would have stored, and each sum is rounded once (a fold of two stored fp16 matrices can round
    ``alpha * value`` first, so the two differ by at most one fp16 step). For a narrow ``into`` (fp16) only:
    returns False, with ``into`` untouched, when a sum could overflow that dtype (`triple_sums` keeps such a result
    in fp32 instead).
    """
    layout, aspect_dim, mini_dim = ops.layout, ops.proj.shape[0], ops.proj.shape[2]
    if into.dtype == torch.float32 or tuple(into.shape) != (layout.n_out, aspect_dim * mini_dim):
        raise ValueError(f"triple_sums_into needs a narrow {layout.n_out} x {aspect_dim * mini_dim} matrix, got "
                         f"{into.dtype} {tuple(into.shape)}")
    block = block or _default_block(ops)
    buf = torch.empty(layout.n_out, min(block, aspect_dim) * mini_dim, device=into.device)
    sumsq = torch.zeros(layout.n_out, device=into.device)
    limit = 0.5 * torch.finfo(into.dtype).max
    for _, part in _column_blocks(ops, block, buf):
        norms = torch.linalg.vector_norm(part, dim=1)
        if float(norms.max()) > limit:
            return False
        sumsq.add_(norms.square_())
    scale = _inverse_norms(sumsq)[:, None]
    into.mul_(keep)
    for cols, part in _column_blocks(ops, block, buf):
        for r0 in range(0, layout.n_out, 16384):
            rows_ = slice(r0, r0 + 16384)
            # the value triple_sums stores (rounded, normalised, rounded again), added in fp32 and rounded once
            value = part[rows_].to(into.dtype).float().mul_(scale[rows_]).to(into.dtype)
            into[rows_, cols] = into[rows_, cols].float().add_(value.float(), alpha=alpha)
    return True


def first_hop_matrix(a_ee: torch.Tensor, e0: torch.Tensor | SeedLabels, tails: torch.Tensor, e1_norms: torch.Tensor,
                     max_share: float = 0.6, chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(C A_ee[tails, L], L)`` with ``C A_ee[tails, L] E0[L] = E_bar[tails, d:2d]``; None when it would not pay.

    ``L`` are the rows where ``e0`` is non-zero and ``C`` the per-row factor that turns ``A_ee E0`` into the second
    block of ``E_bar`` (its own L2 normalisation times the normalisation of the concatenated row), read off
    ``e1_norms`` (the row norms of that block at the tails, `row_norms`); ``A_ee E0``'s own norms are computed
    ``chunk`` rows at a time, so neither block is held at full height. The dense product it replaces costs
    ``|tails| d`` per projection column, this one ``|L| d`` plus a sparse product, so it is built only while
    ``|L| <= max_share |tails|``.
    """
    lab_rows, lab_values = _labelled(e0)
    n_lab = len(lab_rows)
    if n_lab == 0 or n_lab > max_share * len(tails):
        return None
    device = lab_values.device
    a = a_ee.to_sparse_coo().coalesce() if a_ee.layout != torch.sparse_coo else a_ee.coalesce()
    row, col = a.indices()
    row_pos = torch.full((a.shape[0],), -1, dtype=torch.long, device=device)
    row_pos[tails] = torch.arange(len(tails), device=device)
    col_pos = torch.full((a.shape[1],), -1, dtype=torch.long, device=device)
    col_pos[lab_rows] = torch.arange(n_lab, device=device)
    keep = (row_pos[row] >= 0) & (col_pos[col] >= 0)
    sub = torch.sparse_coo_tensor(torch.stack([row_pos[row[keep]], col_pos[col[keep]]]), a.values()[keep],
                                  (len(tails), n_lab), check_invariants=False).coalesce()
    sub = csr(sub)
    hop_sq = torch.empty(len(tails), dtype=lab_values.dtype, device=device)  # of A_ee E0 at the tails, unnormalised
    for r0, r1, part in csr_row_chunks(sub, chunk):
        hop_sq[r0:r1] = torch.linalg.vector_norm(part @ lab_values, dim=1).square_()
    scale = e1_norms.to(lab_values.dtype) * torch.rsqrt(torch.clamp(hop_sq, min=EPS))
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
    e0 = SeedLabels.draw(graph.num_entities, train_pairs.cpu(), dim, generator).to(device)
    prop = propagate_labels(graph.entity_entity, aspect, e0, steps)
    return triple_view(graph, aspect, prop, prop.x_cat, aspect_dim, mini_dim, generator, rows, label_dim=dim,
                       matmul_dtype=matmul_dtype, first_hop=(graph.entity_entity, e0))
