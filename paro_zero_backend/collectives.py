"""PaRO-CC: hierarchical collectives over a two-level topology, with byte counters.

A flat ring over ``n`` ranks has ``n - 1`` steps and every step crosses a group boundary somewhere, so the whole
collective runs at inter-group speed. PaRO-CC (paper §3.2) splits each global collective into an intra-group part
(``m`` ranks, fast links) and an inter-group part (``ng = n / m`` ranks with the same local index, slow links):

- all-gather (AG_G): inter-group all-gather (AG_E) first, then intra-group all-gather (AG_I);
- reduce-scatter (RS_G): intra-group reduce-scatter (RS_I) first, then inter-group reduce-scatter (RS_E);
- all-reduce (AR_G): RS_I, then all-reduce across groups (AR_E) on the 1/m chunk, then AG_I.

Block layout. The engine keeps every flat buffer in the *device-major* order (`hf_placement.partition.schedule`): a
buffer of ``n`` equal blocks where rank ``r = i*m + j`` (group ``i``, local index ``j``) owns block ``k = j*ng + i``.
Then the 1/m chunk of local rank ``j`` (blocks ``j*ng .. j*ng + ng - 1``) is contiguous, AG_I/RS_I cut the buffer
into ``m`` contiguous chunks and AG_E/RS_E cut one chunk into ``ng`` contiguous blocks: no collective ever needs a
strided copy. The public functions below default to ``order="rank"`` (block ``r`` belongs to rank ``r``), the
semantics of ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor``, so they can replace flat collectives.

Byte counting. Counters hold the per-rank *send volume* of a ring algorithm, the quantity in the paper's cost
model: an all-gather or reduce-scatter over ``k`` ranks of a buffer of ``X`` elements sends ``(k-1)/k * X``
elements per rank, an all-reduce twice that. gloo emulates reduce-scatter as all-reduce + chunk and so moves more on
the wire; the counters describe the algorithm, not gloo's emulation. A group of one rank sends nothing and makes no
call. Scalars exchanged for control (grad-norm, overflow flags) go to the ``control`` counter, not to
``intra``/``inter``, so that those two equal the formulas exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from hf_placement import all_gather_single, reduce_scatter_single
from hf_placement.partition.schedule import AG_GLOBAL, Collective, Op, Span

__all__ = [
    "CollectiveResult",
    "CommCounter",
    "flat_all_gather",
    "flat_all_reduce",
    "flat_reduce_scatter",
    "hierarchical_all_gather",
    "hierarchical_all_gather_coalesced",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "rank_to_device_order",
    "device_to_rank_order",
]

LINKS = ("intra", "inter", "flat", "control")

_all_gather_single, _reduce_scatter_single = all_gather_single, reduce_scatter_single  # torch-version shim (base)


@dataclass
class CommCounter:
    """Bytes sent by this rank, per link kind, and the number of collective calls.

    ``intra``: inside a group; ``inter``: between groups (PaRO's "E" collectives); ``flat``: flat global
    collectives (``paro_cc=False``), whose ring crosses group boundaries and therefore runs at inter-group speed;
    ``control``: small scalar exchanges (norms, overflow flags). ``terms``: the same bytes (control excluded) by the
    schedule term the engine was executing (``t_param``, ``t_gradient``, ``t_sync_g``, ``t_sync_p``; see
    `hf_placement.partition.schedule`), so each term can be held against its formula.
    """

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    terms: dict[str, int] = field(default_factory=dict)
    _term: str | None = field(default=None, repr=False)

    def add(self, link: str, nbytes: int) -> None:
        self.bytes[link] += int(nbytes)
        self.calls[link] += 1
        if self._term is not None and link != "control":
            self.terms[self._term] = self.terms.get(self._term, 0) + int(nbytes)

    @contextlib.contextmanager
    def term(self, name: str) -> Iterator[None]:
        """Attribute the bytes sent inside the block to schedule term ``name``."""
        previous, self._term = self._term, name
        try:
            yield
        finally:
            self._term = previous

    def sent(self) -> int:
        """Bytes sent on the data links (intra + inter + flat) so far."""
        return self.bytes["intra"] + self.bytes["inter"] + self.bytes["flat"]

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)

    def reset(self) -> None:
        for k in LINKS:
            self.bytes[k] = 0
            self.calls[k] = 0
        self.terms.clear()


class CollectiveResult(NamedTuple):
    """Output of a standalone collective and the bytes this rank sent for it."""

    output: torch.Tensor
    intra_bytes: int
    inter_bytes: int
    flat_bytes: int


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _Comm:
    """Engine-side primitives on flat 1-D tensors, in device-major block order, with counters.

    Every method returns a new tensor (or fills ``out``); the input is never modified unless stated.
    """

    def __init__(self, topology, counter: CommCounter, hierarchical: bool = True):
        self.topo = topology
        self.counter = counter
        self.hierarchical = hierarchical
        self.m = topology.group_size
        self.n = topology.world_size
        self.ng = topology.num_groups
        self.intra = topology.intra_group
        self.inter = topology.inter_group
        self.world = topology.world_group
        i, j = topology.group_index, topology.local_index
        # Device-major: rank r=(i, j) owns block j*ng + i; with m == 1 or ng == 1 that is block r (no reordering).
        self.identity_perm = all((r % self.m) * self.ng + r // self.m == r for r in range(self.n))
        self.block_index = j * self.ng + i
        self._ops = {(Op.ALL_GATHER, Span.INTRA): self.ag_intra, (Op.ALL_GATHER, Span.INTER): self.ag_inter,
                     (Op.ALL_GATHER, Span.GLOBAL): self.ag_global, (Op.REDUCE_SCATTER, Span.INTRA): self.rs_intra,
                     (Op.REDUCE_SCATTER, Span.INTER): self.rs_inter,
                     (Op.REDUCE_SCATTER, Span.GLOBAL): self.rs_global, (Op.ALL_REDUCE, Span.INTER): self.ar_inter,
                     (Op.ALL_REDUCE, Span.GLOBAL): self.ar_global}

    # --- schedule execution ----------------------------------------------------------------------------------
    def run(self, collectives: Sequence[Collective], x: torch.Tensor) -> torch.Tensor:
        """Apply a schedule entry (`hf_placement.partition.schedule`) to ``x``, collective after collective; with no
        collectives ``x`` itself comes back. All-reduces work in place on their input."""
        for c in collectives:
            x = self._ops[(c.op, c.span)](x)
        return x

    def run_each(self, collectives: Sequence[Collective], xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`run` on several buffers; a global all-gather is pipelined across them (`ag_global_coalesced`)."""
        if tuple(collectives) == (AG_GLOBAL,):
            return self.ag_global_coalesced(xs)
        return [self.run(collectives, x) for x in xs]

    def group(self, span: Span | None) -> dist.ProcessGroup | None:
        """The process group of a span (None: no group, the state is not split)."""
        return {None: None, Span.INTRA: self.intra, Span.INTER: self.inter, Span.GLOBAL: self.world}[span]

    # --- one-level collectives -------------------------------------------------------------------------------
    def _all_gather(self, x: torch.Tensor, group, k: int, link: str, async_op: bool = False):
        out = x.new_empty(x.numel() * k)
        if k == 1:
            out.copy_(x)
            return (out, None) if async_op else out
        self.counter.add(link, (k - 1) * x.numel() * x.element_size())
        work = _all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
        return (out, work) if async_op else out

    def _reduce_scatter(self, x: torch.Tensor, group, k: int, link: str) -> torch.Tensor:
        if k == 1:
            return x.clone()
        if x.numel() % k:
            raise ValueError(f"reduce-scatter input of {x.numel()} elements is not divisible by the group size {k}; "
                             "pad flat buffers to a multiple of the world size.")
        out = x.new_empty(x.numel() // k)
        self.counter.add(link, (k - 1) * out.numel() * x.element_size())
        _reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
        return out

    def _all_reduce(self, x: torch.Tensor, group, k: int, link: str) -> torch.Tensor:
        """In place; returns ``x``."""
        if k == 1:
            return x
        self.counter.add(link, 2 * (k - 1) * x.numel() // k * x.element_size())
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    def ag_intra(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._all_gather(chunk, self.intra, self.m, "intra")

    def rs_intra(self, full: torch.Tensor) -> torch.Tensor:
        return self._reduce_scatter(full, self.intra, self.m, "intra")

    def ag_inter(self, block: torch.Tensor) -> torch.Tensor:
        return self._all_gather(block, self.inter, self.ng, "inter")

    def rs_inter(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._reduce_scatter(chunk, self.inter, self.ng, "inter")

    def ar_inter(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(chunk, self.inter, self.ng, "inter")

    # --- global collectives: PaRO-CC or flat -----------------------------------------------------------------
    def ag_global(self, block: torch.Tensor) -> torch.Tensor:
        """This rank's device-major block -> the full buffer (device-major)."""
        if self.hierarchical:
            return self.ag_intra(self.ag_inter(block))
        out = self._all_gather(block, self.world, self.n, "flat")  # rank order
        return out if self.identity_perm else rank_to_device_order(out, self.n, self.m)

    def ag_global_coalesced(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several AG_G, pipelined: the inter-group gather of tensor k+1 runs while tensor k gathers intra-group.

        This is the overlap of the paper's Fig. 2 at bucket granularity (the inter and intra parts use different
        process groups, so they can be in flight together).
        """
        if not self.hierarchical or self.ng == 1 or self.m == 1 or len(blocks) < 2:
            return [self.ag_global(b) for b in blocks]
        outs: list[torch.Tensor] = []
        pending = self._all_gather(blocks[0], self.inter, self.ng, "inter", async_op=True)
        for k in range(len(blocks)):
            chunk, work = pending
            if work is not None:
                work.wait()
            if k + 1 < len(blocks):
                pending = self._all_gather(blocks[k + 1], self.inter, self.ng, "inter", async_op=True)
            outs.append(self.ag_intra(chunk))
        return outs

    def rs_global(self, full: torch.Tensor) -> torch.Tensor:
        """Full device-major buffer -> this rank's block, summed over all ranks."""
        if self.hierarchical:
            return self.rs_inter(self.rs_intra(full))
        src = full if self.identity_perm else device_to_rank_order(full, self.n, self.m)
        return self._reduce_scatter(src, self.world, self.n, "flat")

    def ar_global(self, full: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of a buffer whose size is a multiple of n; returns the reduced tensor."""
        if self.hierarchical:
            if self.m == 1:
                return self.ar_inter(full)
            if self.ng == 1:
                return self._all_reduce(full, self.intra, self.m, "intra")
            chunk = self.rs_intra(full)
            self.ar_inter(chunk)
            return self.ag_intra(chunk)
        return self._all_reduce(full, self.world, self.n, "flat")

    def control_all_reduce(self, x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
        k = _size(group) if group is not self.world else self.n
        if k > 1:
            self.counter.add("control", 2 * (k - 1) * max(x.numel() // k, 1) * x.element_size())
            dist.all_reduce(x, op=op, group=group)
        return x


def rank_to_device_order(x: torch.Tensor, world_size: int, group_size: int) -> torch.Tensor:
    """Reorder ``n`` blocks from rank order (block r of rank r) to device-major order (block j*ng+i of rank i*m+j)."""
    ng = world_size // group_size
    return x.view(ng, group_size, -1).transpose(0, 1).reshape(-1)


def device_to_rank_order(x: torch.Tensor, world_size: int, group_size: int) -> torch.Tensor:
    """Inverse of `rank_to_device_order`."""
    ng = world_size // group_size
    return x.view(group_size, ng, -1).transpose(0, 1).reshape(-1)


# --- standalone API ---------------------------------------------------------------------------------------------
def _check_order(order: str) -> None:
    if order not in ("rank", "device"):
        raise ValueError(f"order={order!r} is not supported: use 'rank' (block r belongs to rank r, like "
                         "dist.all_gather_into_tensor) or 'device' (PaRO's device-major layout).")


def _result(out: torch.Tensor, counter: CommCounter, before: dict[str, int], user: CommCounter | None):
    delta = {k: counter.bytes[k] - before[k] for k in LINKS}
    if user is not None:
        for k, v in delta.items():
            if v:
                user.add(k, v)
    return CollectiveResult(out, delta["intra"], delta["inter"], delta["flat"])


def _run(topology, hierarchical: bool, counter: CommCounter | None, fn):
    local = CommCounter()
    comm = _Comm(topology, local, hierarchical=hierarchical)
    out = fn(comm)
    return _result(out, local, dict.fromkeys(LINKS, 0), counter)


def _write_out(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Copy a flat result into a caller-provided buffer (the shape engines such as FSDP2/DeepSpeed hand us)."""
    if out is None:
        return result
    if out.numel() != result.numel():
        raise ValueError(f"output buffer has {out.numel()} elements, the collective produces {result.numel()}.")
    out.view(-1).copy_(result)
    return out


def hierarchical_all_gather(x: torch.Tensor, topology, *, order: str = "rank",
                            counter: CommCounter | None = None, out: torch.Tensor | None = None) -> CollectiveResult:
    """PaRO-CC all-gather: AG_E then AG_I. Returns the ``n * x.numel()`` flat result and the bytes sent.

    Args:
        x (`torch.Tensor`): this rank's block (any shape; flattened).
        topology (`hf_placement.Topology`): from `hf_placement.build_topology`.
        order (`str`, *optional*, defaults to `"rank"`): block order of the output (`"rank"` or `"device"`).
        counter (`CommCounter`, *optional*): also add the bytes to this counter.
        out (`torch.Tensor`, *optional*): contiguous buffer of ``n * x.numel()`` elements to write the result into
            (the calling convention of ``dist.all_gather_into_tensor``); returned as the output.
    """
    _check_order(order)

    def fn(comm: _Comm) -> torch.Tensor:
        res = comm.ag_global(x.reshape(-1))
        if order == "rank" and not comm.identity_perm:
            if out is not None:  # reorder straight into the caller's buffer: one copy instead of two
                if out.numel() != res.numel():
                    raise ValueError(f"output buffer has {out.numel()} elements, the all-gather produces "
                                     f"{res.numel()}.")
                out.view(comm.ng, comm.m, -1).copy_(res.view(comm.m, comm.ng, -1).transpose(0, 1))
                return out
            res = device_to_rank_order(res, comm.n, comm.m)
        return _write_out(res, out)

    return _run(topology, True, counter, fn)


def hierarchical_all_gather_coalesced(xs: Sequence[torch.Tensor], topology, *, order: str = "rank",
                                      counter: CommCounter | None = None) -> list[CollectiveResult]:
    """Several PaRO-CC all-gathers with the inter-group part of the next one overlapping the intra part of this."""
    _check_order(order)
    local = CommCounter()
    comm = _Comm(topology, local, hierarchical=True)
    outs = comm.ag_global_coalesced([x.reshape(-1) for x in xs])
    if order == "rank" and not comm.identity_perm:
        outs = [device_to_rank_order(o, comm.n, comm.m) for o in outs]
    total = _result(outs[0] if outs else torch.empty(0, device='cpu'), local, dict.fromkeys(LINKS, 0), counter)
    return [CollectiveResult(o, total.intra_bytes if k == 0 else 0, total.inter_bytes if k == 0 else 0, 0)
            for k, o in enumerate(outs)]


def _check_divisible(x: torch.Tensor, n: int) -> None:
    if x.numel() % n:
        raise ValueError(f"reduce-scatter input has {x.numel()} elements, not a multiple of the world size {n}: pad "
                         "it (e.g. torch.nn.functional.pad) so every rank gets an equal block.")


def hierarchical_reduce_scatter(x: torch.Tensor, topology, *, order: str = "rank", counter: CommCounter | None = None,
                                out: torch.Tensor | None = None) -> CollectiveResult:
    """PaRO-CC reduce-scatter (sum): RS_I then RS_E. Returns this rank's block of the summed ``x``.

    ``out`` (optional): buffer of ``x.numel() / n`` elements to write the block into (the calling convention of
    ``dist.reduce_scatter_tensor``); returned as the output.
    """
    _check_order(order)
    _check_divisible(x, topology.world_size)

    def fn(comm: _Comm) -> torch.Tensor:
        flat = x.reshape(-1)
        if order == "rank" and not comm.identity_perm:
            flat = rank_to_device_order(flat, comm.n, comm.m)
        return _write_out(comm.rs_global(flat), out)

    return _run(topology, True, counter, fn)


def hierarchical_all_reduce(x: torch.Tensor, topology, *, counter: CommCounter | None = None) -> CollectiveResult:
    """PaRO-CC all-reduce (sum): RS_I, AR_E on the 1/m chunk, AG_I. Any shape; padded internally to a multiple of n."""

    def fn(comm: _Comm) -> torch.Tensor:
        flat = x.reshape(-1)
        pad = (-flat.numel()) % comm.n
        buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
        return comm.ar_global(buf)[: flat.numel()].view(x.shape)

    return _run(topology, True, counter, fn)


def flat_all_gather(x: torch.Tensor, topology, *, order: str = "rank",
                    counter: CommCounter | None = None) -> CollectiveResult:
    """Reference flat all-gather over the world group (counted as ``flat`` bytes)."""
    _check_order(order)

    def fn(comm: _Comm) -> torch.Tensor:
        out = comm._all_gather(x.reshape(-1), comm.world, comm.n, "flat")
        return rank_to_device_order(out, comm.n, comm.m) if order == "device" else out

    return _run(topology, False, counter, fn)


def flat_reduce_scatter(x: torch.Tensor, topology, *, order: str = "rank",
                        counter: CommCounter | None = None) -> CollectiveResult:
    """Reference flat reduce-scatter (sum) over the world group."""
    _check_order(order)
    _check_divisible(x, topology.world_size)

    def fn(comm: _Comm) -> torch.Tensor:
        flat = x.reshape(-1)
        if order == "device":
            flat = device_to_rank_order(flat, comm.n, comm.m)
        return comm._reduce_scatter(flat, comm.world, comm.n, "flat")

    return _run(topology, False, counter, fn)


def flat_all_reduce(x: torch.Tensor, topology, *, counter: CommCounter | None = None) -> CollectiveResult:
    """Reference flat all-reduce (sum) over the world group."""

    def fn(comm: _Comm) -> torch.Tensor:
        flat = x.reshape(-1)
        pad = (-flat.numel()) % comm.n
        buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()
        return comm._all_reduce(buf, comm.world, comm.n, "flat")[: flat.numel()].view(x.shape)

    return _run(topology, False, counter, fn)
