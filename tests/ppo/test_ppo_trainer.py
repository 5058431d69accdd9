"""PPOTrainer behaviour on tiny local models: learning, errors, checkpoints, LoRA, logging, completions."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import TrainerCallback

from trl_trainers import PPOConfig, PPOTrainer
from trl_trainers.testing import (
    TargetTokenRewardModel,
    char_tokenizer,
    prompt_dataset,
    tiny_causal_lm,
    tiny_value_model,
)

torch.set_num_threads(1)


def _args(tmp_path, **overrides) -> PPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, gradient_accumulation_steps=1,
        num_ppo_epochs=2, num_mini_batches=1, response_length=6, learning_rate=3e-3, total_episodes=8 * 3,
        bf16=False, report_to="none", disable_tqdm=True, temperature=1.0, kl_coef=0.01, num_sample_generations=0,
        save_strategy="no", gradient_checkpointing=False, seed=3,
    )
    base.update(overrides)
    return PPOConfig(**base)


def _parts(seed=0):
    tok = char_tokenizer()
    target = tok.convert_tokens_to_ids("z")
    return tok, tiny_causal_lm(len(tok), seed), TargetTokenRewardModel(target), tiny_value_model(len(tok), seed + 1), \
        prompt_dataset(tok, 32, exclude="z")


def _trainer(tmp_path, callbacks=None, peft_config=None, ref_model=None, **overrides):
    tok, policy, reward, value, ds = _parts()
    return PPOTrainer(_args(tmp_path, **overrides), tok, policy, ref_model, reward, ds, value,
                      eval_dataset=ds.select(range(8)), callbacks=callbacks, peft_config=peft_config)


def _quiet(trainer):
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ != "PrinterCallback"]
    return trainer


TRL_METRICS = {
    "eps", "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
    "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
    "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "lr", "episode",
}


def test_config_defaults_match_trl_1_12():
    args = PPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True)  # bf16 default needs use_cpu on CPU
    expected = dict(
        dataset_num_proc=None, num_mini_batches=1, total_episodes=None, local_rollout_forward_batch_size=64,
        num_sample_generations=10, response_length=53, stop_token=None, stop_token_id=None, temperature=0.7,
        missing_eos_penalty=None, sft_model_path="EleutherAI/pythia-160m", reward_model_path="EleutherAI/pythia-160m",
        model_adapter_name=None, ref_adapter_name=None, num_ppo_epochs=4, whiten_rewards=False, kl_coef=0.05,
        kl_estimator="k1", cliprange=0.2, vf_coef=0.1, cliprange_value=0.2, gamma=1.0, lam=0.95,
        ds3_gather_for_generation=True, push_to_hub=False, learning_rate=3e-6, logging_steps=10,
        gradient_checkpointing=True, bf16=True,
    )
    assert {k: getattr(args, k) for k in expected} == expected
    assert PPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True,
                     gradient_checkpointing=False).gradient_checkpointing \
        is False


@pytest.mark.parametrize("field,value,match", [
    ("kl_estimator", "k2", "kl_estimator"),
    ("stop_token", "bos", "stop_token"),
    ("num_mini_batches", 0, "num_mini_batches"),
    ("missing_eos_penalty", -1.0, "missing_eos_penalty"),
])
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, **{field: value})


def test_bad_inputs_get_clear_errors(tmp_path):
    tok, policy, reward, value, ds = _parts()
    args = _args(tmp_path)
    with pytest.raises(ValueError, match="same object"):
        PPOTrainer(args, tok, policy, policy, reward, ds, value)
    with pytest.raises(ValueError, match="input_ids"):
        PPOTrainer(args, tok, policy, None, reward, ds.rename_column("input_ids", "prompt"), value)
    with pytest.raises(ValueError, match="pad token"):
        PPOTrainer(args, char_tokenizer(pad_token=None), policy, None, reward, ds, value)
    with pytest.raises(ValueError, match="num_mini_batches"):
        PPOTrainer(_args(tmp_path, num_mini_batches=3), tok, policy, None, reward, ds, value)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        PPOTrainer(_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2,
                         total_episodes=12), tok, policy, None, reward, ds, value)
    with pytest.raises(ValueError, match="fewer than one global rollout batch"):
        PPOTrainer(_args(tmp_path, per_device_train_batch_size=64), tok, policy, None, reward, ds, value)


def test_mean_reward_rises(tmp_path):
    """The policy learns to emit the rewarded token: fails if the gradient sign or the advantages are wrong."""
    trainer = _quiet(_trainer(tmp_path, per_device_train_batch_size=16, num_ppo_epochs=4, num_mini_batches=2,
                              total_episodes=16 * 14, response_length=8))
    trainer.train()
    scores = [h["objective/scores"] for h in trainer.state.log_history]
    assert len(scores) == 14
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    # random init emits the target ~1/44 of the time (~0.2 per 8 tokens); PPO drives it towards 8
    assert first < 1.0 and last > first + 2.0, scores
    assert set(trainer.state.log_history[-1]) >= TRL_METRICS


def test_report_to_reaches_integration_callbacks(tmp_path, monkeypatch):
    """`report_to=[name]` instantiates that integration's callback, which receives TRL's metric names."""
    import transformers.integrations.integration_utils as iu

    seen = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    monkeypatch.setitem(iu.INTEGRATION_TO_CALLBACK, "recorder", Recorder)
    trainer = _quiet(_trainer(tmp_path, report_to=["recorder"], total_episodes=16, logging_steps=1))
    assert any(isinstance(cb, Recorder) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert len(seen) == 2 and set(seen[0]) >= TRL_METRICS


def _params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_checkpoint_resume_equals_uninterrupted(tmp_path):
    straight = _quiet(_trainer(tmp_path / "a", total_episodes=8 * 4))
    straight.train()

    first = _quiet(_trainer(tmp_path / "b", total_episodes=8 * 4, save_strategy="steps", save_steps=2))
    first.control.should_training_stop = False
    # stop after two iterations: a callback ends training once the checkpoint at step 2 exists
    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True
            return control

    first.callback_handler.add_callback(StopAt2())
    first.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()
    assert (ckpt / "value_model" / "model.safetensors").exists()

    resumed = _quiet(_trainer(tmp_path / "b", total_episodes=8 * 4))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    a, b = _params(straight.model), _params(resumed.model)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)

    from transformers import GPT2LMHeadModel
    reloaded = GPT2LMHeadModel.from_pretrained(str(ckpt))
    assert reloaded.config.vocab_size == straight.model.policy.config.vocab_size


def test_lora_policy_uses_adapter_free_reference(tmp_path):
    from peft import LoraConfig, PeftModel

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM",
                      fan_in_fan_out=True, init_lora_weights=False)  # GPT-2's Conv1D stores weights transposed
    trainer = _quiet(_trainer(tmp_path, peft_config=lora, total_episodes=16))
    assert isinstance(trainer.model.policy, PeftModel) and trainer.ref_model is None
    base_before = {k: v.clone() for k, v in trainer.model.policy.named_parameters() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in trainer.model.policy.named_parameters() if "lora_" in k}
    # the reference is the adapter-disabled policy: its logits equal the plain base model's
    queries, seeds = trainer.local_batch(1)
    rollout = trainer.rollout(queries, seeds)
    scored = trainer.score_rollout(rollout)
    with torch.no_grad(), trainer.model.policy.disable_adapter():
        from trl_trainers._generation import policy_response_logits
        from trl_trainers.ppo_math import logprobs_from_logits
        base_logits = policy_response_logits(trainer.model.policy, rollout.query_responses, 0,
                                             rollout.context_length, 1.0)
    torch.testing.assert_close(scored["ref_logprobs"], logprobs_from_logits(base_logits, rollout.responses))
    assert not torch.allclose(scored["ref_logprobs"], scored["logprobs"])  # adapter active for the policy
    trainer.train()
    after = dict(trainer.model.policy.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # frozen base
    assert any(not torch.equal(after[k], v) for k, v in lora_before.items())  # adapter trained
    trainer.save_model(str(tmp_path / "lora"))
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()


def test_save_model_and_completions(tmp_path):
    trainer = _quiet(_trainer(tmp_path, total_episodes=8, stop_token="eos", missing_eos_penalty=1.0,
                              per_device_eval_batch_size=4))
    trainer.train()
    table = trainer.generate_completions()
    assert len(table["query"]) == 8 and len(table["score"]) == 8
    assert all(isinstance(s, float) for s in table["score"])
    trainer.save_model()
    out = trainer.args.output_dir
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))


def test_ref_model_copy_is_frozen_and_separate(tmp_path):
    tok, policy, reward, value, ds = _parts()
    ref = copy.deepcopy(policy)
    trainer = _quiet(PPOTrainer(_args(tmp_path, total_episodes=8), tok, policy, ref, reward, ds, value))
    before = _params(ref)
    trainer.train()
    assert all(torch.equal(before[k], v) for k, v in _params(trainer.ref_model).items())
    assert not all(torch.equal(before[k], v) for k, v in _params(trainer.model.policy).items())


def test_rollout_is_independent_of_chunking_and_batch_neighbours(tmp_path):
    """Per-sample sampling seeds: a prompt's response does not depend on chunk size or on the other prompts, which
    is what lets any placement (or rank count) reproduce the same rollout."""
    trainer = _trainer(tmp_path, local_rollout_forward_batch_size=8)
    queries, seeds = trainer.local_batch(1)
    whole = trainer.rollout(queries, seeds)
    trainer.args.local_rollout_forward_batch_size = 3
    chunked = trainer.rollout(queries, seeds)
    torch.testing.assert_close(chunked.query_responses, whole.query_responses, rtol=0, atol=0)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)
    # the sampler's log-probs equal a fresh forward over the sampled sequence (same distribution, temperature 1)
    from trl_trainers._generation import policy_response_logits
    from trl_trainers.ppo_math import logprobs_from_logits

    with torch.no_grad():
        logits = policy_response_logits(trainer.model.policy, whole.query_responses, 0, whole.context_length, 1.0)
    torch.testing.assert_close(whole.logprobs, logprobs_from_logits(logits, whole.responses), rtol=1e-4, atol=1e-4)
    alone = trainer.rollout(queries[5:6], seeds[5:6])
    assert torch.equal(alone.responses, whole.responses[5:6])
    other = trainer.rollout(queries, [s + 1 for s in seeds])
    assert not torch.equal(other.responses, whole.responses)
