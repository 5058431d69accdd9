"""`paro launch` (python -m accelerate_plugins launch): the PaRO file is checked, PARO_CONFIG_FILE / PARO_<FIELD> are
exported and an ordinary `accelerate launch --config_file acc.yaml script.py` runs 2 CPU processes on the engine. The
`paro` console script dispatches `launch` here and `advise` to the engine's CLI, which itself knows no `launch`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_plugins.cli import main, paro_main

ROOT = Path(__file__).resolve().parents[2]
ACC_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
"""


def test_dry_run_prints_the_resolved_settings(tmp_path, capsys):
    paro = tmp_path / "paro.yaml"
    paro.write_text("strategy: IIG\ngroup_size: 1\n")
    assert main(["launch", "--paro-config", str(paro), "--set", "strategy=nig", "--dry-run", "--",
                 "--config_file", "acc.yaml", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "NIG" in out and "PARO_CONFIG_FILE" in out and "accelerate launch --config_file acc.yaml train.py" in out


@pytest.mark.parametrize("content, args, match", [
    ("strategy: IIG\nstratgy: NIG\n", [], r"unknown PaRO keys \['stratgy'\]"),
    ("strategy: INN\n", [], "must be partitioned at least as finely"),
    ("strategy: IIG\n", ["--set", "bogus=1"], "expected FIELD=VALUE with FIELD one of"),
    ("strategy: IIG\n", ["--set", "group_size=two"], "PARO_GROUP_SIZE='two' is not a valid int"),
])
def test_bad_paro_settings_fail_before_launching(tmp_path, content, args, match):
    paro = tmp_path / "paro.yaml"
    paro.write_text(content)
    with pytest.raises(SystemExit, match=match):
        main(["launch", "--paro-config", str(paro), *args, "--dry-run", "--", "train.py"])


def test_paro_script_dispatches_and_the_engine_cli_points_to_launch(tmp_path, capsys):
    paro = tmp_path / "paro.yaml"
    paro.write_text("strategy: IIG\n")
    assert paro_main(["launch", "--paro-config", str(paro), "--dry-run", "--", "train.py"]) == 0
    assert "paro launch: IIG" in capsys.readouterr().out
    assert paro_main(["advise", "--num-params", "1e9", "-n", "4", "-m", "2", "--intra-gbps", "100",
                      "--inter-gbps", "10"]) == 0
    assert "recommended:" in capsys.readouterr().out
    assert paro_main(["--help"]) == 0 and "advise" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    assert "--paro-config" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "paro_zero_backend", "launch", "--paro-config", str(paro)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert "paro launch" in proc.stderr and "python -m accelerate_plugins launch" in proc.stderr


def test_missing_file_and_missing_script(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        main(["launch", "--paro-config", str(tmp_path / "nope.yaml"), "--", "train.py"])
    paro = tmp_path / "paro.yaml"
    paro.write_text("strategy: IIG\n")
    with pytest.raises(SystemExit, match="nothing to launch"):
        main(["launch", "--paro-config", str(paro)])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_launch_runs_accelerate_with_two_cpu_processes(tmp_path):
    (tmp_path / "acc.yaml").write_text(ACC_YAML)
    (tmp_path / "paro.yaml").write_text("strategy: NIG\ngroup_size: 1\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("PARO_")}
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate_plugins", "launch", "--paro-config", str(tmp_path / "paro.yaml"),
         "--set", "strategy=NII", "--", "--config_file", str(tmp_path / "acc.yaml"),
         str(ROOT / "examples" / "paro" / "accelerate_loop.py"), "--output_dir", str(tmp_path / "out"),
         "--steps", "2"],
        env=env, capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the --set override reached every worker through the environment and beat the file
    assert "strategy NII" in proc.stdout
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
