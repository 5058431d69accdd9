"""The ported TRL PPO example script runs end to end offline (tiny local models) and saves the policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ppo" / "ppo.py"


@pytest.mark.slow
def test_example_script_runs_offline(tmp_path):
    out = tmp_path / "ppo-tiny"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(SCRIPT), "--output_dir", str(out), "--total_episodes", "16",
           "--per_device_train_batch_size", "8", "--response_length", "6", "--num_ppo_epochs", "1", "--bf16", "False",
           "--report_to", "none", "--gradient_checkpointing", "False", "--missing_eos_penalty", "1.0",
           "--num_sample_generations", "0", "--disable_tqdm", "True", "--save_strategy", "no"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "objective/scores" in proc.stdout + proc.stderr
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
