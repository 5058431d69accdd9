"""``python -m hf_placement plan``: rank RLHF placement strategies by predicted iteration time under a memory cap.

``python -m hf_placement calibrate`` measures this machine's gloo links and parallel efficiency for the planner.

Example::

    python -m hf_placement plan --actor-params 26M --devices 2 --memory-cap 38x \\
        --batch-size 16 --prompt-len 16 --response-len 32 --output plan.json

``--memory-cap`` takes bytes with a unit (``900MB``, ``1.5GiB``) or a multiple of the actor's parameter count with an
``x`` suffix (``38x`` = 38 bytes per actor parameter, the memory accountant's unit).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .cost_model import Calibration, Hardware, Workload, rank_plans, to_jsonable

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_COUNT = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``26M`` -> 26e6, ``7B`` -> 7e9, ``3.7e6`` -> 3.7e6."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 26M, 7B, 3.7e6).")
    try:
        return float(m.group(1)) * _COUNT[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (e.g. 26M, 7B, 3.7e6).") from None


def parse_bytes(text: str) -> float:
    """``900MB`` -> 9e8, ``1.5GiB`` -> 1.5·2^30, ``2e9`` -> 2e9."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 900MB, 1.5GiB, 2e9).")
    try:
        return float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 900MB, 1.5GiB, 2e9).") from None


