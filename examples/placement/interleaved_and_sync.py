"""hf_placement under a real launcher: interleaved ref || reward dispatch and a weight sync, with a timeline.

Run on CPU with 2 or 4 processes (gloo):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/placement/interleaved_and_sync.py --out /tmp/placement_demo

The script reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the launcher (``torchrun --nnodes N`` for several
machines). Rank 0 writes ``trace.json`` (open it in chrome://tracing or https://ui.perfetto.dev) and
``timeline.png``. The demo keeps its tensors on the CPU, so it runs on gloo only.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from hf_placement import PlacementPlan, build_role_groups, release_process_groups
from hf_placement.runtime import (
    RoleCall,
    RoleHandle,
    Timeline,
    WeightSync,
    gather_timelines,
    plot_timeline,
    run_concurrently,
    summarize_timelines,
    write_chrome_trace,
)


def frozen(seed: int, out: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, out)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("placement_demo"), help="output folder (rank 0)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="timeout of every collective and transfer")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        plan = PlacementPlan.interleaved(world) if world > 1 else PlacementPlan.colocated(1)
        plan.check_batch(8 * world)
        groups = build_role_groups(plan, timeout_s=args.timeout_s)
        tl = Timeline(rank)
        # Only owners would load these weights in a real job; the local copies here check the dispatch.
        ref, reward = frozen(1, 16), frozen(2, 1)
        batch = {"x": torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))}
        calls = [RoleCall(RoleHandle(plan, "ref", timeout_s=args.timeout_s, timeline=tl),
                          lambda b: torch.log_softmax(ref(b["x"]), -1), batch),
                 RoleCall(RoleHandle(plan, "reward", timeout_s=args.timeout_s, timeline=tl),
                          lambda b: reward(b["x"]).squeeze(-1), batch)]
        for _ in range(3):
            ref_lp, score = run_concurrently(calls)
        with torch.no_grad():
            assert torch.equal(ref_lp, torch.log_softmax(ref(batch["x"]), -1)) and torch.equal(
                score, reward(batch["x"]).squeeze(-1))
        if world > 1:  # rank 0 (trainer) pushes its actor to the other ranks, as a disaggregated job would
            actor = frozen(0 if rank == 0 else 100 + rank, 16)
            sync = WeightSync(actor, src=0, dst_ranks=list(range(1, world)), strategy="broadcast",
                              group=groups.group("actor"), bucket_bytes=16 << 10, timeout_s=args.timeout_s,
                              timeline=tl)
            stats = sync.sync(version=1 if rank == 0 else None)
            expected = frozen(0, 16)
            assert all(torch.equal(a, b) for a, b in zip(actor.parameters(), expected.parameters()))
            if rank == 0:
                print(f"weight sync v{stats.version}: {stats.payload_bytes} bytes in {stats.num_buckets} buckets")
        timelines = gather_timelines(tl)
        if rank == 0:
            write_chrome_trace(args.out / "trace.json", timelines)
            plot_timeline(timelines, args.out / "timeline.png", title=f"interleaved, {world} ranks")
            summary = summarize_timelines(timelines)
            print(plan.describe())
            for r, info in summary["ranks"].items():
                print(f"rank {r}: busy {info['busy_s'] * 1e3:.1f} ms, idle {info['idle_s'] * 1e3:.1f} ms, "
                      f"{info['bytes']} bytes")
            print(f"dispatch results equal local results on every rank; wrote {args.out}/trace.json, timeline.png")
    finally:
        release_process_groups()


if __name__ == "__main__":
    main()
