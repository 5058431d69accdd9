"""The placement PPO example runs under `accelerate launch --multi_gpu --num_processes 2` and `torchrun` on CPU.

Accelerate's ``--multi_gpu`` path is its torchrun launcher; without a GPU the trainer runs on gloo because the example
sets ``use_cpu``. The accelerate run uses the disaggregated placement and the torchrun run the colocated one, so the
test also checks that both launchers produce the same update (staleness 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_placement import find_free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(620)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "placement" / "ppo_placement.py"


def _launch(prefix: list[str], placement: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [*prefix, str(SCRIPT), "--placement", placement, "--out", str(out), "--iterations", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, cwd=str(ROOT))
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "rank 1/2" in proc.stdout and "rank 0/2" in proc.stdout, proc.stdout
    result = json.loads((out / f"result_{placement}.json").read_text())
    assert Path(result["png"]).stat().st_size > 0
    return result


def test_accelerate_launch_and_torchrun_on_cpu(tmp_path):
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "--main_process_port", str(find_free_port())]
    dis = _launch(accelerate, "disaggregated", tmp_path / "accelerate")
    assert dis["roles"] == ["actor", "critic"] and dis["trains"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(find_free_port())]
    col = _launch(torchrun, "colocated", tmp_path / "torchrun")
    assert col["trains"]
    assert abs(dis["checksum"] - col["checksum"]) < 1e-3 * max(1.0, abs(col["checksum"]))
    assert dis["scores"] == pytest.approx(col["scores"], rel=1e-5, abs=1e-6)
