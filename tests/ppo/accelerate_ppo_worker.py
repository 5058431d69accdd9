"""A TRL-order PPO script for the engine tests: config first, then models (``from_pretrained``), then the trainer.

Run it plainly (one process: the reference) or under ``accelerate launch --config_file <engine.yaml>``. It trains 3
PPO iterations on tiny GPT-2 models saved by the test under ``--models``, then writes to ``--out``:
``params.npz`` (the consolidated policy + value weights, rank 0), ``rank<r>.json`` (scores, the measured model-state
bytes, the launch engine) and, with ``--save``, the policy saved by ``trainer.save_model``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--no-ds3-gather", action="store_true")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--placement", default=None)
    parser.add_argument("--lora", action="store_true", help="LoRA policy, reference = the adapter-disabled policy")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.testing import char_tokenizer, prompt_dataset

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    # 1. config (under a ZeRO-3 launch this makes transformers build the models below already partitioned)
    args = PPOConfig(
        output_dir=str(out / "run"), per_device_train_batch_size=opts.per_device,
        gradient_accumulation_steps=opts.grad_accum, num_ppo_epochs=2, num_mini_batches=1, response_length=6,
        learning_rate=3e-3, total_episodes=8 * 3, bf16=False, report_to="none", disable_tqdm=True, temperature=1.0,
        kl_coef=0.05, num_sample_generations=0, save_strategy="no", gradient_checkpointing=False, seed=11,
        stop_token="eos", loss_normalization="mini_batch", max_grad_norm=0.0,
        ds3_gather_for_generation=not opts.no_ds3_gather, placement=opts.placement,
    )
    # 2. models and data
    models = Path(opts.models)
    tok = char_tokenizer()
    policy = AutoModelForCausalLM.from_pretrained(models / "policy")
    ref = None if opts.lora else AutoModelForCausalLM.from_pretrained(models / "policy")
    value = AutoModelForSequenceClassification.from_pretrained(models / "value", num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(models / "reward", num_labels=1)
    # 3. trainer
    peft_config = None
    if opts.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                                 task_type="CAUSAL_LM", fan_in_fan_out=True)  # GPT-2's Conv1D
        torch.manual_seed(5)  # the adapter's initial weights: the same in every process
    trainer = PPOTrainer(args, tok, policy, ref, reward, prompt_dataset(tok, 24, exclude="z"), value,
                         peft_config=peft_config)
    trainer.train()
    # the job's rank (trainer.dist is the training group's, which a disaggregated inference rank numbers from 0)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    state = trainer.backend.full_state_dict(trainer.model) if trainer.launch.is_accelerate_engine else None
    if state is None:
        with trainer.full_weights():
            state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if rank == 0:
        np.savez(out / "params.npz", **{k: v.float().numpy() for k, v in state.items()})
    report = {
        "rank": rank, "world": trainer.dist.world_size, "engine": trainer.launch.kind,
        "source": trainer.launch.source,
        "scores": [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h],
        "model_state_bytes": trainer.model_state_bytes(),
        "sharded_roles": dict(trainer.plan.sharded_roles),
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
    }
    if opts.save:
        trainer.save_model(str(out / "saved"))
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
