"""Tour part: PPO (TRL 1.12's API) teaches a tiny GPT-2 to emit a rewarded character, from a programmatic reward."""

from __future__ import annotations

import tempfile

COMPONENT = "trl_trainers"
DESCRIPTION = "PPOTrainer, tiny GPT-2, reward = count of 'z' in 8 sampled chars, 14 iterations"


def run() -> str:
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
    with tempfile.TemporaryDirectory() as out:
        args = PPOConfig(
            output_dir=out, per_device_train_batch_size=16, num_ppo_epochs=4, num_mini_batches=2, response_length=8,
            learning_rate=3e-3, total_episodes=16 * 14, temperature=1.0, kl_coef=0.01, bf16=False,
            gradient_checkpointing=False, report_to="none", disable_tqdm=True, num_sample_generations=0,
            save_strategy="no", seed=3,
        )
        trainer = PPOTrainer(
            args, tok, tiny_causal_lm(len(tok)), None, TargetTokenRewardModel(tok.convert_tokens_to_ids("z")),
            prompt_dataset(tok, 64, exclude="z"), tiny_value_model(len(tok), seed=1),
        )
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if type(c).__name__ != "PrinterCallback"]
        trainer.train()
    scores = [h["objective/scores"] for h in trainer.state.log_history]
    t = trainer.timings
    return (f"mean reward {scores[0]:.2f} -> {scores[-1]:.2f} (max 8); time gen/exp/train "
            f"{t['generation']:.1f}/{t['experience']:.1f}/{t['training']:.1f} s")
