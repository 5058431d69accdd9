"""ParoTrainer / ParoAccelerator on 2 gloo CPU ranks: the same Trainer run with PaRO (IIG with one group of 2, NIG
with groups of 1) equals the plain DDP Trainer run (losses and final weights to fp32 tolerance); save_model writes
weights that ``from_pretrained`` loads; a checkpoint resumes to the same weights as the uninterrupted run; a raw
Accelerate loop with ``accumulate()`` equals the Trainer.

All distributed work runs in ONE `run_distributed` call (spawning ranks and importing transformers is the slow part).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch

from hf_placement import run_distributed
from paro_zero_backend.testing import max_rel_diff, tiny_gpt2

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

WORLD = 2
FP32_TOL = 1e-5
LOSS_TOL = 1e-5  # absolute, on losses of ~3.7
RUNS = {"ddp": None, "IIG_m2": ("IIG", 2), "NIG_m1": ("NIG", 1)}


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq_len: int = 12, vocab: int = 61, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
                learning_rate=1e-2, weight_decay=0.1, adam_epsilon=1e-4, max_grad_norm=0.5, lr_scheduler_type="linear",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def _np(state):
    return {k: v.detach().float().numpy().copy() for k, v in state.items()}


def _train(kind, out, paro=None, **kw):
    from transformers import Trainer

    from accelerate_plugins import ParoPlugin, ParoTrainer

    model = tiny_gpt2()
    args = _args(out, **kw)
    if kind == "ddp":
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    else:
        strategy, m = paro if paro is not None else RUNS[kind]
        trainer = ParoTrainer(model=model, args=args, train_dataset=_Tokens(),
                              paro_plugin=ParoPlugin(strategy=strategy, group_size=m))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    else:
        weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    return trainer, losses, norms, _np(weights)


def _lora_model():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                                  fan_in_fan_out=True, init_lora_weights="gaussian"))


def _train_lora(kind, out):
    """LoRA: frozen base weights are only gathered (p level), trainable adapters also carry g/os (ING strategy)."""
    from transformers import Trainer

    from accelerate_plugins import ParoPlugin, ParoTrainer

    torch.manual_seed(0)
    model = _lora_model()
    args = _args(out)
    if kind == "ddp":
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
        weights = None
    else:
        trainer = ParoTrainer(model=model, args=args, train_dataset=_Tokens(),
                              paro_plugin=ParoPlugin(strategy="ING", group_size=2))
    trainer.train()
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    else:
        full = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        weights = {k: v for k, v in full.items() if "lora_" in k}
        trainer.save_model(os.path.join(out, "adapter"))
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], _np(weights)


def _accelerate_loop(out):
    """The same training through a raw ParoAccelerator loop with accumulate(), clip and a scheduler."""
    from transformers import get_linear_schedule_with_warmup

    from accelerate_plugins import ParoAccelerator, ParoPlugin

    acc = ParoAccelerator(cpu=True, gradient_accumulation_steps=2, paro_plugin=ParoPlugin(strategy="IIG"))
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2, shuffle=False)
    sched = get_linear_schedule_with_warmup(opt, 0, 4)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    losses = []
    for batch in loader:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(loss))
    acc.save_state(os.path.join(out, "state"))
    before = acc.get_state_dict(model)
    acc.load_state(os.path.join(out, "state"))
    after = acc.get_state_dict(model)
    same = all(torch.equal(before[k], after[k]) for k in before)
    return {"losses": losses, "state_roundtrip_equal": same, "weights": _np(after)}


def _accelerate_ref_loop():
    """Single-process reference of `_accelerate_loop`: both ranks' batches, loss averaged as DDP does."""
    from transformers import get_linear_schedule_with_warmup

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    sched = get_linear_schedule_with_warmup(opt, 0, 4)
    ids = _Tokens().ids.view(-1, WORLD, 2, 12)  # [step, rank, batch, seq] as the sharded loader hands them out
    for k in range(ids.shape[0]):
        for r in range(WORLD):
            (model(input_ids=ids[k, r], labels=ids[k, r]).loss / (2 * WORLD)).backward()
        if k % 2 == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            for _ in range(WORLD):  # AcceleratedScheduler steps once per process (split_batches=False)
                sched.step()
            opt.zero_grad()
    return _np({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})


def _errors():
    """Launch-dependent errors: a group size that does not divide the world, a model prepared without optimizer."""
    from accelerate_plugins import ParoAccelerator, ParoPlugin

    msgs = {}
    try:
        ParoAccelerator(cpu=True, paro_plugin=ParoPlugin(group_size=3))
    except ValueError as exc:
        msgs["group_size"] = str(exc)
    acc = ParoAccelerator(cpu=True, paro_plugin=ParoPlugin(strategy="IIG"))
    try:
        acc.prepare(tiny_gpt2())
    except ValueError as exc:
        msgs["no_optimizer"] = str(exc)
    return msgs


