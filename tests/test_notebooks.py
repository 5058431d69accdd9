"""Every notebook under examples/notebooks runs top to bottom in a fresh local kernel (nbclient)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "examples" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


def execute_notebook(path: Path, timeout: int = 900) -> nbformat.NotebookNode:
    """Execute ``path`` in its own folder with the ``python3`` kernel of this interpreter; raise on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    nb = execute_notebook(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, f"{path.name}: cells raised {errors}"
