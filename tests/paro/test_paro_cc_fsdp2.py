"""PaRO-CC inside FSDP2 on 4 gloo ranks (2 groups x 2): same parameters as FSDP's flat collectives and as one process.

One `run_distributed` call does all the distributed work (spawning ranks costs seconds on a loaded machine); the tests
assert on its results.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_placement import run_distributed
from paro_zero_backend.testing import (
    from_numpy,
    make_adamw,
    make_batches,
    max_rel_diff,
    reference_run,
    tiny_gpt2,
    to_numpy,
)

_np, _t = to_numpy, from_numpy  # rank results cross the process boundary as numpy

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

WORLD, GROUP, STEPS = 4, 2, 3
FP32_TOL = 1e-5


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, data, rank):
    opt = make_adamw(model.parameters())
    for step in range(data.shape[0]):
        ids = data[step, 0, rank]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _errors(mesh2d) -> dict[str, str]:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from paro_zero_backend.fsdp2_cc import enable_paro_cc

    out = {}
    for key, fn in {
        "bad_group": lambda: enable_paro_cc(_fsdp_model_cached(), group_size=3),
        "not_sharded": lambda: enable_paro_cc(nn.Linear(4, 4), group_size=GROUP),
        "hsdp": lambda: enable_paro_cc(fully_shard(nn.Linear(4, 4), mesh=mesh2d), group_size=GROUP),
    }.items():
        try:
            fn()
            out[key] = ""
        except ValueError as exc:
            out[key] = str(exc)
    return out


@functools.lru_cache(maxsize=1)
def _fsdp_model_cached():
    from torch.distributed.device_mesh import init_device_mesh

    return _fsdp_model(init_device_mesh("cpu", (WORLD,)))


def _worker(rank: int, world: int, data: torch.Tensor) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from paro_zero_backend.fsdp2_cc import enable_paro_cc

    mesh = init_device_mesh("cpu", (world,))
    flat = _train(_fsdp_model(mesh), data, rank)
    model = _fsdp_model(mesh)
    handle = enable_paro_cc(model, group_size=GROUP)
    paro = _train(model, data, rank)
    bytes_ = dict(handle.counter.bytes)
    handle.disable()
    after_disable = _train(model, data[:1], rank)  # flat collectives again: must still run and not count
    errors = _errors(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return _np({"flat": flat, "paro": paro, "bytes": bytes_, "bytes_after": dict(handle.counter.bytes),
            "ran_after_disable": bool(after_disable), "errors": errors})


@pytest.fixture(scope="module")
def results():
    data = make_batches(STEPS, 1, WORLD)
    out = [_t(r) for r in run_distributed(_worker, WORLD, data, timeout=400)]
    ref = reference_run(tiny_gpt2(), data)
    return out, ref


def test_paro_cc_equals_flat_fsdp2(results):
    out, _ = results
    for r in out:
        assert max_rel_diff(r["paro"], r["flat"]) < FP32_TOL


def test_fsdp2_with_paro_cc_equals_single_process(results):
    out, ref = results
    assert max_rel_diff(out[0]["paro"], ref) < FP32_TOL


def test_paro_cc_traffic_split(results):
    """2 groups x 2: AG_E sends 1 block per rank, AG_I 2; RS_I 2, RS_E 1: intra bytes are exactly twice inter."""
    out, _ = results
    for r in out:
        b = r["bytes"]
        assert b["inter"] > 0 and b["flat"] == 0
        assert b["intra"] == 2 * b["inter"]
        assert r["bytes_after"] == b and r["ran_after_disable"]


def test_paro_cc_errors(results):
    errors = results[0][0]["errors"]
    assert "group_size=3 does not divide world_size=4" in errors["bad_group"]
    assert "no module wrapped with fully_shard" in errors["not_sharded"]
    assert "HSDP" in errors["hsdp"]