def _worker(rank, world_size, root):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = {"errors": _errors()}
    for kind in RUNS:
        trainer, losses, norms, weights = _train(kind, os.path.join(root, kind))
        # evaluation after training runs the forward through the engine's gather hooks
        res[kind] = {"losses": losses, "norms": norms, "weights": weights,
                     "eval_loss": trainer.evaluate(_Tokens(n=8, seed=5))["eval_loss"]}
        if kind == "IIG_m2":
            save = os.path.join(root, "saved")
            trainer.save_model(save)  # collective on every rank
            res["saved_files"] = sorted(os.listdir(save)) if rank == 0 else None
    # bf16 (TrainingArguments.bf16 -> Accelerator mixed_precision -> engine compute dtype; fp32 master weights)
    bf16_trainer, bf16_losses, _, _ = _train("IIG_m2", os.path.join(root, "bf16"), bf16=True)
    res["bf16"] = {"losses": bf16_losses, "dtype": str(bf16_trainer.paro_engine.compute_dtype)}
    # Checkpoint + resume: train 2 epochs saving every step, then resume from the mid-run checkpoint.
    ck = os.path.join(root, "ckpt")
    _, full_losses, _, full_w = _train("IIG_m2", ck, save_strategy="steps", save_steps=2)
    res["resume"] = {"full": full_w, "full_losses": full_losses}
    from accelerate_plugins import ParoPlugin, ParoTrainer

    trainer = ParoTrainer(model=tiny_gpt2(), args=_args(os.path.join(root, "ckpt2")), train_dataset=_Tokens(),
                          paro_plugin=ParoPlugin(strategy="IIG", group_size=2))
    trainer.train(resume_from_checkpoint=os.path.join(ck, "checkpoint-2"))
    res["resume"]["resumed"] = _np(trainer.accelerator.get_state_dict(trainer.model_wrapped))
    res["resume"]["resumed_losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    res["lora"] = {kind: _train_lora(kind, os.path.join(root, "lora_" + kind)) for kind in ("ddp", "paro")}
    res["accelerate"] = _accelerate_loop(root)
    if rank == 0:
        res["accelerate"]["ref"] = _accelerate_ref_loop()
    return res


@pytest.fixture(scope="module")
def results():
    root = tempfile.mkdtemp(prefix="paro_trainer_")
    out = run_distributed(_worker, WORLD, root, timeout=800)
    return out, root


def _t(d):
    return {k: torch.from_numpy(v) for k, v in d.items()}


@pytest.mark.parametrize("kind", ["IIG_m2", "NIG_m1"])
def test_trainer_paro_equals_ddp(results, kind):
    out, _ = results
    ddp, paro = out[0]["ddp"], out[0][kind]
    assert len(paro["losses"]) == len(ddp["losses"]) == 4
    np.testing.assert_allclose(paro["losses"], ddp["losses"], atol=LOSS_TOL)
    np.testing.assert_allclose(paro["norms"], ddp["norms"], rtol=1e-4)
    assert abs(paro["eval_loss"] - ddp["eval_loss"]) < LOSS_TOL
    assert max_rel_diff(_t(paro["weights"]), _t(ddp["weights"])) < FP32_TOL
    # every rank ends with the same full weights
    assert max_rel_diff(_t(out[1][kind]["weights"]), _t(paro["weights"])) == 0.0


def test_save_model_from_pretrained(results):
    from transformers import GPT2LMHeadModel

    out, root = results
    assert "model.safetensors" in out[0]["saved_files"] and "config.json" in out[0]["saved_files"]
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(root, "saved"))
    sd = {k: v for k, v in loaded.state_dict().items() if k in out[0]["IIG_m2"]["weights"]}
    assert max_rel_diff(sd, _t(out[0]["IIG_m2"]["weights"])) == 0.0
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # ties survive


def test_resume_from_checkpoint_matches_uninterrupted(results):
    out, root = results
    r = out[0]["resume"]
    assert os.path.isdir(os.path.join(root, "ckpt", "checkpoint-2", "paro_sharded"))
    # the resumed history holds the checkpoint's first two logged losses, then the two steps trained after resuming
    np.testing.assert_allclose(r["resumed_losses"], r["full_losses"], atol=LOSS_TOL)
    assert max_rel_diff(_t(r["resumed"]), _t(r["full"])) < FP32_TOL


def test_accelerate_loop_matches_reference(results):
    out, _ = results
    a = out[0]["accelerate"]
    assert a["state_roundtrip_equal"]
    assert max_rel_diff(_t(a["weights"]), _t(a["ref"])) < FP32_TOL


def test_launch_errors(results):
    out, _ = results
    errs = out[0]["errors"]
    assert "group_size=3 does not divide the world size 2" in errs["group_size"]
    assert "model and its optimizer together" in errs["no_optimizer"]


def test_lora_paro_equals_ddp_and_adapter_loads(results):
    from peft import PeftModel

    out, root = results
    (ddp_losses, ddp_w), (paro_losses, paro_w) = out[0]["lora"]["ddp"], out[0]["lora"]["paro"]
    np.testing.assert_allclose(paro_losses, ddp_losses, atol=LOSS_TOL)
    assert ddp_w and sorted(paro_w) == sorted(ddp_w)
    assert max_rel_diff(_t(paro_w), _t(ddp_w)) < FP32_TOL
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(tiny_gpt2(), os.path.join(root, "lora_paro", "adapter"))
    got = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert max_rel_diff(got, _t(paro_w)) == 0.0


def test_bf16_follows_training_arguments(results):
    out, _ = results
    assert out[0]["bf16"]["dtype"] == "torch.bfloat16"
    # bf16 compute with fp32 master weights stays close to the fp32 DDP run over these few steps
    np.testing.assert_allclose(out[0]["bf16"]["losses"], out[0]["ddp"]["losses"], atol=1e-2)
