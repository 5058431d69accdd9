"""Tour part: RLHF placement on 2 gloo ranks (disaggregated plan, versioned weight sync, timeline) + the planner."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hf_placement import PlacementPlan, build_role_groups, run_distributed
from hf_placement.planner import Hardware, Workload, rank_plans
from hf_placement.runtime import (
    Timeline,
    WeightSync,
    gather_timelines,
    plot_timeline,
    summarize_timelines,
    write_chrome_trace,
)

COMPONENT = "hf_placement_plans"
DESCRIPTION = "2 gloo ranks: disaggregated plan, 3 weight syncs, timeline; planner under a 38 B/param cap"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def _trainer_and_shadow(rank: int, world: int, out_dir: str) -> dict:
    # The trainer (actor, rank 0) takes optimizer steps; the shadow actor (rollout, rank 1) receives the weights
    # before every "generation", alternating broadcast and bucketed point-to-point transfers.
    plan = PlacementPlan.disaggregated(world)
    groups = build_role_groups(plan, timeout_s=60)
    tl = Timeline(rank)
    model = _model(seed=0 if rank in plan.roles["actor"] else 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2) if rank in plan.roles["actor"] else None
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    dist.barrier()  # start the timeline from a common point
    total_bytes = 0
    for step, strategy in enumerate(("broadcast", "bucketed_p2p", "broadcast"), start=1):
        sync = WeightSync(model, src=plan.roles["actor"][0], dst_ranks=plan.roles["rollout"], strategy=strategy,
                          group=groups.sync_group("rollout"), bucket_bytes=64 << 10, timeout_s=60, timeline=tl)
        sync.version = step - 1 if step > 1 else None
        stats = sync.sync(version=step if rank == 0 else None)
        total_bytes += stats.payload_bytes
        if opt is not None:
            with tl.phase("train"):
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        else:
            with tl.phase("generate"), torch.no_grad():
                model(x)
    # bit-exactness: the shadow's weights after the last sync are the trainer's weights before its last step
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()  # picklable
    timelines = gather_timelines(tl)
    if rank == 0:
        write_chrome_trace(Path(out_dir) / "trace.json", timelines)
        plot_timeline(timelines, Path(out_dir) / "timeline.png", title="disaggregated: trainer rank 0, shadow rank 1")
    return {"bytes": total_bytes, "flat": flat, "summary": summarize_timelines(timelines) if rank == 0 else None}


def run() -> str:
    out_dir = tempfile.mkdtemp(prefix="hf_placement_tour_")
    trainer, shadow = run_distributed(_trainer_and_shadow, 2, out_dir, timeout=180)
    # replay the trainer on one process to get its weights after 2 steps = what the 3rd sync delivered
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    exact = shadow["flat"] == expected.numpy().tobytes()
    idle = trainer["summary"]["ranks"]
    ranking = rank_plans(Workload(actor_params=26e6, batch_size=16, prompt_len=16, response_len=32),
                         Hardware.cpu(2, memory_cap_bytes=38 * 26e6))
    print("\n".join(f"  {e.name:<22} {e.time_s:6.2f} s/iter  {e.memory_max_bytes / 26e6:4.0f} B/param  "
                    f"{'fits' if e.fits else 'must shard'}" for e in ranking))
    best = ranking[0]
    colocated = next(e for e in ranking if e.name == "colocated")
    return (f"3 syncs bit-exact={exact} ({shadow['bytes'] / 1e3:.0f} kB), idle r0/r1 "
            f"{idle[0]['idle_s']:.2f}/{idle[1]['idle_s']:.2f} s, trace+png in {out_dir}; planner @38 B/param: "
            f"best={best.name}, colocated {'fits' if colocated.fits else 'must shard'}")
