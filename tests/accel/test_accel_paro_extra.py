"""ParoPlugin(strategy="auto") is resolved by ParoAccelerator.prepare with measured bandwidths; fp16 mixed precision
through `ParoTrainer` (TrainingArguments.fp16 -> fp16 compute with dynamic loss scaling and fp32 master weights)
stays close to the fp32 DDP run. Both on 2 gloo CPU ranks in ONE `run_distributed` call."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch

from hf_placement import run_distributed
from paro_zero_backend import GuidelineInputs, advise
from paro_zero_backend.testing import tiny_gpt2

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq_len: int = 12, vocab: int = 61, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_losses(out: str, paro: bool, **kw):
    from transformers import Trainer, TrainingArguments

    from accelerate_plugins import ParoPlugin, ParoTrainer

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             num_train_epochs=2, learning_rate=1e-2, adam_epsilon=1e-4, max_grad_norm=0.5,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, **kw)
    if paro:
        trainer = ParoTrainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens(),
                              paro_plugin=ParoPlugin(strategy="IIG", group_size=2))
    else:
        trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=_Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def _worker(rank, world_size, root):
    from dataclasses import asdict

    from accelerate_plugins import ParoAccelerator, ParoPlugin

    res = {}
    # strategy="auto" without bandwidths: prepare() times intra/inter all-gathers and feeds the guideline.
    acc = ParoAccelerator(cpu=True, gradient_accumulation_steps=4, paro_plugin=ParoPlugin(strategy="auto",
                                                                                          group_size=1))
    model = tiny_gpt2()
    engine, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    table = acc.paro_guideline
    res["auto"] = {"strategy": engine.strategy.name, "inputs": asdict(table.inputs),
                   "recommended": table.recommended}
    engine.remove_hooks()
    # Given bandwidths with a 1000x gap and a memory cap that only globally sharded optimizer states meet.
    acc2 = ParoAccelerator(cpu=True, paro_plugin=ParoPlugin(
        strategy="auto", group_size=1, bandwidth_intra_gbps=1000.0, bandwidth_inter_gbps=1.0,
        device_memory_gb=1e-9, working_memory_gb=0.0))
    model = tiny_gpt2()
    try:
        acc2.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    except ValueError as exc:
        res["auto_no_fit"] = str(exc)
    # fp16 through the Trainer against the fp32 DDP run
    _, ddp = _trainer_losses(os.path.join(root, "ddp"), paro=False)
    trainer, fp16 = _trainer_losses(os.path.join(root, "fp16"), paro=True, fp16=True)
    eng = trainer.paro_engine
    res["fp16"] = {"ddp": ddp, "fp16": fp16, "dtype": str(eng.compute_dtype), "loss_scale": eng.loss_scale,
                   "master_dtype": str(next(b.master for b in eng.buckets if b.trainable).dtype)}
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, tempfile.mkdtemp(prefix="paro_extra_"), timeout=500)


def test_auto_strategy_uses_measured_bandwidths(results):
    auto = results[0]["auto"]
    inputs = auto["inputs"]
    # groups of 1: the inter-group link (between the two ranks) was measured; both ranks agree on the figures
    assert inputs["bandwidth_inter_gbps"] > 0 and inputs["world_size"] == 2 and inputs["group_size"] == 1
    assert inputs["accumulation_steps"] == 4  # the Accelerator's gradient accumulation reached the guideline
    assert results[1]["auto"]["inputs"]["bandwidth_inter_gbps"] == inputs["bandwidth_inter_gbps"]
    assert auto["strategy"] == auto["recommended"] == results[1]["auto"]["strategy"]
    inputs.pop("effective_working_memory_gb", None)
    assert advise(GuidelineInputs(**inputs)).recommended == auto["strategy"]


def test_auto_strategy_with_nothing_fitting_is_a_clear_error(results):
    msg = results[0]["auto_no_fit"]
    assert "no PaRO strategy fits in device_memory_gb" in msg and "raise the memory" in msg


def test_fp16_trainer_close_to_fp32_ddp(results):
    out = results[0]["fp16"]
    assert out["dtype"] == "torch.float16" and out["master_dtype"] == "torch.float32"
    assert out["loss_scale"] > 1.0  # dynamic loss scaling is active
    assert len(out["fp16"]) == len(out["ddp"]) == 4
    np.testing.assert_allclose(out["fp16"], out["ddp"], atol=2e-2)
