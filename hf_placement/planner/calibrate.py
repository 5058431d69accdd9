"""Micro-benchmarks that feed the planner's constants on this machine: links and parallel efficiency.

- `measure_links`: latency and bandwidth of point-to-point sends, broadcasts and all-gathers between gloo ranks
  (the ``α`` and ``β`` of the cost model). On loopback the three differ a lot (gloo's all-gather is far slower
  per byte than its broadcast), so the planner's single ``β`` should come from the collective that dominates the
  plan being priced.
- `time_collectives` / `fit_links`: the same measurement inside ranks that are already running (the placement
  benchmark takes it between the strategies' iterations, so the constants see the host the runs see).
- `parallel_efficiency`: throughput of ``n`` concurrent single-thread matmul loops relative to ``n`` times one loop.
  A benchmark states it before any comparison: on a shared or oversubscribed machine two processes
  do not get two cores, which biases wall-clock comparisons against schedules that keep every rank busy.

Both are plain measurements: they print and return numbers, they assert nothing.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["COLLECTIVES", "busy_collective_latency", "fit_links", "measure_links", "parallel_efficiency", "spin_for",
           "time_collectives"]


COLLECTIVES = ("p2p", "broadcast", "all_gather", "reduce_scatter", "all_reduce")


def time_collectives(sizes: Sequence[int], repeats: int, group: Any = None, timeout_s: float = 120.0,
                     ops: Sequence[str] = COLLECTIVES, device: Any = None) -> dict[str, dict[str, float]]:
    """Median seconds per size of each of ``ops``: a p2p transfer (one way, between the group's first two ranks), a
    broadcast, an all-gather, a reduce-scatter and an all-reduce (``size`` bytes per rank), in ranks that are
    already running: every rank of ``group`` (default: the world) calls it with the same arguments. `measure_links`
    runs it in fresh processes; the placement benchmark runs it in its own ranks, between the strategies'
    iterations, so the link constants see the same host as the runs they price. ``device``: where the buffers live;
    defaults to the accelerator the group's backend serves (NCCL's GPUs), else the CPU
    (`hf_placement.collective_device` with ``accelerator_first``)."""
    import torch
    import torch.distributed as dist

    from ..topology import check_collective_device, collective_device

    unknown = set(ops) - set(COLLECTIVES)
    if unknown:
        raise ValueError(f"unknown collectives {sorted(unknown)}; choose from {COLLECTIVES}.")
    from ..topology import all_gather_single as all_gather
    from ..topology import reduce_scatter_single as reduce_scatter
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device(device) if device is not None else collective_device(group, accelerator_first=True)
    check_collective_device(device, group, "the timing buffer")
    if world < 2:
        raise ValueError(f"timing collectives needs a group of >= 2 ranks, got {world}.")
    first, second = (dist.get_global_rank(group, r) if group is not None else r for r in (0, 1))
    timeout = datetime.timedelta(seconds=timeout_s)

    def p2p(buf: torch.Tensor, gathered: torch.Tensor) -> None:  # a round trip; halved below
        if rank == 0:
            dist.isend(buf, dst=second, tag=11).wait(timeout=timeout)
            dist.irecv(buf, src=second, tag=12).wait(timeout=timeout)
        elif rank == 1:
            dist.irecv(buf, src=first, tag=11).wait(timeout=timeout)
            dist.isend(buf, dst=first, tag=12).wait(timeout=timeout)

    run = {"p2p": p2p,
           "broadcast": lambda buf, gathered: dist.broadcast(buf, src=first, group=group),
           "all_gather": lambda buf, gathered: all_gather(gathered, buf, group=group),
           "reduce_scatter": lambda buf, gathered: reduce_scatter(buf, gathered, op=dist.ReduceOp.SUM, group=group),
           "all_reduce": lambda buf, gathered: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)}
    out: dict[str, dict[str, float]] = {}
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        gathered = buf.new_empty(buf.numel() * world) if {"all_gather", "reduce_scatter"} & set(ops) else buf
        times: dict[str, list[float]] = {op: [] for op in ops}
        for _ in range(repeats + 1):  # the first round warms up connections and allocations
            for op in ops:
                dist.barrier(group=group)
                t0 = time.perf_counter()
                run[op](buf, gathered)
                times[op].append((time.perf_counter() - t0) / (2 if op == "p2p" else 1))
        out[str(nbytes)] = {k: statistics.median(v[1:]) for k, v in times.items()}
    return out


def fit_links(seconds: dict[str, dict[str, float]], world_size: int) -> dict[str, dict[str, float]]:
    """Per operation, ``latency_s`` (the smallest size's time) and ``bandwidth`` (bytes/s at the largest size, in the
    cost model's convention: ``(n-1)/n * total bytes / time`` for the all-gather and the reduce-scatter, ``2 (n-1)/n
    * bytes / time`` for the all-reduce) from `time_collectives`' medians."""
    sizes = sorted(int(k) for k in seconds)
    small, large = str(sizes[0]), str(sizes[-1])
    moved = {"p2p": sizes[-1], "broadcast": sizes[-1], "all_gather": (world_size - 1) * sizes[-1],
             "reduce_scatter": (world_size - 1) * sizes[-1],
             "all_reduce": 2 * (world_size - 1) / world_size * sizes[-1]}
    return {op: {"latency_s": seconds[small][op], "bandwidth": moved[op] / max(seconds[large][op], 1e-12)}
            for op in moved if op in seconds[large]}


def _link_rank(rank: int, world: int, sizes: Sequence[int], repeats: int) -> dict[str, dict[str, float]]:
    return time_collectives(sizes, repeats)


