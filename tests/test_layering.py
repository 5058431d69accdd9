"""The layers of the house, checked on the source: every import of every library module, including imports inside
functions, parsed with `ast` and held against the forbidden arrows of ARCHITECTURE.md.

- the topology base (`hf_placement` outside its `runtime` / `planner` wings, `hf_placement.partition` included) knows
  no engine, trainer or integration, and none of its wings (its ``__main__`` dispatches to the planner's CLI);
- the wings sit on the base, below the engine: they import no engine, trainer or integration either (the placement
  planner prices sharded roles with the base's partition schedule, not the engine's);
- the engine (`paro_zero_backend`) never imports an integration (`accelerate_plugins`), a trainer, or the placement
  wings: engines are plain torch on the topology base;
- `tea_pipeline`, `antdt_callbacks` and `gmeta_trainer` stand alone (no package of ours but `csrc`);
- `csrc` (the native kernels and their loader) is the bottom layer: any package may use it, it imports none of ours;
- no library module imports `bench`, `examples` or `tests`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_placement", "paro_zero_backend", "trl_trainers", "accelerate_plugins", "antdt_callbacks",
            "gmeta_trainer", "tea_pipeline", "csrc")
OURS = PACKAGES + ("bench", "examples", "tests")
WINGS = ("hf_placement.runtime", "hf_placement.planner")
STANDALONE = ("tea_pipeline", "antdt_callbacks", "gmeta_trainer")


def layer(module: str) -> str:
    """``hf_placement.planner.cli`` -> ``hf_placement.planner``; ``hf_placement.groups`` -> ``hf_placement`` (the
    base); other packages -> their top-level name; anything else -> ``""`` (third party)."""
    for wing in WINGS:
        if module == wing or module.startswith(wing + "."):
            return wing
    top = module.split(".")[0]
    return top if top in OURS else ""


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``source``, relative imports resolved against ``module``."""
    out: list[tuple[int, str]] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            # `from pkg import sub` may name a submodule: check it as pkg.sub as well
            out.extend((node.lineno, f"{target}.{alias.name}") for alias in node.names if alias.name != "*")
    return out


def forbidden(src_layer: str, src_module: str, dst_module: str) -> str | None:
    """Why ``src_module`` (in ``src_layer``) may not import ``dst_module``, or None."""
    dst = layer(dst_module)
    if not dst or dst == src_layer:
        return None
    if dst in ("bench", "examples", "tests"):
        return "library code never imports bench/, examples/ or tests/"
    if src_layer == "csrc":
        return "csrc is the bottom layer (kernels and their loader): it imports no other package of ours"
    if dst == "csrc":
        return None  # native kernels sit below everything, like a third-party dependency
    if src_layer == "hf_placement":
        if dst in WINGS and src_module == "hf_placement.__main__":
            return None  # `python -m hf_placement plan` dispatches to the planner's CLI
        return "the topology base knows no engine, trainer, integration or wing of its own"
    if src_layer in WINGS and dst in ("paro_zero_backend", "trl_trainers", "accelerate_plugins"):
        return "the placement wings sit on the base, below the engine: no engine, trainer or integration"
    if src_layer == "paro_zero_backend" and dst != "hf_placement":
        return "the engine is plain torch on the topology base: no integration, trainer or placement wing"
    if src_layer in STANDALONE:
        return f"{src_layer} stands alone: it imports no other package of ours"
    return None


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            is_package = rel.name == "__init__"
            module = ".".join(rel.parts[:-1] if is_package else rel.parts)
            src_layer = layer(module)
            for line, target in imports_of(path.read_text(), module, is_package):
                why = forbidden(src_layer, module, target)
                if why:
                    found.append(f"{path.relative_to(root)}:{line} imports {target}: {why}")
    return found


def test_no_forbidden_arrows():
    assert violations() == []


def test_the_check_catches_each_forbidden_arrow():
    """The checker itself: each forbidden arrow, written the ways code writes imports, is reported."""
    cases = {
        ("hf_placement.plan", "from trl_trainers import PPOTrainer"): "base",
        ("hf_placement.groups", "def f():\n    from accelerate_plugins import ParoPlugin\n"): "base",
        ("hf_placement.topology", "from .planner import rank_plans"): "base",
        ("hf_placement.planner.memory", "from paro_zero_backend import memory_bytes"): "wings",
        ("hf_placement.runtime.dispatch", "from trl_trainers import PPOTrainer"): "wings",
        ("hf_placement.groups", "import paro_zero_backend"): "base",
        ("paro_zero_backend.__main__", "def launch():\n    from accelerate_plugins.paro_plugin import X\n"): "engine",
        ("paro_zero_backend.engine", "from hf_placement.runtime import Timeline"): "engine",
        ("tea_pipeline.engine", "import hf_placement.testing"): "stands alone",
        ("antdt_callbacks.trainer", "from paro_zero_backend import ParoEngine"): "stands alone",
        ("gmeta_trainer.trainer", "from trl_trainers import PPOConfig"): "stands alone",
        ("trl_trainers.ppo_trainer", "from bench.placement import bench_placement"): "bench",
        ("hf_placement.planner.cli", "import examples.tour"): "bench",
        ("csrc", "from tea_pipeline import LightTEA"): "bottom layer",
    }
    for (module, source), expect in cases.items():
        found = [forbidden(layer(module), module, t) for _, t in imports_of(source, module)]
        assert any(w and expect in w for w in found), (module, source, found)
    # and the allowed arrows stay allowed
    allowed = {
        ("paro_zero_backend.engine", "from hf_placement import build_topology"),
        ("tea_pipeline.kernels", "import csrc"),
        ("trl_trainers.placement.sharding", "from paro_zero_backend import ParoEngine"),
        ("hf_placement.planner.memory", "from ..partition import memory_bytes"),
        ("hf_placement.__main__", "from .planner.cli import main"),
        ("accelerate_plugins.paro_accelerator", "from paro_zero_backend import ParoEngine"),
        ("hf_placement.runtime.dispatch", "from ..plan import PlacementPlan"),
    }
    for module, source in allowed:
        assert not any(forbidden(layer(module), module, t) for _, t in imports_of(source, module)), source


def test_a_forbidden_import_added_to_the_tree_fails(tmp_path):
    """End to end: copy one package, add a forbidden import, and the tree check reports it with file and line."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "paro_zero_backend" / "engine.py").write_text("import torch\n\n\ndef f():\n"
                                                              "    import accelerate_plugins\n")
    assert violations(tmp_path) == ["paro_zero_backend/engine.py:5 imports accelerate_plugins: the engine is plain "
                                    "torch on the topology base: no integration, trainer or placement wing"]
