"""``python -m paro_zero_backend advise ...``: the PaRO guideline from the command line.

Example (the paper's cluster: 4 nodes x 8 GPUs, NVLink 2000 Gbit/s, RoCE 80 Gbit/s per GPU, 10 micro-steps):

    python -m paro_zero_backend advise --num-params 7e9 --world-size 32 --group-size 8 \\
        --intra-gbps 2000 --inter-gbps 80 --accumulation-steps 10 --device-memory-gb 80 --working-memory-gb 50

Launching a training script on the engine is an integration's job: ``paro launch`` (the console script) or
``python -m accelerate_plugins launch`` runs ``accelerate launch`` with a PaRO settings file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .cost_model import DEFAULT_WORKING_MEMORY_FRACTION, GuidelineInputs, advise, estimate_compute_time_s


def count_params_from_hf_config(path: str) -> int:
    """Parameters of the causal-LM model a Hugging Face config describes (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paro_zero_backend",
                                     description="PaRO-DP tools (NeurIPS 2024 Partial Redundancy Optimizer).",
                                     epilog="`launch` lives in the Accelerate integration: `paro launch --help` or "
                                            "`python -m accelerate_plugins launch --help`.")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("advise", help="rank the 14 PaRO strategies by predicted step time and memory",
                       description="Rank the 14 PaRO strategies with the paper's cost model: T = max(t_comm, "
                                   "t_comp), strategies that do not fit in device memory marked and ranked last.")
    size = a.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-params", type=float, help="total parameters Ψ (e.g. 7e9)")
    size.add_argument("--hf-config", help="Hugging Face config (directory, config.json or cached hub id) to count Ψ")
    a.add_argument("--trainable-fraction", type=float, default=1.0, help="Ψ'/Ψ (default 1: full training)")
    a.add_argument("--world-size", "-n", type=int, required=True, help="n: number of ranks (GPUs)")
    a.add_argument("--group-size", "-m", type=int, required=True, help="m: ranks per group (GPUs per node)")
    a.add_argument("--intra-gbps", type=float, required=True, help="B': intra-group bandwidth per rank, Gbit/s")
    a.add_argument("--inter-gbps", type=float, required=True, help="B: inter-group bandwidth per rank, Gbit/s")
    a.add_argument("--accumulation-steps", "-s", type=int, default=1, help="s: micro-steps per optimizer step")
    a.add_argument("--device-memory-gb", type=float, help="memory per device in GB (1e9 bytes); no fit check if unset")
    a.add_argument("--working-memory-gb", type=float,
                   help="activations + temporary buffers + fragmentation per device, GB (measure it: peak of one "
                        "micro-step minus model states); default "
                        f"{int(DEFAULT_WORKING_MEMORY_FRACTION * 100)} percent of device memory")
    comp = a.add_mutually_exclusive_group()
    comp.add_argument("--compute-time-s", type=float, default=None,
                      help="compute time of one optimizer step (s micro-steps), measured (~3x the forward time)")
    comp.add_argument("--tokens-per-step", type=float,
                      help="tokens per rank per optimizer step (seq x micro-batch x s): estimate the compute time "
                           "from FLOPs with --peak-tflops and --mfu")
    a.add_argument("--peak-tflops", type=float, default=312.0, help="peak TFLOP/s per device (default 312: A100 bf16)")
    a.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilisation for the estimate (default 0.4)")
    a.add_argument("--activation-checkpointing", action="store_true",
                   help="the estimate adds one forward recomputation")
    a.add_argument("--bytes-param", type=float, default=2, help="bytes per working parameter (default 2: bf16)")
    a.add_argument("--bytes-grad", type=float, default=2, help="bytes per gradient element (default 2)")
    a.add_argument("--bytes-os", type=float, default=12, help="optimizer-state bytes per trainable element (12: Adam)")
    a.add_argument("--no-paro-cc", action="store_true", help="model flat-ring global collectives instead of PaRO-CC")
    a.add_argument("--strategies", nargs="+", help="only rank these strategies")
    a.add_argument("--json", action="store_true", help="print the table as JSON")
    return parser


LAUNCH_MOVED = ("error: `launch` moved to the Accelerate integration (engines do not import integrations): run "
                "`paro launch ...` or `python -m accelerate_plugins launch ...` with the same arguments.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        print(LAUNCH_MOVED, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    num_params = args.num_params if args.num_params is not None else count_params_from_hf_config(args.hf_config)
    if not 0 < args.trainable_fraction <= 1:
        raise SystemExit(f"--trainable-fraction={args.trainable_fraction} must be in (0, 1].")
    compute = args.compute_time_s or 0.0
    try:
        if args.tokens_per_step is not None:
            compute = estimate_compute_time_s(num_params, num_params * args.trainable_fraction, args.tokens_per_step,
                                              args.peak_tflops, args.mfu, args.activation_checkpointing)
        inputs = GuidelineInputs(
            num_params=num_params, trainable_params=num_params * args.trainable_fraction, world_size=args.world_size,
            group_size=args.group_size, bandwidth_intra_gbps=args.intra_gbps, bandwidth_inter_gbps=args.inter_gbps,
            accumulation_steps=args.accumulation_steps, device_memory_gb=args.device_memory_gb,
            working_memory_gb=args.working_memory_gb, compute_time_s=compute,
            bytes_param=args.bytes_param, bytes_grad=args.bytes_grad, bytes_os=args.bytes_os,
            paro_cc=not args.no_paro_cc, candidates=args.strategies)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    table = advise(inputs)
    print(json.dumps(table.to_dict(), indent=1) if args.json else table.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
