"""ParoPlugin configuration (kwargs, YAML/JSON files, PARO_* environment, precedence) and the single-process errors of
ParoAccelerator/ParoTrainer; no process group needed, so these run fast."""

from __future__ import annotations

import json

import pytest

from accelerate_plugins import ParoAccelerator, ParoPlugin
from paro_zero_backend import ParoConfig


def test_kwargs_to_paro_config():
    plugin = ParoPlugin(strategy="nig", group_size=2, paro_cc=False, bucket_size=1000)
    assert plugin.strategy == "NIG"
    cfg = plugin.to_paro_config(mixed_precision="bf16", gradient_accumulation_steps=4)
    assert isinstance(cfg, ParoConfig)
    assert (cfg.strategy, cfg.group_size, cfg.paro_cc, cfg.bucket_size) == ("NIG", 2, False, 1000)
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps) == ("bf16", 4)
    # the plugin's own precision wins over the accelerator's
    assert ParoPlugin(mixed_precision="no").to_paro_config(mixed_precision="bf16").mixed_precision == "no"


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="Valid strategies"):
        ParoPlugin(strategy="XYZ")
    with pytest.raises(ValueError, match="group_size=0"):
        ParoPlugin(group_size=0)
    with pytest.raises(ValueError, match="mixed_precision"):
        ParoPlugin(mixed_precision="fp8")


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "paro.yaml"
    y.write_text("strategy: IIG\ngroup_size: 2\nparo_cc: false\n")
    assert ParoPlugin.from_file(y) == ParoPlugin(strategy="IIG", group_size=2, paro_cc=False)
    j = tmp_path / "paro.json"
    j.write_text(json.dumps({"paro": {"strategy": "NNG"}}))
    assert ParoPlugin.from_file(j).strategy == "NNG"


def test_unknown_file_keys_are_listed(tmp_path):
    y = tmp_path / "paro.yaml"
    y.write_text("strategy: IIG\ngroupsize: 2\ndistributed_type: MULTI_GPU\n")
    with pytest.raises(ValueError, match=r"unknown PaRO keys \['distributed_type', 'groupsize'\]"):
        ParoPlugin.from_file(y)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ParoPlugin.from_file(tmp_path / "missing.yaml")
    (tmp_path / "p.toml").write_text("x")
    with pytest.raises(ValueError, match="extension"):
        ParoPlugin.from_file(tmp_path / "p.toml")


def test_env_precedence(tmp_path):
    y = tmp_path / "paro.yaml"
    y.write_text("strategy: NNG\ngroup_size: 4\nbucket_size: 77\n")
    env = {"PARO_CONFIG_FILE": str(y), "PARO_GROUP_SIZE": "2", "PARO_PARO_CC": "false"}
    plugin = ParoPlugin.from_env(env, strategy="GGG")
    # explicit > PARO_<FIELD> > PARO_CONFIG_FILE > default
    assert (plugin.strategy, plugin.group_size, plugin.bucket_size, plugin.paro_cc) == ("GGG", 2, 77, False)
    assert ParoPlugin.from_env({}) == ParoPlugin()
    assert ParoPlugin.from_env({"PARO_GROUP_SIZE": "none"}).group_size is None


def test_env_errors():
    with pytest.raises(ValueError, match="PARO_STRATEGI"):
        ParoPlugin.from_env({"PARO_STRATEGI": "IIG"})
    with pytest.raises(ValueError, match="PARO_GROUP_SIZE='two'"):
        ParoPlugin.from_env({"PARO_GROUP_SIZE": "two"})
    with pytest.raises(ValueError, match="PARO_PARO_CC='maybe'"):
        ParoPlugin.from_env({"PARO_PARO_CC": "maybe"})
    with pytest.raises(ValueError, match="unknown PaRO keys"):
        ParoPlugin.from_env({}, stratgy="IIG")


def test_accelerator_rejects_deepspeed_and_fsdp(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match="PaRO replaces FSDP"):
        ParoAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_DEEPSPEED is set"):
        ParoAccelerator()


def test_accelerator_needs_a_distributed_launch(monkeypatch):
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="multi-process data-parallel launch"):
        ParoAccelerator(cpu=True)
