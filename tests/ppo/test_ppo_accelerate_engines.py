"""PPO under the accelerate configs users launch TRL's PPO script with: every engine equals one process.

Each case is a real ``accelerate launch --config_file examples/ppo/<config>.yaml`` of a script written in TRL's
order (config, then ``from_pretrained`` models, then the trainer; see ``accelerate_ppo_worker.py``) on 2 gloo CPU
ranks (4 for the 2x2 PaRO strategies), against the same script run as one process on the same global batch and
seeds: 3 PPO iterations end within fp32 tolerance of the single-process weights, and under ZeRO-3, FSDP2 and the
sharding PaRO strategies each rank holds about 1/world of the single-process model state (measured on the engine's
tensors).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "ppo"
WORKER = Path(__file__).resolve().parent / "accelerate_ppo_worker.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"
GLOBAL_BATCH = 8


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARO_", "ACCELERATE_", "FSDP_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error", **(extra or {})})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict[str, str], timeout: int = 400) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    from trl_trainers.testing import char_tokenizer, tiny_causal_lm, tiny_value_model

    path = tmp_path_factory.mktemp("ppo_models")
    n = len(char_tokenizer())
    tiny_causal_lm(n, 0).save_pretrained(path / "policy")
    tiny_value_model(n, 1).save_pretrained(path / "value")
    tiny_value_model(n, 2).save_pretrained(path / "reward")
    return path


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> dict:
    """One plain process: 2 sequences per micro-batch, 4 micro-batches per step (global batch 8)."""
    out = tmp_path_factory.mktemp("ppo_single")
    _run([sys.executable, str(WORKER), "--models", str(models), "--out", str(out), "--grad-accum", "4"], _env())
    return {"params": dict(np.load(out / "params.npz")), **json.loads((out / "rank0.json").read_text())}


def _launch(config: str, models: Path, out: Path, nproc: int = 2, env: dict[str, str] | None = None,
            args: tuple[str, ...] = ()) -> list[dict]:
    accum = GLOBAL_BATCH // (2 * nproc)
    _run([str(ACCELERATE), "launch", "--config_file", str(CONFIGS / config), "--num_processes", str(nproc),
          "--main_process_port", str(_free_port()), str(WORKER), "--models", str(models), "--out", str(out),
          "--grad-accum", str(accum), *args], _env(env))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _assert_same_update(reference: dict, out: Path, reports: list[dict]) -> None:
    params = np.load(out / "params.npz")
    assert sorted(params.files) == sorted(reference["params"])
    for name, want in reference["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-4, err_msg=name)
    for report in reports:
        if report["scores"]:  # a disaggregated inference rank logs no training metrics
            np.testing.assert_allclose(report["scores"], reference["scores"], rtol=0, atol=1e-5)


CASES = {
    # name: (config, ranks, extra env, worker args, engine, model state sharded over the ranks: True / False /
    # None = not compared, e.g. a disaggregated plan trains on one rank)
    "ddp": ("multi_gpu.yaml", 2, {}, (), "replicated", False),
    "zero2": ("deepspeed_zero2.yaml", 2, {}, (), "deepspeed", False),
    "zero3": ("deepspeed_zero3.yaml", 2, {}, ("--save",), "deepspeed", True),
    "zero3_layerwise_gather": ("deepspeed_zero3.yaml", 2, {}, ("--no-ds3-gather",), "deepspeed", True),
    "fsdp2": ("fsdp2.yaml", 2, {}, ("--save",), "fsdp2", True),
    "paro_GGG": ("multi_gpu.yaml", 2, {"PARO_CONFIG_FILE": str(CONFIGS / "paro.yaml")}, ("--save",), "paro", True),
    "paro_IIG_2x2": ("multi_gpu.yaml", 4, {"PARO_STRATEGY": "IIG", "PARO_GROUP_SIZE": "2"}, (), "paro", True),
    "paro_NNI_2x2": ("multi_gpu.yaml", 4, {"PARO_STRATEGY": "NNI", "PARO_GROUP_SIZE": "2"}, (), "paro", False),
    # placements keep working under a PaRO launch: the launched strategy shards the plan's roles on their ranks
    "paro_GGG_interleaved": ("multi_gpu.yaml", 2, {"PARO_STRATEGY": "GGG"}, ("--placement", "interleaved"), "paro",
                             True),
    "paro_GGG_disaggregated": ("multi_gpu.yaml", 2, {"PARO_STRATEGY": "GGG"}, ("--placement", "disaggregated"),
                               "paro", None),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_one_process(case, models, reference, tmp_path):
    config, nproc, env, args, engine, sharded = CASES[case]
    reports = _launch(config, models, tmp_path, nproc, env, args)
    assert {r["engine"] for r in reports} == {engine}
    _assert_same_update(reference, tmp_path, reports)
    ratio = max(r["model_state_bytes"] or 0 for r in reports) / reference["model_state_bytes"]
    if sharded is None:
        pass
    elif sharded:  # parameters and optimizer state partitioned over the ranks: about 1/world of one process
        assert ratio <= 1.0 / 2 + 0.05, (case, ratio)
    else:
        assert ratio > 0.6, (case, ratio)
    if "--save" in args:  # save_model wrote the policy alone, loadable with the trained weights
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
        trained = np.load(tmp_path / "params.npz")
        assert not (tmp_path / "saved" / "value_model").exists()
        for name, value in saved.items():
            np.testing.assert_array_equal(value.numpy(), trained["policy." + name], err_msg=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,env", [("deepspeed_zero3.yaml", {}),
                                        ("multi_gpu.yaml", {"PARO_CONFIG_FILE": str(CONFIGS / "paro.yaml")})],
                         ids=["zero3", "paro"])
def test_trl_example_script_runs_under_the_launch(config, env, tmp_path):
    """TRL's ppo.py (ported, offline tiny models) under the launch, with no flag for CPU hosts; save_model writes the
    policy alone, loadable by from_pretrained."""
    out = tmp_path / "run"
    _run([str(ACCELERATE), "launch", "--config_file", str(CONFIGS / config), "--num_processes", "2",
          "--main_process_port", str(_free_port()), str(CONFIGS / "ppo.py"), "--output_dir", str(out),
          "--total_episodes", "32", "--per_device_train_batch_size", "4", "--response_length", "6",
          "--num_ppo_epochs", "1", "--report_to", "none", "--missing_eos_penalty", "1.0",
          "--num_sample_generations", "0", "--disable_tqdm", "True"], _env(env), timeout=560)
    from transformers import AutoModelForCausalLM

    from trl_trainers.testing import char_tokenizer, tiny_causal_lm

    policy = AutoModelForCausalLM.from_pretrained(out)
    initial = tiny_causal_lm(len(char_tokenizer()), seed=0).state_dict()
    moved = max(float((policy.state_dict()[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 0, "the saved policy still holds its initial weights"
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]


@pytest.mark.timeout(600)
def test_lora_policy_under_zero3(models, tmp_path):
    """A PEFT/LoRA policy under ZeRO-3, as in TRL: the adapter-disabled policy is the reference, the update equals
    one process, and save_model writes only the adapter, which loads onto the base model with the trained weights."""
    single = tmp_path / "single"
    _run([sys.executable, str(WORKER), "--models", str(models), "--out", str(single), "--grad-accum", "4",
          "--lora"], _env())
    reference = {"params": dict(np.load(single / "params.npz")),
                 **json.loads((single / "rank0.json").read_text())}
    out = tmp_path / "zero3"
    reports = _launch("deepspeed_zero3.yaml", models, out, 2, {}, ("--save", "--lora"))
    _assert_same_update(reference, out, reports)
    saved = out / "saved"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models / "policy"), saved)
    trained = np.load(out / "params.npz")
    adapters = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert adapters
    for name, value in adapters.items():
        np.testing.assert_array_equal(value.numpy(), trained["policy." + name], err_msg=name)
