"""The shared harness and every collective the components rely on, checked with values on 2 and 4 gloo ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from hf_placement import GroupLayout, RankError, RankTimeoutError, build_topology, run_distributed
from hf_placement.testing import set_start_method

pytestmark = pytest.mark.distributed


def _check_collectives(rank: int, world: int) -> dict[str, bool]:
    checks: dict[str, bool] = {}

    # all_reduce (SUM): 1 + 2 + ... + world
    t = torch.tensor([float(rank + 1), 2.0 * (rank + 1)])
    dist.all_reduce(t)
    s = world * (world + 1) / 2
    checks["all_reduce"] = torch.equal(t, torch.tensor([s, 2 * s]))

    # all_gather_into_tensor: every rank contributes [rank*10, rank*10+1]
    out = torch.empty(2 * world)
    dist.all_gather_into_tensor(out, torch.tensor([rank * 10.0, rank * 10.0 + 1]))
    expected = torch.tensor([v for r in range(world) for v in (r * 10.0, r * 10.0 + 1)])
    checks["all_gather_into_tensor"] = torch.equal(out, expected)

    # reduce_scatter_tensor on a padded flat buffer: 7 real elements padded to a multiple of world
    real = 7
    padded = -(-real // world) * world
    flat = torch.zeros(padded)
    flat[:real] = torch.arange(real, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(padded // world)
    dist.reduce_scatter_tensor(shard, flat)
    expected_full = torch.zeros(padded)
    expected_full[:real] = torch.arange(real, dtype=torch.float32) * s
    checks["reduce_scatter_tensor_padded"] = torch.equal(shard, expected_full.chunk(world)[rank])

    # all_to_all_single: rank r sends value r*100 + dst to dst
    send = torch.tensor([rank * 100.0 + d for d in range(world)])
    recv = torch.empty(world)
    dist.all_to_all_single(recv, send)
    checks["all_to_all_single"] = torch.equal(recv, torch.tensor([src * 100.0 + rank for src in range(world)]))

    # all_to_all_single with uneven splits: rank r sends (d+1) copies of r to rank d
    in_splits = [d + 1 for d in range(world)]
    send = torch.cat([torch.full((d + 1,), float(rank)) for d in range(world)])
    out_splits = [rank + 1] * world
    recv = torch.empty(sum(out_splits))
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits)
    checks["all_to_all_single_uneven"] = torch.equal(
        recv, torch.cat([torch.full((rank + 1,), float(src)) for src in range(world)]))

    # broadcast from the last rank
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=world - 1)
    checks["broadcast"] = b.item() == world - 1

    # isend/irecv ring: send rank to the next rank
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(1)
    reqs = [dist.isend(torch.tensor([float(rank)]), nxt), dist.irecv(got, prv)]
    for r in reqs:
        r.wait()
    checks["isend_irecv"] = got.item() == prv

    # sub-groups through the topology layer: intra and inter groups of a 2-wide layout
    m = 2 if world % 2 == 0 else 1
    topo = build_topology(group_size=m)
    ti = torch.tensor([float(rank)])
    dist.all_reduce(ti, group=topo.intra_group)
    layout = GroupLayout(world, m)
    checks["intra_group"] = ti.item() == sum(layout.intra_ranks(layout.group_index(rank)))
    te = torch.tensor([float(rank)])
    dist.all_reduce(te, group=topo.inter_group)
    checks["inter_group"] = te.item() == sum(layout.inter_ranks(layout.local_index(rank)))
    checks["topology_cached"] = build_topology(group_size=m) is topo
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_with_values(world: int) -> None:
    results = run_distributed(_check_collectives, world, timeout=180)
    assert len(results) == world
    for rank, checks in enumerate(results):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: collectives with wrong values: {failed}"


def _raise_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    # the other ranks wait in a collective that rank 1 never joins: the harness must not hang on them
    t = torch.ones(1)
    dist.all_reduce(t)


def test_failing_rank_surfaces_its_error() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout=120)
    assert info.value.rank == 1
    assert info.value.exc_type == "ValueError"
    assert "boom on purpose" in str(info.value)
    assert "_raise_on_rank_one" in info.value.remote_traceback
    assert time.monotonic() - start < 100, "the failing rank should end the call long before the timeout"


def _stall_rank_zero(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_stalled_rank_is_named() -> None:
    with pytest.raises(RankTimeoutError) as info:
        run_distributed(_stall_rank_zero, 2, timeout=15)
    assert info.value.ranks == [0]


def _exit_hard(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(30)


def test_rank_that_dies_without_python_error() -> None:
    with pytest.raises(RankError) as info:
        run_distributed(_exit_hard, 2, timeout=60)
    assert info.value.rank == 1
    assert "code 3" in str(info.value)


def _environment(rank: int, world: int) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("HFSP_HARNESS_PROBE", "HFSP_HARNESS_GONE", "HFSP_HARNESS_EXTRA")}


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_see_the_callers_environment_at_the_call(method: str, monkeypatch) -> None:
    """A forkserver rank forks from a server started earlier, with the environment of that moment; the harness must
    still give each rank the caller's environment as it is at the call (variables set and removed since)."""
    monkeypatch.setenv("HFSP_HARNESS_GONE", "before")
    run_distributed(_environment, 1, timeout=120, start_method=method)  # a fork server runs from here on
    monkeypatch.setenv("HFSP_HARNESS_PROBE", "now")
    monkeypatch.delenv("HFSP_HARNESS_GONE")
    got = run_distributed(_environment, 2, timeout=120, start_method=method, env={"HFSP_HARNESS_EXTRA": "x"})
    assert got == [{"HFSP_HARNESS_PROBE": "now", "HFSP_HARNESS_GONE": None, "HFSP_HARNESS_EXTRA": "x"}] * 2


def test_unknown_start_method_is_named() -> None:
    with pytest.raises(ValueError, match="'fork' is not one of"):
        run_distributed(_environment, 2, timeout=30, start_method="fork")
    with pytest.raises(ValueError, match="'fork' is not one of"):
        set_start_method("fork")


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        GroupLayout(world_size=6, group_size=4)
    layout = GroupLayout(world_size=8, group_size=4)
    assert layout.num_groups == 2
    assert layout.intra_ranks(1) == [4, 5, 6, 7]
    assert layout.inter_ranks(2) == [2, 6]
    with pytest.raises(ValueError, match="outside"):
        layout.group_index(8)
