"""One rank of the PaRO-CC benchmark: FSDP2 full-shard or DeepSpeed ZeRO-3, with or without PaRO-CC.

Started by ``bench_paro_cc.py`` inside an emulated node (env from `EmulatedCluster.rank_env`). Prints one JSON line:
per-step wall times, this node's bytes sent through the inter-node link during the timed steps (local rank 0 reads
its veth end's tx counter; ``ip netns exec`` gives each node its own /sys), and PaRO-CC's own byte counters.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hf_placement import release_process_groups


class MLP(nn.Module):
    """Square linear layers: one FSDP unit / ZeRO fetch per layer, little compute per byte of parameters."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _tx_bytes() -> int:
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes")
    return int(path.read_text()) if iface and path.exists() else -1


def _fsdp2(model, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from paro_zero_backend.fsdp2_cc import enable_paro_cc

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = enable_paro_cc(model, group_size=args.group_size) if args.cc else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step, (handle.counter if handle else None)


def _zero3(model, args):
    import deepspeed

    from paro_zero_backend.deepspeed_cc import DeepSpeedParoCC

    deepspeed.init_distributed(dist_backend="gloo")
    cc = DeepSpeedParoCC(args.group_size).enable() if args.cc else None
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())

    def step(x):
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    return step, (cc.counter if cc else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", choices=("fsdp2", "zero3"), required=True)
    p.add_argument("--cc", type=int, default=0)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP(args.width, args.layers)
    step, counter = (_fsdp2 if args.engine == "fsdp2" else _zero3)(model, args)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    for _ in range(args.warmup):
        step(x)
    if counter is not None:
        counter.reset()
    dist.barrier()
    tx0, cpu0 = _tx_bytes(), time.process_time()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    tx1 = _tx_bytes()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    print(json.dumps({
        "rank": rank, "engine": args.engine, "cc": bool(args.cc), "step_s": times,
        "node_tx_bytes": (tx1 - tx0) if local_rank == 0 else None, "cpu_s": time.process_time() - cpu0,
        "paro_cc_bytes": dict(counter.bytes) if counter is not None else None,
        "params": sum(p.numel() for p in MLP(args.width, args.layers).parameters()),
    }), flush=True)
    release_process_groups()


if __name__ == "__main__":
    main()
