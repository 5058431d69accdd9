"""DeepSpeed JSON + ``"paro"`` section: validation errors, and on 4 gloo ranks (2 groups x 2) the PaRO engine driven by
a DeepSpeed config ends with the same parameters as the equivalent hand-written ParoConfig run (and as DeepSpeed ZeRO-3
running the same JSON without the section, when DeepSpeed is installed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_placement import run_distributed
from paro_zero_backend import ParoConfig
from paro_zero_backend.deepspeed_cc import UnsupportedDeepSpeedError, check_deepspeed_version
from paro_zero_backend.ds_config import ParoSection, paro_config_from_deepspeed, split_paro_section
from paro_zero_backend.testing import ADAMW_KWARGS, from_numpy, make_batches, max_rel_diff, tiny_gpt2, to_numpy

_np, _t = to_numpy, from_numpy  # rank results cross the process boundary as numpy

WORLD, GROUP, STEPS, ACCUM, MICRO = 4, 2, 3, 2, 2
FP32_TOL = 1e-5
CLIP_TOL = 1e-4  # clipping scales every gradient by a norm summed in another order (as in test_paro_engine.py)
CLIP = 0.05
HAS_DS = importlib.util.find_spec("deepspeed") is not None


def ds_json(paro: dict | None = None, **extra) -> dict:
    cfg = {
        "train_batch_size": MICRO * ACCUM * WORLD,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {**ADAMW_KWARGS, "betas": [0.9, 0.999], "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 2, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 3, "overlap_comm": False},
        "steps_per_print": 10**9,
        **extra,
    }
    if paro is not None:
        cfg["paro"] = paro
    return cfg


# ------------------------------------------------------------------------------------------------ bad input
def test_unknown_paro_keys_are_listed():
    with pytest.raises(ValueError, match=r"unknown keys in the 'paro' section: \['stratgy'\]"):
        split_paro_section(ds_json({"stratgy": "IIG"}))


def test_bad_strategy_and_empty_section():
    with pytest.raises(ValueError, match="XYZ"):
        ParoSection(strategy="XYZ")
    with pytest.raises(ValueError, match="would change nothing"):
        ParoSection(paro_cc=False)


def test_unsupported_deepspeed_keys_listed_together():
    cfg = ds_json({"strategy": "IIG"}, amp={"enabled": True},
                  fp16={"enabled": True, "loss_scale": 128, "hysteresis": 2})
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ValueError) as info:
        paro_config_from_deepspeed(cfg, world_size=WORLD)
    msg = str(info.value)
    for key in ("'amp'", "fp16.loss_scale=128", "fp16.hysteresis=2", "zero_optimization.offload_optimizer"):
        assert key in msg


def test_batch_size_consistency():
    with pytest.raises(ValueError, match=r"train_batch_size=12 != train_micro_batch_size_per_gpu=2"):
        paro_config_from_deepspeed(ds_json({"strategy": "IIG"}, train_batch_size=12), world_size=WORLD)
    cfg = ds_json({"strategy": "NIG", "group_size": GROUP})
    del cfg["gradient_accumulation_steps"]
    paro, spec = paro_config_from_deepspeed(cfg, world_size=WORLD)
    assert spec.gradient_accumulation_steps == ACCUM and paro.gradient_accumulation_steps == ACCUM
    assert paro.max_grad_norm == CLIP and paro.strategy == "NIG" and paro.group_size == GROUP
    del cfg["gradient_clipping"]  # DeepSpeed's default is 1.0, not "off"
    assert paro_config_from_deepspeed(cfg, world_size=WORLD)[0].max_grad_norm == 1.0
    cfg["gradient_clipping"] = 0.0
    assert paro_config_from_deepspeed(cfg, world_size=WORLD)[0].max_grad_norm is None


def test_precision_translation():
    paro, _ = paro_config_from_deepspeed(ds_json({"strategy": "IIG"}, fp16={"enabled": True,
                                                                            "initial_scale_power": 8,
                                                                            "hysteresis": 1}), world_size=WORLD)
    assert paro.mixed_precision == "fp16" and paro.initial_loss_scale == 256.0
    paro, _ = paro_config_from_deepspeed(ds_json({"strategy": "IIG"}, bf16={"enabled": True}), world_size=WORLD)
    assert paro.mixed_precision == "bf16"


def test_unsupported_deepspeed_version():
    for version in ("0.15.4", "0.20.0", "1.0.0"):
        with pytest.raises(UnsupportedDeepSpeedError, match=f"DeepSpeed {version} is not supported"):
            check_deepspeed_version(version)
    assert check_deepspeed_version("0.19.8") == "0.19.8"


# ---------------------------------------------------------------------------------------------- equivalence
def _paro_config_run(data, rank):
    """The hand-written equivalent: ParoConfig + torch AdamW + DeepSpeed's WarmupLR, loop with no_sync."""
    import contextlib

    from paro_zero_backend import ParoEngine

    cfg = ds_json()
    model = tiny_gpt2()
    params = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=params["lr"], weight_decay=params["weight_decay"],
                            eps=params["eps"], betas=(0.9, 0.999))
    engine = ParoEngine(model, opt, ParoConfig(strategy="IIG", group_size=GROUP, max_grad_norm=CLIP))
    sched = _warmup(engine.optimizer, cfg)
    for step in range(data.shape[0]):
        for k in range(ACCUM):
            ids = data[step, k, rank]
            with engine.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                engine.backward(engine(input_ids=ids, labels=ids).loss / ACCUM)
        engine.step()
        sched.step()
    return engine.consolidated_state_dict()


