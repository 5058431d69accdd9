"""`release_process_groups`: every gloo group is freed, and its threads joined, while the interpreter is alive.

A group that lives into interpreter finalization can abort a finished worker with SIGABRT ("terminate called without
an active exception", seen under torchrun and accelerate launch). That happens when one of its threads drops a
collective's tensor after finalization has begun. Whether that race fires is timing, so these tests check what
prevents it, which is deterministic: no group is still alive when the release returns.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_placement import build_topology, release_process_groups, run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _pin_world_like_a_late_import() -> bool:
    """Re-run ``torch.distributed.nn.functional``'s module body now that a default group exists, as a first import
    after ``init_process_group`` (an optimizer's lazy ``torch._dynamo`` import) does: its defaults then hold it."""
    import torch.distributed.nn.functional as fn

    importlib.reload(fn)
    return fn.all_reduce.__defaults__[-1] is dist.group.WORLD


def _release_frees_every_group(rank: int, world: int) -> dict:
    pinned = _pin_world_like_a_late_import()
    topo = build_topology(group_size=1)  # cached by the base: the cache holds its groups too
    t = torch.ones(3)
    dist.all_reduce(t, group=topo.inter_group)
    torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).step()
    refs = [weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map]
    del topo
    alive = release_process_groups()
    import torch.distributed.nn.functional as fn

    return {"pinned": pinned, "groups": len(refs), "alive_names": alive,
            "alive_refs": sum(r() is not None for r in refs), "initialized": dist.is_initialized(),
            "defaults_unpinned": fn.all_reduce.__defaults__[-1] is None, "sum": float(t[0])}


def test_release_frees_groups_pinned_by_a_late_torch_distributed_nn_import_and_by_the_topology_cache():
    results = run_distributed(_release_frees_every_group, world_size=2, timeout=120)
    for r in results:
        if not r["pinned"]:
            pytest.skip("this torch no longer takes group.WORLD as a default in torch.distributed.nn.functional")
        assert r["sum"] == 2.0
        assert r["groups"] >= 2, "the world group and the topology's groups were all registered"
        assert r == {**r, "alive_names": [], "alive_refs": 0, "initialized": False, "defaults_unpinned": True}


def test_release_without_a_process_group_is_a_no_op():
    assert not dist.is_initialized()
    assert release_process_groups() == []


_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, datetime, json, os, sys, weakref
    import torch, torch.distributed as dist
    from hf_placement import build_topology, release_process_groups_at_exit

    refs = []

    def report():  # registered first, so it runs after the release hook (atexit is last-in, first-out)
        out = {"rank": int(os.environ["RANK"]), "alive": sum(r() is not None for r in refs), "groups": len(refs),
               "initialized": dist.is_initialized()}
        sys.stdout.write(json.dumps(out) + "\\n")  # one write: both ranks share torchrun's stdout
        sys.stdout.flush()

    atexit.register(report)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    release_process_groups_at_exit()
    release_process_groups_at_exit()  # idempotent: one hook
    import importlib, torch.distributed.nn.functional as fn
    importlib.reload(fn)  # what a first import after init_process_group does: its defaults hold the world group
    topo = build_topology(group_size=1)
    torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).step()
    x = torch.ones(2)
    dist.all_reduce(x, group=topo.inter_group)
    dist.barrier()
    refs.extend(weakref.ref(pg) for pg in dist.distributed_c10d._world.pg_map)
    del topo  # a group the script still held at exit would stay alive (the release then waits for its threads)
    if os.environ.get("DESTROYS_ITSELF") == "1":
        dist.destroy_process_group()  # what torch documents; the late import still holds the world group after it
    # otherwise the script ends without destroying anything, as TRL's and most accelerate scripts do
""")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize("destroys_itself", [False, True], ids=["never_destroys", "destroys_itself"])
def test_at_exit_hook_frees_every_group_of_a_script(tmp_path, destroys_itself):
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "DESTROYS_ITSELF": str(int(destroys_itself))}
    proc = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports, decoder = [], json.JSONDecoder()
    for line in proc.stdout.splitlines():
        pos = 0
        while line.startswith("{", pos):  # two reports written at the same moment can share a line
            report, pos = decoder.raw_decode(line, pos)
            reports.append(report)
    assert sorted(r["rank"] for r in reports) == [0, 1], proc.stdout
    for r in reports:
        assert r["groups"] >= 2 and r["alive"] == 0 and not r["initialized"], r
