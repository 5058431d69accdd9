"""2 gloo ranks with the same global batch compute the same PPO update as 1 process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

pytestmark = pytest.mark.distributed


def _train(rank: int, world_size: int, output_dir: str, per_device: int, grad_accum: int, normalization: str):
    """Module-level so spawned ranks can import it; returns the trained parameters and the logged scores."""
    torch.set_num_threads(1)
    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.testing import (
        TargetTokenRewardModel,
        char_tokenizer,
        prompt_dataset,
        tiny_causal_lm,
        tiny_value_model,
    )

    tok = char_tokenizer()
    args = PPOConfig(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=grad_accum,
        num_ppo_epochs=2, num_mini_batches=1, response_length=6, learning_rate=3e-3, total_episodes=8 * 3,
        bf16=False, report_to="none", disable_tqdm=True, temperature=1.0, kl_coef=0.05, num_sample_generations=0,
        save_strategy="no", gradient_checkpointing=False, seed=11, stop_token="eos", whiten_rewards=False,
        loss_normalization=normalization,
    )
    trainer = PPOTrainer(
        args, tok, tiny_causal_lm(len(tok), 0), None, TargetTokenRewardModel(tok.convert_tokens_to_ids("z")),
        prompt_dataset(tok, 24, exclude="z"), tiny_value_model(len(tok), 1),
    )
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ != "PrinterCallback"]
    trainer.train()
    # numpy, not tensors: tensors cross process boundaries through shared memory that dies with the rank
    params = {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}
    return params, [h["objective/scores"] for h in trainer.state.log_history], trainer.args.batch_size


def _init_params():
    from trl_trainers import PolicyAndValueWrapper
    from trl_trainers.testing import char_tokenizer, tiny_causal_lm, tiny_value_model

    n = len(char_tokenizer())
    wrapper = PolicyAndValueWrapper(tiny_causal_lm(n, 0), tiny_value_model(n, 1))
    return {k: v.detach().numpy().copy() for k, v in wrapper.state_dict().items()}


@pytest.mark.slow
def test_two_ranks_equal_one_rank(tmp_path):
    # global batch 8: one process with 2 micro-batches of 4, or 2 ranks x 4; responses have ragged lengths (EOS stop),
    # so the split-invariant "mini_batch" normalisation is what makes the update identical.
    single, single_scores, single_batch = _train(0, 1, str(tmp_path / "one"), 4, 2, "mini_batch")
    results = run_distributed(_train, 2, str(tmp_path / "two"), 4, 1, "mini_batch", timeout=280)
    (p0, scores0, batch0), (p1, scores1, _) = results
    assert single_batch == batch0 == 8
    assert scores0 == scores1 and len(scores0) == 3
    torch.testing.assert_close(torch.tensor(scores0), torch.tensor(single_scores), rtol=1e-5, atol=1e-6)
    for key in single:
        np.testing.assert_array_equal(p0[key], p1[key], err_msg=f"ranks diverged on {key}")
        # Adam divides by sqrt(v): near-zero gradients turn fp32 summation-order noise into steps of ~1e-6..1e-5,
        # so the tolerance is 0.1 % of the largest parameter change (lr 3e-3 x 6 steps), not machine epsilon.
        np.testing.assert_allclose(p0[key], single[key], rtol=1e-4, atol=2e-5, err_msg=key)
    init = _init_params()
    moved = max(np.abs(single[k] - init[k]).max() for k in single)
    assert moved > 1e-3, "training did not move the parameters; the comparison would be vacuous"
