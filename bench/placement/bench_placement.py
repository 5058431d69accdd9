"""PPO placement benchmark on CPU gloo ranks: every plan the planner can recommend on 2 ranks, measured side by side.

    .venv/bin/python bench/placement/bench_placement.py            # full sweep, writes bench/results/placement.json
    .venv/bin/python bench/placement/bench_placement.py --quick    # two small configurations (smoke run)

Protocol:

- pre-flight: load average and the parallel efficiency of two single-thread matmul processes
  (`hf_placement.planner.calibrate.parallel_efficiency`), stated with the results; each rank is pinned to its own
  core;
- fixed budget: 2 processes, 1 torch thread each, the same global batch, micro-batches, response length (no stop
  token: every strategy generates exactly ``response_length`` tokens), PPO epochs and seeds for every strategy;
- all strategies live in the same two processes and run their iterations interleaved (A B C D, D C B A, ...) so
  drift hits them alike; 3 warm-up rounds (with 1, the small configurations still ran 1.6-2.1x slower in their first
  timed rounds), then medians (and IQR) of >= 5 timed iterations (11 for the configurations whose iterations take
  under a second: their round-to-round spread on a shared host is up to 2x);
- strategies: the planner's candidates for 2 ranks (`hf_placement.planner.candidate_plans(2)`): ``colocated`` (TRL:
  every model on every rank, data parallel), ``colocated-sharded`` (the four models ZeRO-3-sharded, ``"GGG"``, on
  the PaRO engine), ``interleaved`` (ref on rank 0, reward on rank 1), ``interleaved-sharded`` (actor and critic
  ZeRO-3-sharded over both ranks; ref and reward each live on one rank, nothing to shard), ``disaggregated``
  (trainer rank 0, generator rank 1, synchronous: staleness 0, same update as colocated) and
  ``disaggregated-async`` (staleness 1: the next batch is generated while this one trains);
- memory cap: a per-rank model-state budget (``cap_phi`` x parameters of one model, fp32 + Adam). Every strategy is
  measured; the accountant (`hf_placement.planner.model_state_bytes`) says which fit. With the cap between 36 and
  40 Φ only plain co-location does not fit (40 Φ vs 36 Φ interleaved, 32 Φ / 16 Φ disaggregated, 20 Φ for both
  sharded plans), so the capped comparison's co-located baseline is ``colocated-sharded``;
- reported per strategy: samples/s, per-phase seconds and idle seconds per rank, analytic and measured model-state
  bytes per rank, parameter bytes all-gathered per iteration;
- planner check: `hf_placement.planner.estimate` with the CPU constant set and inputs measured INSIDE the same two
  processes, each taking its own slot in every round of the interleaved order (A B C D cal links / links cal D C B A):
  the phase times of ONE process and the link constants. Every rank holds two PPO trainers on a 1-rank group (the
  whole batch and half of it, with the placed runs' rollout chunk and training micro-batch); rank 0 runs an iteration
  of each while rank 1 waits (alone), then both ranks run one at once (concurrent). That gives `Calibration`: fixed
  and per-sample work per phase, and each phase's slowdown when both ranks compute (never the placed runs). The links
  are the ranks' own gloo group, at the sizes the plans move (`hf_placement.planner.calibrate.time_collectives`:
  latency, and all-gather and reduce-scatter bandwidth of one model's weights over the ranks) and the replicated
  plans' gradient sync timed as the trainer runs it (flatten actor + critic gradients, all-reduce, copy back). The
  planner gets the medians over the timed rounds. What each of these fixed, in earlier sweeps: calibrating in separate
  processes before and after each configuration left the planner up to 0.4 off when the host's speed moved in between;
  a matmul loop's parallel efficiency read 0.91 while two co-located ranks generated ~2x slower than one alone (base);
  link constants measured once per sweep (0.18 GB/s) predicted the sharded co-located plan 56% too slow on
  capped-large-model (measured in the loop: 0.41 GB/s, 6%), and measured at 8 MB rather than at the plans' size left
  capped-xl-model's sharded plan 28% too fast (at the plans' size: 8%); a bare all-reduce of large-model's 57 MB
  gradient bucket (0.67 GB/s, ~85 ms) left its co-located plan 20% too fast and the planner's pick 32% off, while its
  training spent ~220 ms per optimizer step beyond the single-process compute; a calibration trainer with
  micro-batches twice the placed runs' trained the whole batch ~25% faster than the disaggregated trainer does. The
  summary gives the maximum relative error and the regret of the planner's pick per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_info  # noqa: E402

PROMPT_LEN = 8
STRATEGIES = ("colocated", "colocated-sharded", "interleaved", "interleaved-sharded", "disaggregated",
              "disaggregated-async")
# the planner's candidate each strategy runs (the async one is the same plan at staleness 1)
CANDIDATE = {"disaggregated": "disaggregated-1t1i", "disaggregated-async": "disaggregated-1t1i"}
LINK_LATENCY_BYTES = 1 << 10

# One axis at a time around a base point, then the memory-capped regime at two model sizes. ``iters``: timed
# iterations; the small configurations take 11 (their 0.3-0.8 s iterations and phase times moved by up to 2x from
# one round to the next on the shared host, so 5 left medians to chance), the large ones the protocol's 5.
FULL_CONFIGS = [
    {"name": "base", "n_layer": 2, "n_embd": 128, "batch": 16, "response": 16, "cap_phi": None, "iters": 11},
    {"name": "capped-base", "n_layer": 2, "n_embd": 128, "batch": 16, "response": 16, "cap_phi": 38, "iters": 11},
    {"name": "large-model", "n_layer": 4, "n_embd": 384, "batch": 16, "response": 16, "cap_phi": None, "iters": 5},
    {"name": "capped-large-model", "n_layer": 4, "n_embd": 384, "batch": 16, "response": 16, "cap_phi": 38,
     "iters": 5},
    {"name": "long-response", "n_layer": 2, "n_embd": 128, "batch": 16, "response": 48, "cap_phi": None, "iters": 11},
    {"name": "large-batch", "n_layer": 2, "n_embd": 128, "batch": 48, "response": 16, "cap_phi": None, "iters": 11},
    {"name": "capped-xl-model", "n_layer": 6, "n_embd": 512, "batch": 8, "response": 16, "cap_phi": 38, "iters": 5},
]
QUICK_CONFIGS = [
    {"name": "base", "n_layer": 2, "n_embd": 64, "batch": 8, "response": 8, "cap_phi": None},
    {"name": "capped-base", "n_layer": 2, "n_embd": 64, "batch": 8, "response": 8, "cap_phi": 38},
]


# ---------------------------------------------------------------------------------------------------- building
def _parts(cfg: dict[str, Any]):
    from trl_trainers.testing import char_tokenizer, prompt_dataset, tiny_causal_lm, tiny_value_model

    tok = char_tokenizer()
    n = len(tok)
    kw = {"n_layer": cfg["n_layer"], "n_embd": cfg["n_embd"], "n_positions": PROMPT_LEN + cfg["response"] + 8}
    models = {"policy": tiny_causal_lm(n, 0, **kw), "value": tiny_value_model(n, 1, **kw),
              "reward": tiny_value_model(n, 2, **kw)}
    data = prompt_dataset(tok, 4 * cfg["batch"], min_len=PROMPT_LEN, max_len=PROMPT_LEN)
    return tok, models, data


def _args(cfg: dict[str, Any], out: str, world: int, rounds: int, max_staleness: int = 0):
    from trl_trainers import PPOConfig

    per_device = cfg["batch"] // world
    return PPOConfig(
        output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=2, response_length=cfg["response"], learning_rate=1e-4, total_episodes=cfg["batch"] * rounds,
        bf16=False, report_to="none", disable_tqdm=True, temperature=1.0, num_sample_generations=0,
        save_strategy="no", gradient_checkpointing=False, seed=3, stop_token=None, loss_normalization="mini_batch",
        local_rollout_forward_batch_size=max(1, cfg["batch"] // 4), placement_timeout_s=900.0,
        max_staleness=max_staleness, use_cpu=True,
    )


def _plan(strategy: str, world: int):
    """The planner's candidate plan behind ``strategy``."""
    from hf_placement.planner import candidate_plans

    return dict(candidate_plans(world))[CANDIDATE.get(strategy, strategy)]


