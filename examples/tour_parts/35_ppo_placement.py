"""Tour part: the same PPO update under All-colocated and Disaggregated placement on 2 gloo ranks."""

from __future__ import annotations

import tempfile

COMPONENT = "trl_trainers.placement"
DESCRIPTION = (
    "2 gloo ranks: PPOTrainer(placement=...) colocated vs disaggregated (2 iterations, 2 mini-batches), same "
    "parameters, bit-exact shadows"
)


def _run(rank: int, world: int, output_dir: str) -> dict:
    import torch

    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.testing import (
        TargetTokenRewardModel,
        char_tokenizer,
        prompt_dataset,
        tiny_causal_lm,
        tiny_value_model,
    )

    torch.set_num_threads(1)
    tok = char_tokenizer()
    out = {}
    for placement in ("colocated", "disaggregated"):
        args = PPOConfig(
            output_dir=f"{output_dir}/{placement}", per_device_train_batch_size=4, num_ppo_epochs=2,
            response_length=6, learning_rate=3e-3, total_episodes=4 * world * 2, bf16=False, report_to="none",
            disable_tqdm=True, temperature=1.0, num_sample_generations=0, save_strategy="no",
            gradient_checkpointing=False, seed=5, stop_token="eos", loss_normalization="mini_batch",
            num_mini_batches=2, placement_timeout_s=120, use_cpu=True,  # gloo ranks on a CPU host
        )
        trainer = PPOTrainer(
            args, tok, tiny_causal_lm(len(tok), 0), None, TargetTokenRewardModel(tok.convert_tokens_to_ids("z")),
            prompt_dataset(tok, 16, exclude="z"), tiny_value_model(len(tok), 1), placement=placement,
        )
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if type(c).__name__ != "PrinterCallback"]
        trainer.train()
        busy = {k: round(v, 2) for k, v in trainer.timings.items() if k in ("generation", "training", "sync")}
        out[placement] = {"params": {k: v.detach().clone().numpy() for k, v in trainer.model.state_dict().items()},
                          "trainer": trainer.is_training_rank, "phases": busy}
    return out


def run() -> str:
    import numpy as np

    from hf_placement import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        r0, r1 = run_distributed(_run, 2, tmp, timeout=170)
    col, trained, shadow = r0["colocated"]["params"], r0["disaggregated"]["params"], r1["disaggregated"]["params"]
    diff = max(float(np.abs(trained[k] - col[k]).max()) for k in col)
    exact = all(np.array_equal(trained[k], shadow[k]) for k in trained)
    return (f"max |disaggregated - colocated| = {diff:.1e}; shadow == trainer bit-exact: {exact}; "
            f"trainer {r0['disaggregated']['phases']}, generator {r1['disaggregated']['phases']} (s)")
