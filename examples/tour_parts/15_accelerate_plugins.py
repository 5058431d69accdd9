"""Tour part: PaRO-DP under `transformers.Trainer` (ParoTrainer) on 2 gloo ranks, IIG against NNN (DDP-equivalent)."""

from __future__ import annotations

import os
import tempfile

import torch

from hf_placement import run_distributed

COMPONENT = "accelerate_plugins"
DESCRIPTION = "ParoTrainer on 2 CPU ranks: IIG == NNN losses, from_pretrained-loadable save"


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(1, 61, (8, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(rank: int, world: int, root: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from transformers import TrainingArguments

    from accelerate_plugins import ParoPlugin, ParoTrainer
    from paro_zero_backend.testing import tiny_gpt2

    out = {}
    for strategy in ("NNN", "IIG"):
        args = TrainingArguments(output_dir=os.path.join(root, strategy), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = ParoTrainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens(),
                              paro_plugin=ParoPlugin(strategy=strategy, group_size=2))
        trainer.train()
        out[strategy] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(os.path.join(root, "final"))
    return out


def run() -> str:
    from transformers import GPT2LMHeadModel

    root = tempfile.mkdtemp(prefix="tour_paro_trainer_")
    res = run_distributed(_train, 2, root, timeout=300)[0]
    diff = max(abs(a - b) for a, b in zip(res["IIG"], res["NNN"], strict=True))
    assert diff < 1e-5, diff
    GPT2LMHeadModel.from_pretrained(os.path.join(root, "final"))
    return f"IIG losses {[round(x, 4) for x in res['IIG']]} match NNN (max diff {diff:.1e}); save_model reloads"
