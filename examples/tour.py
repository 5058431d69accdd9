"""A tour of every hf-scale-plugins component on embedded defaults (tiny models, generated data), on CPU.

Each component contributes one module under ``examples/tour_parts/`` with a ``run() -> dict`` function; the tour runs
them in order and prints one summary table. A component that has not landed has no module and is not listed.

Usage: ``python examples/tour.py [--only NAME ...]``
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

PARTS_DIR = Path(__file__).resolve().parent / "tour_parts"
COLUMNS = ("component", "what ran", "result", "seconds")


def discover_parts() -> list[Path]:
    """Tour part files in a stable order (file names start with a two-digit order prefix)."""
    return sorted(p for p in PARTS_DIR.glob("[0-9][0-9]_*.py"))


def _load(path: Path):
    # Imported as a real module (not exec'd from a file spec) so that functions in it can be pickled by name for
    # the spawned ranks of distributed parts.
    if str(PARTS_DIR.parent) not in sys.path:
        sys.path.insert(0, str(PARTS_DIR.parent))
    return importlib.import_module(f"tour_parts.{path.stem}")


def run_tour(only: list[str] | None = None) -> list[dict[str, str]]:
    """Run every tour part (or those whose component name is in ``only``); return one row per part."""
    rows = []
    for path in discover_parts():
        module = _load(path)
        if only and module.COMPONENT not in only:
            continue
        print(f"[tour] {module.COMPONENT}: {module.DESCRIPTION}", flush=True)
        start = time.perf_counter()
        result = module.run()
        rows.append({"component": module.COMPONENT, "what ran": module.DESCRIPTION, "result": result,
                     "seconds": f"{time.perf_counter() - start:.1f}"})
    return rows


def format_table(rows: list[dict[str, str]]) -> str:
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in COLUMNS}
    line = " | ".join(c.ljust(widths[c]) for c in COLUMNS)
    sep = "-+-".join("-" * widths[c] for c in COLUMNS)
    body = [" | ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS) for r in rows]
    return "\n".join([line, sep, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="component names to run (default: all)")
    args = parser.parse_args(argv)
    rows = run_tour(args.only)
    print()
    print(format_table(rows))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