def _warmup(optimizer, cfg):
    from deepspeed.runtime.lr_schedules import WarmupLR

    return WarmupLR(optimizer, **cfg["scheduler"]["params"])


def _ds_style_loop(engine, data, rank):
    for step in range(data.shape[0]):
        for k in range(ACCUM):
            ids = data[step, k, rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()


def _worker(rank: int, world: int, data: torch.Tensor) -> dict:
    from paro_zero_backend import ds_config as dsc

    out = {}
    engine, optimizer, _, sched = dsc.initialize(tiny_gpt2(), ds_json({"strategy": "IIG", "group_size": GROUP}))
    _ds_style_loop(engine, data, rank)
    out["json"] = engine.consolidated_state_dict()
    out["json_lr"] = engine.get_lr()
    out["global_steps"] = engine.global_steps
    out["paro_config"] = _paro_config_run(data, rank)
    if HAS_DS:  # the same JSON without the paro section, on DeepSpeed ZeRO-3
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        zero, *_ = deepspeed.initialize(model=tiny_gpt2(), config=ds_json())
        _ds_style_loop(zero, data, rank)
        named = list(zero.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            out["zero3"] = {n: p.detach().clone() for n, p in named}
        out["zero3_lr"] = [g["lr"] for g in zero.optimizer.param_groups]
    return _np(out)


@pytest.fixture(scope="module")
def results():
    if not HAS_DS:
        pytest.skip("the WarmupLR scheduler block needs DeepSpeed's scheduler classes (hf-scale-plugins[deepspeed])")
    data = make_batches(STEPS, ACCUM, WORLD, micro_batch=MICRO)
    return [_t(r) for r in run_distributed(_worker, WORLD, data, timeout=800, env={"DS_ACCELERATOR": "cpu"})]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepspeed_json_on_paro_equals_paro_config(results):
    for r in results:
        assert r["global_steps"] == STEPS
        assert max_rel_diff(r["json"], r["paro_config"]) < FP32_TOL  # same engine and order: tighter than clipping


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deepspeed_json_on_paro_equals_zero3(results):
    """Moving from ZeRO to PaRO is a config change: same JSON, same parameters and learning rate."""
    for r in results:
        assert max_rel_diff(r["json"], r["zero3"]) < CLIP_TOL
        assert r["json_lr"] == pytest.approx(r["zero3_lr"])
