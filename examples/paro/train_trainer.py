"""Causal-LM fine-tuning of a tiny GPT-2 with `ParoTrainer` (PaRO-DP under `transformers.Trainer`).

Run on CPU with 2 processes (PaRO settings from the YAML file; `accelerate launch` rejects PaRO keys in its own config):

    PARO_CONFIG_FILE=examples/paro/paro.yaml accelerate launch --multi_gpu --num_processes 2 \
        examples/paro/train_trainer.py --output_dir /tmp/paro_trainer

(`--multi_gpu` selects Accelerate's torchrun launcher; with no GPU the script runs on CPU/gloo because it sets
`use_cpu`; Accelerate's own `--cpu` multi-process path needs mpirun), or
`torchrun --nproc_per_node 2 examples/paro/train_trainer.py`. The final weights are written with
`save_model` (collective gather, safetensors) and reloaded with `from_pretrained` as a check.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from accelerate_plugins import ParoPlugin, ParoTrainer


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences: enough to show the loss falling without downloading a data set."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(1, vocab, (8, seq_len), generator=g)  # 8 patterns repeated: learnable
        self.ids = base[torch.arange(n) % 8]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="/tmp/paro_trainer")
    parser.add_argument("--strategy", default=None, help="override the PaRO strategy (else PARO_* / file / IIG)")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--use_cpu", action="store_true", help="set under torchrun on a CPU-only machine")
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=cli.output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             num_train_epochs=cli.epochs, learning_rate=3e-3, logging_steps=2, save_strategy="epoch",
                             report_to=[], use_cpu=cli.use_cpu or not torch.cuda.is_available(), disable_tqdm=True)
    plugin = ParoPlugin.from_env(**({"strategy": cli.strategy} if cli.strategy else {}))
    trainer = ParoTrainer(model=model, args=args, train_dataset=RandomTokens(64, 16, 64), paro_plugin=plugin)
    trainer.train()
    final = os.path.join(cli.output_dir, "final")
    trainer.save_model(final)  # every rank: collective gather; the main process writes
    if trainer.is_world_process_zero():
        reloaded = GPT2LMHeadModel.from_pretrained(final)
        losses = [round(h["loss"], 3) for h in trainer.state.log_history if "loss" in h]
        print(f"strategy {trainer.paro_engine.strategy}: losses {losses}; reloaded "
              f"{sum(p.numel() for p in reloaded.parameters())} parameters from {final}")


if __name__ == "__main__":
    main()
