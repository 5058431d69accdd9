"""PaRO-CC in the engines users already run: one tiny GPT-2 loop, three back-ends, chosen on the command line.

    # FSDP2 full-shard with PaRO-CC collectives (2 emulated nodes x 2 ranks on CPU)
    torchrun --nproc_per_node 4 examples/paro_cc/train.py fsdp2 --group-size 2
    # DeepSpeed ZeRO-3 with PaRO-CC, from a DeepSpeed JSON with a "paro" section
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 4 examples/paro_cc/train.py deepspeed \
        --config examples/paro_cc/ds_zero3_paro_cc.json
    # the same JSON shape with "paro": {"strategy": "IIG"}: the whole job on the PaRO engine
    torchrun --nproc_per_node 4 examples/paro_cc/train.py deepspeed --config examples/paro_cc/ds_paro_engine.json

The "paro" section's group_size defaults to LOCAL_WORLD_SIZE (ranks per node); pass --group-size to emulate nodes
on one machine (the DeepSpeed JSONs take it in the section: "paro": {"paro_cc": true, "group_size": 2}).
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist

from hf_placement import release_process_groups
from paro_zero_backend import deepspeed_initialize, enable_paro_cc
from paro_zero_backend.ds_config import load_deepspeed_config
from paro_zero_backend.testing import make_batches, tiny_gpt2


def fsdp2(args) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = enable_paro_cc(model, group_size=args.group_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_batches(args.steps, 1, dist.get_world_size())
    for step in range(args.steps):
        ids = data[step, 0, dist.get_rank()]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(json.dumps({"backend": "fsdp2+paro_cc", "loss": float(loss.detach()), "bytes": handle.counter.bytes}))
    return float(loss.detach())


def deepspeed(args) -> float:
    cfg = load_deepspeed_config(args.config)
    if args.group_size is not None:
        cfg.setdefault("paro", {})["group_size"] = args.group_size
    if "strategy" not in cfg.get("paro", {}):
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed_initialize(model=tiny_gpt2(), config=cfg)
    gas = cfg["gradient_accumulation_steps"]
    data = make_batches(args.steps, gas, dist.get_world_size(), micro_batch=cfg["train_micro_batch_size_per_gpu"])
    for step in range(args.steps):
        for k in range(gas):
            ids = data[step, k, dist.get_rank()]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    if dist.get_rank() == 0:
        cc = getattr(engine, "paro_cc", None)
        print(json.dumps({"backend": "paro engine" if cc is None else "deepspeed+paro_cc", "loss": float(loss.detach()),
                          "bytes": cc.counter.bytes if cc is not None else engine.engine.last_step_bytes}))
    return float(loss.detach())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("backend", choices=("fsdp2", "deepspeed"))
    p.add_argument("--config", help="DeepSpeed JSON (deepspeed backend)")
    p.add_argument("--group-size", type=int, default=None, help="ranks per node (default LOCAL_WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if args.backend == "deepspeed" and not args.config:
        p.error("the deepspeed backend needs --config")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        (fsdp2 if args.backend == "fsdp2" else deepspeed)(args)
    finally:
        release_process_groups()


if __name__ == "__main__":
    main()