def measure_links(world_size: int = 2, sizes: Sequence[int] = (1 << 10, 1 << 20, 16 << 20), repeats: int = 5,
                  timeout: float = 300.0) -> dict[str, Any]:
    """Median seconds per transfer size for p2p (one way), broadcast, all-gather and reduce-scatter on ``world_size``
    gloo ranks, plus fitted ``latency_s`` (smallest size) and ``bandwidth`` (bytes/s at the largest size) per
    operation.

    For the all-gather and the reduce-scatter, bandwidth is ``(n-1)/n * total bytes / time``, the cost model's
    convention (``Hardware.link_bandwidth`` / ``Hardware.reduce_scatter_bandwidth``).
    """
    from ..testing import run_distributed

    if world_size < 2:
        raise ValueError(f"measuring links needs world_size >= 2, got {world_size}.")
    sizes = sorted(int(s) for s in sizes)
    per_rank = run_distributed(_link_rank, world_size, sizes, repeats, timeout=timeout)
    seconds = per_rank[0]
    fit = fit_links(seconds, world_size)
    return {"world_size": world_size, "sizes": sizes, "seconds": seconds, "fit": fit}


def busy_collective_latency(repeats: int = 40, burst_s: tuple[float, float] = (0.004, 0.024), group: Any = None,
                            seed: int = 0) -> dict[str, float]:
    """Seconds a tiny all-gather takes when every rank issues it right after a burst of computation (run inside
    already-running ranks; collective: every rank of ``group`` calls it with the same arguments).

    Why: a training step issues its collectives between bursts of compute, and there a collective costs more than in
    a back-to-back loop: the communication threads have gone to sleep and must be woken (on some hosts a wake-up
    waits for the next scheduler tick), and the ranks, doing the same work at slightly different speeds, arrive
    apart. `time_collectives` measures links back to back, so it misses this fixed cost, which an engine that gathers
    and reduces per unit and micro-step pays tens of times per iteration. Each burst is the same amount of work on
    every rank (matmul iterations worth a duration drawn uniformly from ``burst_s``, one sequence for all ranks), so
    the ranks' own speed differences show up as they do in training. Returns this rank's ``mean`` and ``median``
    over ``repeats`` and the back-to-back ``idle`` median.
    """
    import random

    import torch
    import torch.distributed as dist

    from ..topology import all_gather_single as gather
    from ..topology import collective_device

    n = dist.get_world_size(group)
    device = collective_device(group, accelerator_first=True)  # the links training's collectives cross
    x = torch.zeros(16, device=device)
    out = x.new_empty(16 * n)
    rng = random.Random(seed)
    # iterations per second of the reference loop, agreed on by all ranks (the slowest rank's rate)
    rate = torch.tensor([spin_for(0.05) / 0.05], device=collective_device(group))
    dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=group)
    a = torch.randn(256, 256) / 16

    def timed() -> float:
        t0 = time.perf_counter()
        gather(out, x, group=group)
        return time.perf_counter() - t0

    for _ in range(3):
        timed()
    idle = statistics.median(timed() for _ in range(10))
    busy = []
    for _ in range(repeats):
        for _ in range(max(1, int(rng.uniform(*burst_s) * float(rate)))):
            a = torch.tanh(a @ a)
        busy.append(timed())
    return {"mean": statistics.fmean(busy), "median": statistics.median(busy), "idle": idle, "repeats": repeats}


def spin_for(seconds: float) -> int:
    """Run the reference matmul loop (256 x 256, in the caller's torch threads) for ``seconds``; iterations done.

    The unit of `parallel_efficiency`; also callable inside already-running ranks, to read the efficiency of the
    ranks themselves."""
    import torch

    a = torch.randn(256, 256) / 16
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        n += 1
    return n


def _spin_worker(commands: Any, results: Any) -> None:
    """`spin_for` in one single-thread process: for each command (seconds), spin that long and report the iteration
    count; ``None`` ends the worker. It stays alive between rounds, so start-up never enters a timing."""
    import torch

    torch.set_num_threads(1)
    spin_for(0.05)
    while (seconds := commands.get()) is not None:
        results.put(spin_for(seconds))


def parallel_efficiency(processes: int = 2, seconds: float = 2.0, rounds: int = 3) -> dict[str, Any]:
    """Matmul iterations of ``processes`` concurrent single-thread loops / (``processes`` x one loop alone).

    Each of ``rounds`` rounds runs one loop alone, then all together, for ``seconds`` each, in the same live worker
    processes; the result is the median over rounds: on a shared host a single alone/together pair drifts far
    from the median (``bench/placement/README.md``)."""
    if processes < 1 or seconds <= 0 or rounds < 1:
        raise ValueError(f"need processes >= 1, seconds > 0 and rounds >= 1, got {processes}, {seconds}, {rounds}.")
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(processes)]
    results = ctx.Queue()
    procs = [ctx.Process(target=_spin_worker, args=(q, results), daemon=True) for q in commands]
    for p in procs:
        p.start()
    wait_s = seconds * 10 + 300  # spawning + importing torch can be slow on a loaded machine

    def spin(n: int) -> list[int]:
        for q in commands[:n]:
            q.put(seconds)
        return [results.get(timeout=wait_s) for _ in range(n)]

    per_round, alone, together = [], [], []
    try:
        spin(processes)  # every worker has imported torch and warmed its loop before the first timed round
        for _ in range(rounds):
            alone.append(spin(1)[0])
            together.append(float(sum(spin(processes))))
            per_round.append(together[-1] / (processes * alone[-1]) if alone[-1] else 0.0)
    finally:
        for q in commands:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    eff = statistics.median(per_round)
    return {"processes": processes, "single_iterations": statistics.median(alone),
            "concurrent_iterations": statistics.median(together), "efficiency": eff, "speedup": eff * processes,
            "rounds": per_round}