def _cap(text: str | None, actor_params: float) -> float | None:
    if text is None:
        return None
    if str(text).strip().lower().endswith("x"):
        try:
            return float(str(text).strip()[:-1]) * actor_params
        except ValueError:
            raise SystemExit(f"--memory-cap {text!r}: expected bytes (900MB) or bytes per actor parameter (38x).") \
                from None
    return parse_bytes(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hf_placement", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="rank placement strategies with the cost model",
                       description="Rank co-located / co-located-sharded / interleaved / disaggregated placements of "
                                   "the four PPO models by predicted iteration time, with model-state memory per "
                                   "device; plans over --memory-cap are marked and ranked last.")
    g = p.add_argument_group("models")
    g.add_argument("--actor-params", type=parse_count, required=True, help="actor parameters (e.g. 26M, 7B)")
    g.add_argument("--critic-params", type=parse_count, help="critic parameters (default: actor)")
    g.add_argument("--ref-params", type=parse_count, help="reference parameters (default: actor)")
    g.add_argument("--reward-params", type=parse_count, help="reward parameters (default: critic)")
    g.add_argument("--lora-fraction", type=float, help="adapter params / model params when training LoRA")
    g.add_argument("--num-layers", type=int, help="actor layers (KV cache); derived from size if unset")
    g.add_argument("--hidden-size", type=int, help="actor hidden size (KV cache); derived if unset")
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per iteration (default 16)")
    g.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    g.add_argument("--response-len", type=int, default=32, help="generated tokens (default 32)")
    g.add_argument("--ppo-epochs", type=int, default=1, help="PPO epochs (default 1)")
    g.add_argument("--micro-batches", type=int, default=4, help="micro-batches / pipeline depth (default 4)")
    g.add_argument("--mini-batches", type=int, default=1,
                   help="optimizer steps per PPO epoch, TRL's num_mini_batches (default 1)")
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", choices=("cpu", "gpu"), default="cpu",
                   help="constant set: cpu (one core per rank, fp32) or gpu (H100-class, bf16)")
    g.add_argument("--devices", type=int, required=True, help="number of devices (ranks)")
    g.add_argument("--memory-cap", help="per-device model-state cap: bytes (900MB, 80GB) or per actor param (38x)")
    g.add_argument("--link-bandwidth", type=parse_bytes, help="intra-node link bandwidth, bytes/s (e.g. 2GB)")
    g.add_argument("--inter-link-bandwidth", type=parse_bytes, help="inter-node link bandwidth, bytes/s")
    g.add_argument("--reduce-scatter-bandwidth", type=parse_bytes,
                   help="reduce-scatter bandwidth, bytes/s (default: --link-bandwidth; `calibrate` measures it)")
    g.add_argument("--all-reduce-bandwidth", type=parse_bytes,
                   help="all-reduce bandwidth, bytes/s (default: --link-bandwidth; `calibrate` measures it)")
    g.add_argument("--collective-overhead-s", type=float,
                   help="fixed seconds per collective issued between compute bursts (`calibrate` measures it)")
    g.add_argument("--devices-per-node", type=int, help="devices per node")
    g.add_argument("--peak-flops", type=float, help="peak FLOP/s per device")
    g.add_argument("--mem-bandwidth", type=parse_bytes, help="memory bandwidth per device, bytes/s")
    g = p.add_argument_group("calibration (measured on one device: whole batch, optionally half of it and while "
                             "every device runs it)")
    g.add_argument("--measured-generate-s", type=float, help="measured generation time, seconds")
    g.add_argument("--measured-inference-s", type=float, help="measured time of the four experience forwards")
    g.add_argument("--measured-train-s", type=float, help="measured actor+critic training time")
    g.add_argument("--measured-generate-half-s", type=float,
                   help="generation time on half the batch (with the whole-batch time: fixed vs per-sample work)")
    g.add_argument("--measured-inference-half-s", type=float, help="the four forwards on half the batch")
    g.add_argument("--measured-train-half-s", type=float, help="training on half the batch")
    g.add_argument("--measured-generate-concurrent-s", type=float,
                   help="generation of the whole batch on one device while every device generates at once (with the "
                        "alone time: the phase's slowdown under contention; replaces the parallel efficiency)")
    g.add_argument("--measured-inference-concurrent-s", type=float,
                   help="the four forwards, whole batch, while every device runs them at once")
    g.add_argument("--measured-train-concurrent-s", type=float,
                   help="training, whole batch, while every device trains at once")
    g.add_argument("--measured-train-sharded-s", type=float,
                   help="training, whole batch, one device, through the sharding engine (its own overhead)")
    p.add_argument("--output", type=Path, help="write the ranking as JSON here")
    c = sub.add_parser("calibrate", help="measure gloo links and parallel efficiency on this machine",
                       description="Measure p2p / broadcast / all-gather latency and bandwidth between local gloo "
                                   "ranks, and how well N single-thread processes run in parallel; the numbers feed "
                                   "`plan --link-bandwidth` / `--collective-overhead-s` and qualify any wall-clock "
                                   "comparison.")
    c.add_argument("--world-size", type=int, default=2, help="ranks for the link measurement (default 2)")
    c.add_argument("--sizes", default="1KB,1MB,16MB", help="comma-separated transfer sizes (default 1KB,1MB,16MB)")
    c.add_argument("--repeats", type=int, default=5, help="timed repeats per size (default 5)")
    c.add_argument("--seconds", type=float, default=2.0,
                   help="duration of each loop (alone, then together) of the 3 parallel-efficiency "
                   "rounds (default 2)")
    c.add_argument("--output", type=Path, help="write the measurements as JSON here")
    return parser


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..testing import run_distributed
    from .calibrate import measure_links, parallel_efficiency

    try:
        sizes = [int(parse_bytes(x)) for x in args.sizes.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        print(f"error: --sizes: {exc}", file=sys.stderr)
        return 2
    eff = parallel_efficiency(processes=args.world_size, seconds=args.seconds)
    print(f"parallel efficiency of {args.world_size} single-thread processes: {eff['efficiency']:.2f} "
          f"(speed-up {eff['speedup']:.2f}x of an ideal {args.world_size}x)")
    links = measure_links(args.world_size, sizes, repeats=args.repeats)
    print(f"{'bytes':>12}  {'p2p s':>10}  {'broadcast s':>12}  {'all_gather s':>12}")
    for size in links["sizes"]:
        t = links["seconds"][str(size)]
        print(f"{size:>12}  {t['p2p']:>10.6f}  {t['broadcast']:>12.6f}  {t['all_gather']:>12.6f}")
    for op, f in links["fit"].items():
        print(f"{op:>10}: latency {f['latency_s'] * 1e3:.3f} ms, bandwidth {f['bandwidth'] / 1e9:.3f} GB/s")
    busy = run_distributed(_busy_rank, args.world_size, timeout=300)[0]
    print(f"collective after a compute burst: {busy['mean'] * 1e3:.3f} ms on average (back to back "
          f"{busy['idle'] * 1e3:.3f} ms): plan --collective-overhead-s {busy['mean']:.4f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"parallel_efficiency": eff, "links": links, "busy_collective": busy},
                                          indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def _busy_rank(rank: int, world: int) -> dict[str, float]:
    import torch

    from .calibrate import busy_collective_latency

    torch.set_num_threads(1)
    return busy_collective_latency()


def format_table(ranking: list, actor_params: float) -> str:
    cols = ("#", "plan", "s/iter", "samples/s", "gen s", "inf s", "train s", "sync s", "max GB/dev", "B/param",
            "fits cap")
    rows = []
    for i, e in enumerate(ranking, 1):
        rows.append((str(i), e.name, f"{e.time_s:.3f}", f"{e.samples_per_s:.2f}", f"{e.phases['generate']:.3f}",
                     f"{e.phases['inference']:.3f}", f"{e.phases['train']:.3f}", f"{e.phases['sync']:.3f}",
                     f"{e.memory_max_bytes / 1e9:.3f}", f"{e.memory_max_bytes / actor_params:.1f}",
                     "yes" if e.fits else "NO (must shard)"))
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths))
    return "\n".join([line(cols), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        workload = Workload(actor_params=args.actor_params, critic_params=args.critic_params,
                            ref_params=args.ref_params, reward_params=args.reward_params,
                            batch_size=args.batch_size, prompt_len=args.prompt_len, response_len=args.response_len,
                            ppo_epochs=args.ppo_epochs, micro_batches=args.micro_batches,
                            mini_batches=args.mini_batches, num_layers=args.num_layers,
                            hidden_size=args.hidden_size, lora_fraction=args.lora_fraction)
        overrides = {k: v for k, v in {"link_bandwidth": args.link_bandwidth,
                                       "inter_link_bandwidth": args.inter_link_bandwidth,
                                       "reduce_scatter_bandwidth": args.reduce_scatter_bandwidth,
                                       "all_reduce_bandwidth": args.all_reduce_bandwidth,
                                       "collective_overhead_s": args.collective_overhead_s,
                                       "devices_per_node": args.devices_per_node, "peak_flops": args.peak_flops,
                                       "mem_bandwidth": args.mem_bandwidth}.items() if v is not None}
        overrides["memory_cap_bytes"] = _cap(args.memory_cap, args.actor_params)
        factory = Hardware.cpu if args.hardware == "cpu" else Hardware.gpu
        hardware = factory(args.devices, **overrides)
        calibration = None
        measured = {f: getattr(args, f"measured_{f}") for f in ("generate_s", "inference_s", "train_s",
                                                                 "generate_half_s", "inference_half_s",
                                                                 "train_half_s", "generate_concurrent_s",
                                                                 "inference_concurrent_s", "train_concurrent_s",
                                                                 "train_sharded_s")}
        if any(v is not None for v in measured.values()):
            calibration = Calibration(**measured)
        ranking = rank_plans(workload, hardware, calibration)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cap = hardware.memory_cap_bytes
    print(f"{hardware.name} x{hardware.devices}, {hardware.precision}, cap "
          f"{'none' if cap is None else f'{cap / 1e9:.3f} GB ({cap / args.actor_params:.1f} B/actor param)'}; "
          f"batch {workload.batch_size}, prompt {workload.prompt_len}, response {workload.response_len}")
    print(format_table(ranking, args.actor_params))
    best = next((e for e in ranking if e.fits), None)
    print(f"best: {best.name if best else 'none fits the cap'}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(to_jsonable(workload, hardware, calibration, ranking), indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        return cmd_plan(args)
    if args.command == "calibrate":
        return cmd_calibrate(args)
    return 2  # argparse enforces a known command


if __name__ == "__main__":
    sys.exit(main())
