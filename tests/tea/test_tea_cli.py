"""``python -m tea_pipeline align``: end to end on a synthetic folder, outputs, bad input, --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tea_pipeline import make_synthetic_pair
from tea_pipeline.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tea_pipeline", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    pair = make_synthetic_pair(num_entities=400, seed=2)
    return pair.save_text(tmp_path_factory.mktemp("tea") / "synthetic")


@pytest.mark.slow
def test_align_writes_metrics_and_alignment(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run("align", "--data", str(data_dir), "--seeds", "80", "--output", str(out), "--device", "cpu",
                "--dim", "96", "--top-k", "40", "--threads", "1", "--no-progress", "--cache-dir", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr
    assert "H@1" in proc.stdout and "label_propagation" in proc.stdout and "final: H@1" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["final"]) == {"hits@1", "hits@10", "mrr"} and metrics["final"]["hits@1"] > 0.8
    assert len(metrics["rounds"]) >= 2 and "similarity_topk" in metrics["timings_s"]
    assert metrics["config"]["dim"] == 96 and metrics["data"]["seeds"] == 80 and metrics["wall_s"] > 0
    lines = (out / "alignment.tsv").read_text().splitlines()
    assert lines[0].startswith("source_id\tsource_name\tpredicted_id") and len(lines) == 1 + 400 - 80
    correct = sum(int(line.split("\t")[-1]) for line in lines[1:])
    assert correct == pytest.approx(metrics["final"]["hits@1"] * 320, abs=0.5)


def test_bad_input_exits_with_a_message(data_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["align", "--data", str(data_dir), "--seeds", "400", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "num_seeds=400 is too large" in capsys.readouterr().err
    assert main(["align", "--data", str(data_dir), "--seeds", "10", "--alpha", "2"]) == 2
    assert "alpha" in capsys.readouterr().err
    assert main(["align", "--data", str(tmp_path / "none"), "--seeds", "10"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_help_lists_config_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["align", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--data", "--seeds", "--device", "--output", "--reference-compat", "--top-k", "--alpha"):
        assert flag in out
