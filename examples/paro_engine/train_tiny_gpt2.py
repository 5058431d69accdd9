"""Train a tiny GPT-2 with a PaRO strategy and print losses, bytes per step and memory by kind.

    torchrun --nproc_per_node 4 examples/paro_engine/train_tiny_gpt2.py --strategy IIG --group-size 2

Under torchrun each rank uses its GPU (``cuda:LOCAL_RANK``, NCCL) when CUDA is present, else the CPU (gloo). Without
torchrun it runs on 4 local gloo CPU ranks itself (via ``hf_placement.run_distributed``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from hf_placement import release_process_groups
from paro_zero_backend import ParoConfig, ParoEngine, resolve_strategy
from paro_zero_backend.testing import make_adamw, make_batches, tiny_gpt2


def _device() -> torch.device:
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def train(rank: int, world: int, args: argparse.Namespace) -> str:
    device = torch.device(args.device)
    model = tiny_gpt2().to(device)  # the engine keeps its buffers where the model is
    config = ParoConfig(strategy=args.strategy, group_size=args.group_size, mixed_precision=args.mixed_precision,
                        max_grad_norm=args.max_grad_norm, gradient_accumulation_steps=args.accumulation)
    resolved = resolve_strategy(config, model)  # "auto": the guideline picks, with measured bandwidths
    if resolved.guideline is not None and rank == 0:
        print(resolved.guideline.format(), flush=True)
    engine = ParoEngine(model, make_adamw(model.parameters()), resolved.config)
    data = make_batches(args.steps, args.accumulation, world)
    for step in range(args.steps):
        total = 0.0
        for k in range(args.accumulation):
            ids = data[step, k, rank].to(device)
            with engine.no_sync() if k < args.accumulation - 1 else contextlib.nullcontext():
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss / args.accumulation)
            total += float(loss.detach()) / args.accumulation
        engine.step()
        if rank == 0:
            b = engine.last_step_bytes
            print(f"step {step}: loss {total:.4f}  bytes sent intra {b['intra']}, inter {b['inter']}, "
                  f"flat {b['flat']}", flush=True)
    mem = engine.memory_bytes()
    if args.save:
        engine.save_consolidated(args.save)
    return f"rank {rank}: strategy {engine.strategy}, model-state bytes {mem}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="IIG", help="three letters from N/I/G, or 'auto'")
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=3)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--save", help="directory for a consolidated (from_pretrained-loadable) checkpoint")
    args = parser.parse_args()
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ and not dist.is_initialized():
        device = _device()
        args.device = str(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
        print(train(dist.get_rank(), dist.get_world_size(), args))
        release_process_groups()
    else:
        from hf_placement import run_distributed

        args.device = "cpu"

        for line in run_distributed(train, 4, args, timeout=600):
            print(line)


if __name__ == "__main__":
    main()