def _count_params(cfg: dict[str, Any]) -> int:
    _, models, _ = _parts(cfg)
    return sum(p.numel() for p in models["policy"].parameters())


# ---------------------------------------------------------------------------------------------------- ranks
def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _bench_rank(rank: int, world: int, cfg: dict[str, Any], out_dir: str, warmup: int, iters: int,
                cap_bytes: float | None, phi: float) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_placement import build_topology
    from hf_placement.planner import model_state_bytes
    from hf_placement.planner.calibrate import busy_collective_latency, time_collectives
    from hf_placement.runtime import is_wait, resident_bytes
    from trl_trainers import PPOTrainer

    torch.set_num_threads(1)
    try:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    except (AttributeError, OSError):
        pass
    rounds = warmup + iters
    # The planner's single-process calibration lives in these same processes and takes its turn in the interleaved
    # order, so host drift hits the calibration and the placed runs alike (before/after calibrations in separate
    # processes read up to 1.6x apart within one configuration): every rank holds one PPO trainer on a 1-rank group
    # per batch size (whole, half); rank 0 runs one iteration of each while rank 1 waits (alone), then every rank
    # runs one at once (concurrent: the contention the placed runs meet when both ranks compute).
    solo = [dist.new_group([r]) for r in range(world)]  # created in the same order on every rank
    solo_topologies = [build_topology(group_size=1, ranks=[r]) for r in range(world)]  # the same, for the engine
    calibrators = _calibration_trainers(cfg, f"{out_dir}/calibration/rank{rank}", 2 * rounds, solo[rank])
    sharded_calibrator = _sharded_calibration_trainer(cfg, f"{out_dir}/calibration/rank{rank}", 2 * rounds,
                                                      solo[rank], solo_topologies[rank])
    cal_times: list[dict[str, float]] = []
    link_times: list[dict[str, dict[str, float]]] = []
    # Links at the sizes the plans move: one model's fp32 weights over the ranks (a sharded gather's per-rank chunk;
    # gloo's bandwidth depends on the size: a 28 MB-per-rank all-gather ran at 0.19 GB/s where 8 MB ran at 0.44, and
    # the 8 MB figure left capped-xl-model's sharded plan 28% too fast). The replicated plans' gradient sync is timed
    # as the trainer runs it (`DistContext.average_gradients`: flatten actor + critic gradients, all-reduce, copy
    # back): a bare all-reduce of large-model's 57 MB bucket took ~85 ms, the trainer's sync of it 88-144 ms.
    gather_sizes = (LINK_LATENCY_BYTES, int(4 * phi) // world)
    grad_params = [torch.nn.Parameter(torch.zeros(int(phi))) for _ in ("actor", "critic")]
    trainers = {}
    for strategy in STRATEGIES:
        tok, models, data = _parts(cfg)
        plan = _plan(strategy, world)
        args = _args(cfg, f"{out_dir}/{strategy}", world, rounds, int(strategy == "disaggregated-async"))
        t = PPOTrainer(args, tok, models["policy"], None, models["reward"], data, models["value"], placement=plan)
        t.callback_handler.callbacks = []
        trainers[strategy] = t
    res: dict[str, Any] = {s: {"iter_s": [], "phases": [], "idle_s": []} for s in STRATEGIES}
    slots = (*STRATEGIES, "calibration", "links")
    for i in range(rounds):
        order = slots if i % 2 == 0 else tuple(reversed(slots))
        for strategy in order:
            if strategy == "calibration":
                dist.barrier()
                alone = _time_calibration_round(calibrators, 2 * i + 1, sharded_calibrator) if rank == 0 else {}
                dist.barrier()
                together = _time_calibration_round(calibrators, 2 * i + 2)
                dist.barrier()
                if i >= warmup:  # generate_s -> generate_concurrent_s, generate_half_s -> generate_concurrent_half_s
                    cal_times.append({**alone, **{k.replace("_", "_concurrent_", 1): v for k, v in together.items()}})
                continue
            if strategy == "links":
                gathers = time_collectives(gather_sizes, repeats=1, ops=("p2p", "all_gather", "reduce_scatter"))
                grad_sync_s = _time_gradient_sync(grad_params)
                busy = busy_collective_latency(repeats=40, seed=i)
                if i >= warmup:
                    link_times.append({"gathers": gathers, "grad_sync_s": grad_sync_s, "busy": busy})
                continue
            t = trainers[strategy]
            first = len(t.timeline.events)
            dist.barrier()
            t0 = time.perf_counter()
            t.training_iteration(i + 1)
            dist.barrier()
            wall = time.perf_counter() - t0
            if i < warmup:
                continue
            events = t.timeline.events[first:]
            busy = _union([(e.start, e.end) for e in events if not is_wait(e.phase)])
            res[strategy]["iter_s"].append(wall)
            res[strategy]["phases"].append(dict(t.last_timings))
            res[strategy]["idle_s"].append(max(0.0, wall - busy))
    for strategy, t in trainers.items():
        t.executor.finish(rounds + 1)
        gathered = t.executor.bytes_gathered()
        analytic = model_state_bytes(t.plan, {"actor": phi}).rank_bytes(rank)
        # whole models: their live tensors; sharded roles: what their PaRO engines hold (shards, gradients, Adam)
        sharded = t.sharding.model_state_bytes()
        whole = [m for role, m in (("actor", t.model.policy), ("critic", t.model.value_model), ("ref", t.ref_model),
                                   ("reward", t.reward_model)) if role not in t.sharding.engines]
        held = resident_bytes(whole, None if "actor" in t.sharding.engines else t.optimizer) + sum(sharded.values())
        res[strategy].update(plan=t.plan.to_dict(), analytic_bytes=analytic, resident_bytes=held,
                             gathered_bytes_per_iter=gathered / rounds, trains=t.is_training_rank)
    res["calibration"], res["links"] = cal_times, link_times
    return res


def _time_gradient_sync(params: list[torch.nn.Parameter]) -> float:
    """Seconds of one gradient sync of ``params`` as the data-parallel trainer does it (median of 2 after a warm-up;
    every rank calls it)."""
    import torch.distributed as dist

    from trl_trainers._distributed import DistContext

    ctx = DistContext()
    times = []
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        dist.barrier()
        t0 = time.perf_counter()
        ctx.average_gradients(params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


# ---------------------------------------------------------------------------------------------------- single process
def _calibration_trainers(cfg: dict[str, Any], out_dir: str, rounds: int, group: Any,
                          only: str | None = None) -> dict[str, Any]:
    """Two single-process PPO trainers on ``group`` (one rank): the WHOLE batch and half of it. The planner's
    `Calibration` takes each phase at both sizes (fixed vs per-sample work). Both use the placed runs' rollout chunk
    and their training micro-batch (the co-located rank's: a quarter of the batch with 2 ranks and 2 mini-batches),
    so the whole batch trains as a disaggregated trainer holding both co-located shards does (twice the micro-batches
    of one rank), not in micro-batches twice as large (which ran ~25% faster: 0.19 vs 0.25 s, base)."""
    from trl_trainers import PPOTrainer

    out = {}
    micro = cfg["batch"] // 2 // 2  # co-located: batch / world per rank, cut into num_mini_batches=2
    for suffix, batch in (("_s", cfg["batch"]), ("_half_s", cfg["batch"] // 2)):
        if only is not None and suffix != only:
            continue
        tok, models, data = _parts(cfg)
        args = _args({**cfg, "batch": batch}, f"{out_dir}/b{batch}", 1, rounds)
        args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, batch // micro
        args.local_rollout_forward_batch_size = max(1, cfg["batch"] // 4)
        t = PPOTrainer(args, tok, models["policy"], None, models["reward"], data, models["value"], group=group)
        t.callback_handler.callbacks = []
        out[suffix] = t
    return out


def _sharded_calibration_trainer(cfg: dict[str, Any], out_dir: str, rounds: int, group: Any, topology: Any):
    """The whole-batch calibration trainer again, its policy + value model on a PaRO engine over its one rank
    (ZeRO-3 as the sharded plans run it: whole-model units kept from forward to backward). Over one rank nothing is
    communicated, so its training time minus the plain one is the engine's own work (hooks, flat-buffer copies and
    allocations), which `Calibration.train_sharded_s` adds to the sharded plans' training compute."""
    from paro_zero_backend import ParoConfig, ParoEngine
    from trl_trainers.placement import ParoBackend
    from trl_trainers.training_backend import adamw_factory

    t = _calibration_trainers(cfg, out_dir + "/sharded", rounds, group, only="_s")["_s"]
    model, value = t.model, t.model.value_model
    engine = ParoEngine(model, adamw_factory(t.args), ParoConfig(strategy="GGG", unit_module_classes=[],
                                                                 reshard_after_forward=False),
                        topology=topology, extra_units=[model.policy, getattr(value, value.base_model_prefix),
                                                        value.score])
    t.phases.backend = ParoBackend(engine)
    return t


def _time_calibration_round(calibrators: dict[str, Any], update: int, sharded: Any = None) -> dict[str, float]:
    """Generation, experience forwards and training of one PPO iteration of each calibration trainer (seconds), and
    the whole batch's training through the sharding engine (``train_sharded_s``) when ``sharded`` is given."""
    times = {}
    for suffix, t in calibrators.items():
        queries, seeds = t.local_batch(update)
        t0 = time.perf_counter()
        rollout = t.rollout(queries, seeds)
        t1 = time.perf_counter()
        t.score_rollout(rollout)
        t2 = time.perf_counter()
        exp = t.make_experience(rollout)
        t3 = time.perf_counter()
        t.train_on_experience(exp, update)
        t4 = time.perf_counter()
        times.update({"generate" + suffix: t1 - t0, "inference" + suffix: t2 - t1, "train" + suffix: t4 - t3})
        if sharded is not None and suffix == "_s":
            t5 = time.perf_counter()
            sharded.train_on_experience(exp, update)
            times["train_sharded_s"] = time.perf_counter() - t5
    return times


def _predict(cfg: dict[str, Any], plans: dict[str, dict], phi: float, calibration: Any, links: dict[str, float],
             cap_bytes: float | None) -> dict[str, dict[str, Any]]:
    from hf_placement import PlacementPlan
    from hf_placement.planner import Hardware, Workload, estimate

    # the concurrent calibration stands in for the parallel efficiency (left at 1)
    hw = Hardware.cpu(2, link_bandwidth=links["bandwidth"], link_latency_s=links["latency"],
                      reduce_scatter_bandwidth=links["reduce_scatter_bandwidth"],
                      all_reduce_bandwidth=links["all_reduce_bandwidth"], memory_cap_bytes=cap_bytes,
                      collective_overhead_s=links["collective_overhead_s"])
    out = {}
    for strategy, plan_dict in plans.items():
        staleness = 1 if strategy == "disaggregated-async" else 0
        wl = Workload(actor_params=phi, batch_size=cfg["batch"], prompt_len=PROMPT_LEN, response_len=cfg["response"],
                      ppo_epochs=2, micro_batches=2, mini_batches=2, max_staleness=staleness)
        est = estimate(PlacementPlan.from_dict(plan_dict), wl, hw, calibration, name=strategy)
        out[strategy] = {"time_s": est.time_s, "phases": est.phases, "fits": est.fits}
    return out


# ---------------------------------------------------------------------------------------------------- main
def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def preflight(seconds: float) -> dict[str, Any]:
    from hf_placement.planner.calibrate import parallel_efficiency

    load = os.getloadavg()
    eff = parallel_efficiency(2, seconds=seconds)
    flagged = eff["efficiency"] < 0.85 or load[0] > 1.0
    print(f"pre-flight: load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}, cpus {os.cpu_count()}, two "
          f"single-thread processes run at {eff['efficiency']:.2f} of 2x one process (speed-up {eff['speedup']:.2f})"
          + ("  [FLAGGED: the machine is not two free cores; wall-clock ratios are biased against strategies that "
             "keep both ranks busy]" if flagged else ""))
    return {"loadavg": list(load), "cpus": os.cpu_count(), **eff, "flagged": flagged}


def measure_link_constants() -> dict[str, float]:
    from hf_placement.planner.calibrate import measure_links

    links = measure_links(2, sizes=(1 << 10, 8 << 20), repeats=3)
    latency = links["fit"]["p2p"]["latency_s"]
    bandwidth = links["fit"]["all_gather"]["bandwidth"]  # the collective sharded plans pay on every forward
    # ... and the one they pay on every optimizer step (gloo emulates it, several times slower than the all-gather)
    rs_bandwidth = links["fit"]["reduce_scatter"]["bandwidth"]
    return {"latency": latency, "bandwidth": bandwidth, "reduce_scatter_bandwidth": rs_bandwidth, "raw": links}


def run(configs: list[dict[str, Any]], warmup: int, iters: int | None, out_path: Path, eff_seconds: float) -> dict:
    """Every configuration in turn; ``iters`` (timed iterations) overrides each configuration's own count."""
    import tempfile
    from dataclasses import fields

    from hf_placement import run_distributed
    from hf_placement.planner import Calibration, compare_to_measured
    from hf_placement.planner.calibrate import fit_links

    start = time.perf_counter()
    pre = preflight(eff_seconds)
    links = measure_link_constants()
    print(f"links (gloo, loopback): latency {links['latency'] * 1e3:.2f} ms, all-gather bandwidth "
          f"{links['bandwidth'] / 1e9:.2f} GB/s")
    results = []
    for cfg in configs:
        phi = float(_count_params(cfg))
        cap = cfg["cap_phi"] * phi if cfg["cap_phi"] else None
        n_iters = iters or cfg.get("iters", 5)
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_distributed(_bench_rank, 2, cfg, tmp, warmup, n_iters, cap, phi, timeout=1800)
        # per round: rank 0's times alone; under contention, the slower rank's (the placed runs wait for it)
        cal_rounds = [{k: max(r["calibration"][i].get(k, 0.0) for r in ranks) for k in ranks[0]["calibration"][i]}
                      for i in range(n_iters)]
        cal = {k: statistics.median(r[k] for r in cal_rounds) for k in cal_rounds[0]}
        calibration = Calibration(**{f.name: cal[f.name] for f in fields(Calibration) if f.name in cal})
        # the gradient sync as an all-reduce bandwidth in the cost model's convention (2 (n-1)/n x bytes / time)
        grad_bytes = 2 * 4 * phi
        # the busy-collective cost: each round's mean over both ranks (the early rank waits for the late one)
        link_rounds = [{**fit_links(r0["gathers"], 2), "all_reduce": {"seconds": r0["grad_sync_s"],
                                                                       "bandwidth": grad_bytes / r0["grad_sync_s"]},
                        "busy": {"mean": statistics.fmean(r["links"][k]["busy"]["mean"] for r in ranks),
                                 "per_rank": [r["links"][k]["busy"] for r in ranks]}}
                       for k, r0 in enumerate(ranks[0]["links"])]
        links_used = {"latency": statistics.median(f["p2p"]["latency_s"] for f in link_rounds),
                      "bandwidth": statistics.median(f["all_gather"]["bandwidth"] for f in link_rounds),
                      "all_reduce_bandwidth": statistics.median(f["all_reduce"]["bandwidth"] for f in link_rounds),
                      "reduce_scatter_bandwidth": statistics.median(f["reduce_scatter"]["bandwidth"]
                                                                    for f in link_rounds),
                      # the mean over every round's bursts: the expected cost of one collective between computations
                      "collective_overhead_s": statistics.fmean(f["busy"]["mean"] for f in link_rounds)}
        entry: dict[str, Any] = {"config": {**cfg, "params_per_model": phi, "cap_bytes": cap,
                                            "prompt_len": PROMPT_LEN, "iters": n_iters},
                                 "calibration": cal, "calibration_rounds": cal_rounds,
                                 "concurrent_slowdown": {p: calibration.concurrent_slowdown(p)
                                                         for p in ("generate", "inference", "train")},
                                 "links": {"used": links_used, "rounds": link_rounds}, "strategies": {}}
        for s in STRATEGIES:
            # iteration wall time = max over ranks of the barrier-to-barrier time (equal up to barrier skew)
            walls = [max(r[s]["iter_s"][i] for r in ranks) for i in range(n_iters)]
            med = statistics.median(walls)
            phase_names = sorted({p for r in ranks for it in r[s]["phases"] for p in it})
            per_rank = []
            for r in ranks:
                per_rank.append({
                    "phases_s": {p: statistics.median([it.get(p, 0.0) for it in r[s]["phases"]]) for p in phase_names},
                    "idle_s": statistics.median(r[s]["idle_s"]), "analytic_model_state_bytes": r[s]["analytic_bytes"],
                    "resident_model_state_bytes": r[s]["resident_bytes"],
                    "gathered_bytes_per_iter": r[s]["gathered_bytes_per_iter"], "trains": r[s]["trains"]})
            entry["strategies"][s] = {
                "iter_s_median": med, "iter_s_iqr": _iqr(walls), "iter_s": walls,
                "samples_per_s": cfg["batch"] / med, "tokens_per_s": cfg["batch"] * cfg["response"] / med,
                "plan": ranks[0][s]["plan"], "sharded": bool(ranks[0][s]["plan"]["sharded_roles"]),
                "ranks": per_rank}
        plans = {s: entry["strategies"][s]["plan"] for s in STRATEGIES}
        entry["predicted"] = _predict(cfg, plans, phi, calibration, links_used, cap)
        measured = {s: entry["strategies"][s]["iter_s_median"] for s in STRATEGIES}
        predicted = {s: entry["predicted"][s]["time_s"] for s in STRATEGIES}
        fitting = [s for s in STRATEGIES if entry["predicted"][s]["fits"]]
        # errors over every measured plan; the pick (and its regret) among the plans that fit the cap, as the
        # planner ranks them
        entry["planner"] = compare_to_measured(predicted, measured)
        pick = compare_to_measured({s: predicted[s] for s in fitting}, {s: measured[s] for s in fitting})
        entry["planner"].update(pick=pick["pick"], measured_best=pick["measured_best"],
                                pick_regret=pick["pick_regret"], candidates=fitting)
        # the co-located baseline: plain co-location, or its sharded form where plain co-location breaks the cap
        baseline = "colocated" if entry["predicted"]["colocated"]["fits"] else "colocated-sharded"
        col = entry["strategies"][baseline]["samples_per_s"]
        entry["colocated_baseline"] = baseline
        entry["vs_colocated"] = {s: entry["strategies"][s]["samples_per_s"] / col for s in STRATEGIES}
        results.append(entry)
        _print_config(entry)
        report = _report(results, pre, links, warmup, start, complete=len(results) == len(configs))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1, default=float))  # after every configuration
    _print_summary(report["summary"], out_path)
    return report


STEADY_IQR = 0.25


def _steady(e: dict[str, Any]) -> bool:
    """Did the host hold still for this configuration: every strategy's IQR within `STEADY_IQR` of its median."""
    return all(m["iter_s_iqr"] <= STEADY_IQR * m["iter_s_median"] for m in e["strategies"].values())


def _report(results: list[dict], pre: dict, links: dict, warmup: int, start: float,
            complete: bool) -> dict[str, Any]:
    import transformers

    capped = [e for e in results if e["config"]["cap_phi"]]
    uncapped = [e for e in results if not e["config"]["cap_phi"]]
    def others(e: dict[str, Any]) -> list[str]:
        """Interleaved and disaggregated plans that fit the cap (the co-located ones are the baseline); without a
        cap only the unsharded ones (nobody shards a plan that fits)."""
        capped = bool(e["config"]["cap_phi"])
        return [s for s in STRATEGIES if not s.startswith("colocated") and e["predicted"][s]["fits"]
                and (capped or not e["strategies"][s]["sharded"])]

    summary = {
        "capped_best_vs_colocated": max((max(e["vs_colocated"][s] for s in others(e)) for e in capped),
                                        default=None),
        "capped_best_vs_colocated_per_config": {e["config"]["name"]: max(e["vs_colocated"][s] for s in others(e))
                                                for e in capped},
        # what sharding costs where it is needed: the sharded co-located baseline against plain co-location
        # measured in the same rounds (it breaks the cap, but it runs on this host)
        "capped_colocated_sharded_vs_unsharded": {
            e["config"]["name"]: e["strategies"]["colocated-sharded"]["samples_per_s"]
            / e["strategies"]["colocated"]["samples_per_s"] for e in capped},
        # the sharding engine's own work on one rank: training through it / plain training (Calibration)
        "sharding_engine_train_factor": {e["config"]["name"]: e["calibration"]["train_sharded_s"]
                                         / e["calibration"]["train_s"] for e in results},
        "uncapped_worst_vs_colocated": min((min(e["vs_colocated"][s] for s in others(e)) for e in uncapped),
                                           default=None),
        "uncapped_sharded_vs_colocated": {e["config"]["name"]: {s: e["vs_colocated"][s] for s in
                                                                ("colocated-sharded", "interleaved-sharded")}
                                          for e in uncapped},
        "uncapped_worst_vs_colocated_sync_only": min(
            (min(e["vs_colocated"][s] for s in ("interleaved", "disaggregated")) for e in uncapped), default=None),
        "planner_max_rel_error": max(e["planner"]["max_rel_error"] for e in results),
        "planner_pick_regret": max(e["planner"]["pick_regret"] for e in results),
        # How much of the error is the host: every prediction's error, and the maximum over the configurations
        # whose measurements were steady (every strategy's IQR within STEADY_IQR of its median).
        "planner_median_rel_error": statistics.median(abs(x) for e in results
                                                      for x in e["planner"]["rel_error"].values()),
        "planner_max_rel_error_steady": max((e["planner"]["max_rel_error"] for e in results if _steady(e)),
                                            default=None),
        "steady_configs": [e["config"]["name"] for e in results if _steady(e)],
        "interleaved_fewer_model_state_bytes": all(
            max(r["analytic_model_state_bytes"] for r in e["strategies"]["interleaved"]["ranks"])
            < max(r["analytic_model_state_bytes"] for r in e["strategies"]["colocated"]["ranks"])
            for e in uncapped),
        "parallel_efficiency": pre["efficiency"],
        "preflight_flagged": pre["flagged"],
        "wall_s": time.perf_counter() - start,
        "complete": complete,
    }
    report = {
        "summary": summary,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "transformers": transformers.__version__, "cpu": cpu_info()},
        "preflight": pre, "links": {k: v for k, v in links.items() if k != "raw"}, "links_raw": links["raw"],
        "protocol": {"processes": 2, "threads_per_process": 1, "warmup_rounds": warmup,
                     "timed_iterations": {e["config"]["name"]: e["config"]["iters"] for e in results},
                     "order": "interleaved A B C D E F cal links / links cal F E D C B A", "ppo_epochs": 2,
                     "num_mini_batches": 2,
                     "prompt_len": PROMPT_LEN, "stop_token": None, "strategies": list(STRATEGIES)},
        "configs": results,
    }
    return report


def _print_config(e: dict[str, Any]) -> None:
    c = e["config"]
    cap = f"cap {c['cap_phi']} Φ = {c['cap_bytes'] / 1e6:.1f} MB" if c["cap_phi"] else "no cap"
    print(f"\n== {c['name']}: {c['params_per_model'] / 1e6:.2f} M params/model, batch {c['batch']}, response "
          f"{c['response']}, {cap}")
    print(f"{'strategy':<30}{'iter s':>8}{'IQR':>7}{'pred s':>8}{'samples/s':>10}{'vs col':>7}  "
          f"{'state MB r0/r1':>15}{'gathered MB':>12}  phases r0 | r1 (s), idle r0/r1")
    for s, v in e["strategies"].items():
        r0, r1 = v["ranks"]
        ph = " | ".join(", ".join(f"{k} {x:.2f}" for k, x in r["phases_s"].items() if x >= 0.01) for r in (r0, r1))
        name = s + ("" if e["predicted"][s]["fits"] else " (over cap)")
        print(f"{name:<30}{v['iter_s_median']:>8.2f}{v['iter_s_iqr']:>7.2f}{e['predicted'][s]['time_s']:>8.2f}"
              f"{v['samples_per_s']:>10.2f}{e['vs_colocated'][s]:>7.2f}  "
              f"{r0['analytic_model_state_bytes'] / 1e6:>7.1f}/{r1['analytic_model_state_bytes'] / 1e6:<7.1f}"
              f"{(r0['gathered_bytes_per_iter']) / 1e6:>12.1f}  {ph}; idle {r0['idle_s']:.2f}/{r1['idle_s']:.2f}")
    sd, lk = e["concurrent_slowdown"], e["links"]["used"]
    print(f"planner inputs (medians over the rounds): slowdown with both ranks busy generate {sd['generate']:.2f}, "
          f"inference {sd['inference']:.2f}, train {sd['train']:.2f}; all-gather {lk['bandwidth'] / 1e9:.2f} GB/s, "
          f"reduce-scatter {lk['reduce_scatter_bandwidth'] / 1e9:.2f}, all-reduce "
          f"{lk['all_reduce_bandwidth'] / 1e9:.2f} GB/s, latency {lk['latency'] * 1e3:.2f} ms, collective after "
          f"compute {lk['collective_overhead_s'] * 1e3:.2f} ms")
    p = e["planner"]
    print(f"planner: pick {p['pick']}, measured best {p['measured_best']} (among plans within the cap), regret "
          f"{p['pick_regret']:.1%}, max rel error {p['max_rel_error']:.1%}; co-located baseline "
          f"{e['colocated_baseline']}")


def _fmt_value(v: Any) -> str:
    if isinstance(v, dict):
        return "(" + ", ".join(f"{k} {_fmt_value(x)}" for k, x in v.items()) + ")"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _print_summary(summary: dict[str, Any], out_path: Path) -> None:
    print("\nsummary:")
    for k, v in summary.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a} {_fmt_value(b)}" for a, b in v.items())
        elif isinstance(v, list):
            v = ", ".join(map(str, v))
        elif isinstance(v, float):
            v = f"{v:.3f}"
        print(f"  {k}: {v}")
    print(f"wrote {out_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small configurations (smoke run)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up rounds (not timed)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations per strategy in every configuration (default: each configuration's "
                             "own, 5 or 11; >= 5 for the protocol)")
    parser.add_argument("--only", nargs="*", help="run only these configuration names")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "placement.json")
    parser.add_argument("--efficiency-seconds", type=float, default=0.5,
                        help="seconds of each matmul loop of the pre-flight's 3 parallel-efficiency rounds")
    ns = parser.parse_args(argv)
    if (ns.iters is not None and ns.iters < 1) or ns.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    configs = QUICK_CONFIGS if ns.quick else FULL_CONFIGS
    if ns.only:
        configs = [c for c in configs if c["name"] in ns.only]
        if not configs:
            parser.error(f"--only matched no configuration; names: {[c['name'] for c in FULL_CONFIGS]}")
    run(configs, ns.warmup, ns.iters, ns.out, ns.efficiency_seconds)


if __name__ == "__main__":
    main()
