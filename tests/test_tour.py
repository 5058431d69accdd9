"""The tour script lists the components that exist and prints the summary table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tour_cli_runs_one_component() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tour.py"), "--only", "hf_placement"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "component" in proc.stdout and "hf_placement" in proc.stdout
    assert "hierarchical == flat all-reduce" in proc.stdout


def test_tour_parts_declare_their_interface() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import tour  # noqa: PLC0415

        parts = tour.discover_parts()
        assert parts, "no tour parts found"
        for path in parts:
            module = tour._load(path)
            assert isinstance(module.COMPONENT, str) and isinstance(module.DESCRIPTION, str)
            assert callable(module.run)
    finally:
        sys.path.remove(str(ROOT / "examples"))
