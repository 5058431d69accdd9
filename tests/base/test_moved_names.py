"""Names that moved when hf_placement was split into its base and its runtime / planner wings keep working with a
warning that names the new place; moved modules and removed names fail with a message that names the new place."""

from __future__ import annotations

import importlib

import pytest


def test_old_top_level_names_resolve_with_a_warning():
    import hf_placement
    from hf_placement import planner, runtime

    with pytest.warns(FutureWarning, match=r"hf_placement.Timeline moved to hf_placement.runtime.Timeline"):
        assert hf_placement.Timeline is runtime.Timeline
    with pytest.warns(FutureWarning, match=r"hf_placement.rank_plans moved to hf_placement.planner.rank_plans.*0\.3"):
        assert hf_placement.rank_plans is planner.rank_plans


def test_moved_modules_and_removed_names_name_their_new_place():
    import hf_placement

    with pytest.raises(ModuleNotFoundError, match=r"hf_placement.calibrate moved to hf_placement.planner.calibrate"):
        importlib.import_module("hf_placement.calibrate")
    with pytest.raises(ModuleNotFoundError, match=r"hf_placement.channels moved to hf_placement.runtime.channels"):
        importlib.import_module("hf_placement.channels")
    with pytest.raises(AttributeError, match="ShardedModule was removed.*ParoEngine"):
        hf_placement.ShardedModule  # noqa: B018 - the attribute access is what is tested
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        hf_placement.nothing  # noqa: B018


def test_the_base_loads_no_wing():
    """Importing the base (what paro_zero_backend needs) does not import the runtime or the planner."""
    import subprocess
    import sys

    code = ("import sys, hf_placement, hf_placement.topology; "
            "print(sorted(m for m in sys.modules if m.startswith(('hf_placement.runtime', 'hf_placement.planner', "
            "'trl_trainers', 'paro_zero_backend', 'accelerate_plugins'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
