"""A plain Accelerate training loop with `ParoAccelerator` (gradient accumulation, clipping, LR schedule, checkpoint).

    PARO_STRATEGY=NIG PARO_GROUP_SIZE=1 accelerate launch --multi_gpu --num_processes 2 examples/paro/accelerate_loop.py

(`--multi_gpu` selects Accelerate's torchrun launcher; without a GPU the script passes `cpu=True`, so the ranks use
gloo on CPU.) The loop is the ordinary Accelerate one: only the Accelerator class changes. `save_state` writes the
engine's per-rank shards (resume with the same launch), `save_model` the consolidated weights.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from accelerate_plugins import ParoAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="/tmp/paro_accelerate")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    accelerator = ParoAccelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                           eos_token_id=0))
    data = torch.randint(1, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = data[torch.arange(cli.steps * 2 * 4 * accelerator.num_processes) % 8]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 1, cli.steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for i, ids in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            accelerator.print(f"micro-step {i}: loss {loss.item():.4f}, grad norm {float(norm):.3f}")
    accelerator.save_state(os.path.join(cli.output_dir, "state"))
    accelerator.save_model(model, os.path.join(cli.output_dir, "final"))
    accelerator.print(f"strategy {model.strategy}; checkpoint and weights in {cli.output_dir}")


if __name__ == "__main__":
    main()
