"""Launch configurations PPOTrainer cannot honour fail before training, naming the key and what to use instead."""

from __future__ import annotations

import pytest
import torch

from hf_placement import PlacementPlan
from trl_trainers import PPOConfig, PPOTrainer
from trl_trainers.accelerate_backends import fill_deepspeed_config, fsdp2_settings
from trl_trainers.batch_layout import compute_batch_layout
from trl_trainers.launch_engine import LaunchEngine, launch_engine_from_env
from trl_trainers.placement.resolve import apply_launch_engine
from trl_trainers.testing import (
    TargetTokenRewardModel,
    char_tokenizer,
    prompt_dataset,
    tiny_causal_lm,
    tiny_value_model,
)


def test_engine_is_read_from_the_launch_variables(tmp_path):
    assert launch_engine_from_env({}).kind == "replicated"
    ds = launch_engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})
    assert (ds.kind, ds.zero_stage) == ("deepspeed", 3)
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    from_file = launch_engine_from_env({"ACCELERATE_USE_DEEPSPEED": "true",
                                        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    assert from_file.zero_stage == 2
    assert launch_engine_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}).kind == "fsdp2"
    paro = launch_engine_from_env({"PARO_STRATEGY": "IIG", "PARO_GROUP_SIZE": "2"})
    assert (paro.kind, paro.paro_strategy, paro.paro_group_size) == ("paro", "IIG", 2)


@pytest.mark.parametrize("env,match", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version: 2"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "PARO_STRATEGY": "GGG"}, "both name the engine"),
    ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "MEGATRON_LM"),
    ({"PARO_STRATEGY": "auto"}, "Name a strategy"),
    ({"PARO_STRATEGY": "XYZ"}, "XYZ"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "/nonexistent/ds.json"},
     "deepspeed_config_file"),
])
def test_unusable_launches_are_refused(env, match):
    with pytest.raises(ValueError, match=match):
        launch_engine_from_env(env)


def test_placements_against_the_launched_engine():
    deepspeed = LaunchEngine("deepspeed", source="DeepSpeed ZeRO-3", zero_stage=3)
    with pytest.raises(ValueError, match="conflicts with the launched engine"):
        apply_launch_engine(PlacementPlan.interleaved(4), deepspeed)
    with pytest.raises(ValueError, match="conflicts with the launched engine"):
        apply_launch_engine(PlacementPlan.colocated(2, sharded="GGG"), deepspeed)
    assert apply_launch_engine(PlacementPlan.colocated(2), deepspeed).sharded_roles == {}
    paro = LaunchEngine("paro", source="PaRO config (strategy GGG)", paro_strategy="GGG")
    merged = apply_launch_engine(PlacementPlan.interleaved(4), paro)
    assert merged.sharded_roles == {"actor": "GGG", "critic": "GGG", "ref": "GGG", "reward": "GGG"}
    nni = apply_launch_engine(PlacementPlan.colocated(4), LaunchEngine("paro", paro_strategy="NNI"))
    assert nni.sharded_roles == {"actor": "NNI", "critic": "NNI"}  # p=N shards nothing of a frozen model
    with pytest.raises(ValueError, match="while the launched PaRO config trains with strategy GGG"):
        apply_launch_engine(PlacementPlan.colocated(2, sharded="IIG"), paro)


def _layout(per_device=2, accum=2):
    return compute_batch_layout(per_device, accum, 1, 2, 64, None, 1.0, 1)


@pytest.mark.parametrize("config,match", [
    ({"optimizer": {"type": "AdamW"}}, "Remove `optimizer`"),
    ({"scheduler": {"type": "WarmupLR"}}, "Remove `scheduler`"),
    ({"train_micro_batch_size_per_gpu": 16}, "per_device_train_batch_size"),
    ({"gradient_accumulation_steps": 8}, "gradient_accumulation_steps: auto"),
    ({"fp16": {"enabled": True}}, "fp16"),
])
def test_deepspeed_settings_the_update_cannot_honour(config, match):
    args = PPOConfig(output_dir="/tmp/unused", report_to="none", per_device_train_batch_size=2,
                     gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=match):
        fill_deepspeed_config(dict(config), args, _layout())


def test_deepspeed_auto_fields_are_filled_from_the_ppo_layout():
    args = PPOConfig(output_dir="/tmp/unused", report_to="none", max_grad_norm=0.5)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto"}
    fill_deepspeed_config(config, args, _layout(per_device=2, accum=4))
    assert config == {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                      "gradient_clipping": 0.5}


@pytest.mark.parametrize("env,match", [
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "TRANSFORMER_BASED_WRAP"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "gradient_checkpointing"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16"),
])
def test_fsdp_settings_the_trainer_cannot_honour(env, match, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        fsdp2_settings()


def test_fp16_from_the_accelerate_config_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="mixed_precision: fp16"):
        PPOConfig(output_dir="/tmp/unused", report_to="none")


def _trainer_parts(tmp_path):
    tok = char_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4,
                     total_episodes=8, num_sample_generations=0, save_strategy="no")
    return args, tok, TargetTokenRewardModel(tok.convert_tokens_to_ids("z")), prompt_dataset(tok, 16)


def test_zero3_without_a_reference_model_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args, tok, reward, data = _trainer_parts(tmp_path)
    with pytest.raises(ValueError, match="pass it as ref_model"):
        PPOTrainer(args, tok, tiny_causal_lm(len(tok)), None, reward, data, tiny_value_model(len(tok)))


def test_fsdp2_with_a_custom_optimizer_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args, tok, reward, data = _trainer_parts(tmp_path)
    policy = tiny_causal_lm(len(tok))
    with pytest.raises(ValueError, match="custom optimizer cannot be combined with FSDP2"):
        PPOTrainer(args, tok, policy, None, reward, data, tiny_value_model(len(tok)),
                   optimizers=(torch.optim.SGD(policy.parameters(), lr=0.1), None))


def test_sub_group_under_an_engine_launch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args, tok, reward, data = _trainer_parts(tmp_path)
    with pytest.raises(ValueError, match="Drop `group`"):
        PPOTrainer(args, tok, tiny_causal_lm(len(tok)), None, reward, data, tiny_value_model(len(tok)),
                   group=object())
