"""PaRO-CC inside DeepSpeed ZeRO-3 on 4 gloo ranks (2 groups x 2): same parameters with and without the patch (and as
one process); the patch routes ZeRO's all-gathers and reduce-scatters, counts bytes, and is undone exactly.
"""

from __future__ import annotations

import pytest
import torch

from hf_placement import run_distributed
from paro_zero_backend.testing import (
    ADAMW_KWARGS,
    from_numpy,
    make_batches,
    max_rel_diff,
    reference_run,
    tiny_gpt2,
    to_numpy,
)

_np, _t = to_numpy, from_numpy  # rank results cross the process boundary as numpy

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is an optional dependency (hf-scale-plugins[deepspeed])")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

WORLD, GROUP, STEPS, MICRO = 4, 2, 3, 2
FP32_TOL = 1e-5
DS_ENV = {"DS_ACCELERATOR": "cpu"}


def ds_config(paro: dict | None = None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the single-process reference does not clip
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {**ADAMW_KWARGS, "torch_adam": True}},
        "steps_per_print": 10**9,
    }
    if paro is not None:
        cfg["paro"] = paro
    return cfg


def _train_ds(engine, data, rank) -> dict[str, torch.Tensor]:
    import deepspeed as ds

    for step in range(data.shape[0]):
        ids = data[step, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    params = list(engine.module.named_parameters())
    with ds.zero.GatheredParameters([p for _, p in params]):
        return {name: p.detach().clone() for name, p in params}


def _worker(rank: int, world: int, data: torch.Tensor) -> dict:
    import deepspeed as ds
    from deepspeed.comm.torch import TorchBackend

    from paro_zero_backend import ds_config as dsc
    from paro_zero_backend.deepspeed_cc import deepspeed_paro_cc

    ds.init_distributed(dist_backend="gloo")
    originals = (TorchBackend.__dict__["all_gather_into_tensor"], TorchBackend.__dict__["reduce_scatter_tensor"])
    engine, *_ = ds.initialize(model=tiny_gpt2(), config=ds_config())
    flat = _train_ds(engine, data, rank)
    del engine

    with deepspeed_paro_cc(group_size=GROUP) as cc:
        engine, *_ = ds.initialize(model=tiny_gpt2(), config=ds_config())
        paro = _train_ds(engine, data, rank)
        del engine
    restored = (TorchBackend.__dict__["all_gather_into_tensor"], TorchBackend.__dict__["reduce_scatter_tensor"])

    # The same through a DeepSpeed JSON with a "paro" section (stripped before DeepSpeed validates the rest).
    engine, _, _, _ = dsc.initialize(model=tiny_gpt2(), config=ds_config({"paro_cc": True, "group_size": GROUP}))
    from_json = _train_ds(engine, data, rank)
    json_cc = engine.paro_cc
    json_cc.disable()
    return _np({"flat": flat, "paro": paro, "from_json": from_json, "bytes": dict(cc.counter.bytes),
            "routed": dict(cc.routed), "json_routed": dict(json_cc.routed),
            "restored": restored == originals, "active_after": cc.active})


@pytest.fixture(scope="module")
def results():
    data = make_batches(STEPS, 1, WORLD, micro_batch=MICRO)
    out = [_t(r) for r in run_distributed(_worker, WORLD, data, timeout=800, env=DS_ENV)]
    ref = reference_run(tiny_gpt2(), data)
    return out, ref


def test_zero3_paro_cc_equals_flat(results):
    out, _ = results
    for r in out:
        assert max_rel_diff(r["paro"], r["flat"]) < FP32_TOL
        assert max_rel_diff(r["from_json"], r["flat"]) < FP32_TOL


def test_zero3_equals_single_process(results):
    out, ref = results
    assert max_rel_diff(out[0]["paro"], ref) < FP32_TOL
    assert max_rel_diff(out[0]["flat"], ref) < FP32_TOL


def test_zero3_collectives_were_routed(results):
    """Both kinds went through PaRO-CC; 2 groups x 2 sends exactly twice as many bytes intra as inter."""
    out, _ = results
    for r in out:
        assert r["routed"]["all_gather"] > 0 and r["routed"]["reduce_scatter"] > 0
        assert r["json_routed"] == r["routed"]
        assert r["bytes"]["inter"] > 0 and r["bytes"]["intra"] == 2 * r["bytes"]["inter"]


def test_patch_is_undone(results):
    out, _ = results
    assert all(r["restored"] and not r["active_after"] for r in out)
