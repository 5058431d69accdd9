"""The engine keeps every buffer on the model's device, so the code tested on gloo CPU ranks is the code that runs on
NCCL GPU ranks.

There is no GPU here, so the test moves the *default* device instead of the model: the ranks run with
``torch.device("meta")`` as the default for factory functions while the model, data and process groups stay on the
CPU. A buffer made without naming its device then lands on ``meta`` and mixes with CPU tensors (or reaches gloo),
which fails, exactly as a buffer left on the CPU fails next to CUDA parameters under NCCL. Under that default, every
tested strategy still equals single-process training, checkpoints round-trip, and the PaRO-CC collectives and the
bandwidth probe run. SGD with momentum stands in for AdamW, whose ``step`` counter is itself made on the default
device (a torch detail, not ours).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_placement import (
    backend_device_types,
    build_topology,
    check_collective_device,
    collective_device,
    run_distributed,
)
from paro_zero_backend import (
    ParoConfig,
    ParoEngine,
    hierarchical_all_gather,
    hierarchical_all_gather_coalesced,
    hierarchical_all_reduce,
    hierarchical_reduce_scatter,
    measure_bandwidths,
)
from paro_zero_backend.testing import max_rel_diff, to_numpy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORLD, STEPS, ACCUM, MICRO = 4, 2, 2, 3
STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "IIG", "III", "NII")
CLIP = 0.05
TOL = 1e-5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Tanh(), nn.Linear(13, 5))


def _sgd(params) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(STEPS, ACCUM, WORLD, MICRO, 7, generator=g),
            torch.randn(STEPS, ACCUM, WORLD, MICRO, 5, generator=g))


def _reference(clip: float | None) -> dict[str, torch.Tensor]:
    model = _model()
    opt = _sgd(model.parameters())
    x, y = _data()
    for step in range(STEPS):
        for k in range(ACCUM):
            for r in range(WORLD):
                (nn.functional.mse_loss(model(x[step, k, r]), y[step, k, r]) / (ACCUM * WORLD)).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(engine: ParoEngine, x, y, rank: int, steps: range) -> None:
    for step in steps:
        for k in range(ACCUM):
            ctx = engine.no_sync() if k < ACCUM - 1 else contextlib.nullcontext()
            with ctx:
                engine.backward(nn.functional.mse_loss(engine(x[step, k, rank]), y[step, k, rank]) / ACCUM)
        engine.step()


def _under_meta_default(rank: int, world: int, tmp: str) -> dict:
    x, y = _data()
    models = {name: _model() for name in (*STRATEGIES, "GGG_flat", "IIG_clip", "fp16", "ckpt", "ckpt_resumed")}
    out: dict = {"equiv": {}}
    with torch.device("meta"):
        out["default_device"] = str(torch.empty(1).device)  # the premise of the test
        for st in STRATEGIES:
            engine = ParoEngine(models[st], _sgd(models[st].parameters()), ParoConfig(strategy=st, group_size=2))
            _train(engine, x, y, rank, range(STEPS))
            out["equiv"][st] = engine.consolidated_state_dict()
            engine.remove_hooks()
        flat = ParoEngine(models["GGG_flat"], _sgd(models["GGG_flat"].parameters()),
                          ParoConfig(strategy="GGG", group_size=2, paro_cc=False, bucket_size=50))
        _train(flat, x, y, rank, range(STEPS))
        out["equiv"]["GGG_flat"] = flat.consolidated_state_dict()
        clip = ParoEngine(models["IIG_clip"], _sgd(models["IIG_clip"].parameters()),
                          ParoConfig(strategy="IIG", group_size=2, max_grad_norm=CLIP))
        _train(clip, x, y, rank, range(STEPS))
        out["clip"] = clip.consolidated_state_dict()
        # fp16: the overflow flag and the fp32 master copy are buffers of their own
        half = ParoEngine(models["fp16"], _sgd(models["fp16"].parameters()),
                          ParoConfig(strategy="GGG", group_size=2, mixed_precision="fp16"))
        _train(half, x.half(), y.half(), rank, range(1))
        out["fp16_devices"] = sorted({str(p.device) for p in half.module.parameters()})
        out["fp16_finite"] = all(torch.isfinite(v).all().item() for v in half.consolidated_state_dict().values())
        # checkpoints: consolidated into a fresh engine (optimizer state included), and sharded back into it
        a = ParoEngine(models["ckpt"], _sgd(models["ckpt"].parameters()), ParoConfig(strategy="IIG", group_size=2))
        _train(a, x, y, rank, range(1))
        a.save_consolidated(os.path.join(tmp, "consolidated"))
        b = ParoEngine(models["ckpt_resumed"], _sgd(models["ckpt_resumed"].parameters()),
                       ParoConfig(strategy="GGG", group_size=2))
        b.load_consolidated(os.path.join(tmp, "consolidated"))
        b.save_sharded(os.path.join(tmp, "sharded"))
        b.load_sharded(os.path.join(tmp, "sharded"))
        out["optimizer_state_devices"] = sorted({str(v.device) for st in b.optimizer.state.values()
                                                 for v in st.values() if isinstance(v, torch.Tensor)})
        _train(b, x, y, rank, range(1, STEPS))
        out["resumed"] = b.consolidated_state_dict()
        # PaRO-CC standalone collectives and the bandwidth probe
        topo = build_topology(group_size=2)
        v = torch.arange(6, dtype=torch.float32, device="cpu") + rank
        out["cc_devices"] = sorted({str(t.device) for t in (
            hierarchical_all_gather(v, topo).output, hierarchical_reduce_scatter(v.repeat(WORLD), topo).output,
            hierarchical_all_reduce(v, topo).output, *[r.output for r in hierarchical_all_gather_coalesced(
                [v, 2 * v], topo)])})
        out["bandwidths"] = measure_bandwidths(topo, repeats=1)
        out["collective_device"] = str(collective_device())
    out["equiv"] = {k: to_numpy(v) for k, v in out["equiv"].items()}
    out["clip"], out["resumed"] = to_numpy(out["clip"]), to_numpy(out["resumed"])
    return out


@pytest.fixture(scope="module")
def meta_default_runs(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("paro_device"))
    return run_distributed(_under_meta_default, WORLD, tmp, timeout=420)


def _as_torch(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in state.items()}


def test_every_buffer_follows_the_model_device_and_strategies_still_equal_one_process(meta_default_runs):
    ref, ref_clip = _reference(None), _reference(CLIP)
    for rank, out in enumerate(meta_default_runs):
        assert out["default_device"] == "meta", out["default_device"]
        for name, state in out["equiv"].items():
            assert max_rel_diff(_as_torch(state), ref) < TOL, (rank, name)
        assert max_rel_diff(_as_torch(out["clip"]), ref_clip) < 1e-4, rank
        assert max_rel_diff(_as_torch(out["resumed"]), ref) < TOL, rank
        assert out["fp16_devices"] == ["cpu"] and out["fp16_finite"], out
        assert out["optimizer_state_devices"] == ["cpu"], out["optimizer_state_devices"]
        assert out["cc_devices"] == ["cpu"], out["cc_devices"]
        assert all(b > 0 for b in out["bandwidths"]), out["bandwidths"]
        assert out["collective_device"] == "cpu"


def _engine_errors(rank: int, world: int) -> dict[str, str]:
    errors = {}
    for where in ("split", "meta"):
        model = _model()
        if where == "meta":
            model = model.to("meta")
        else:  # one parameter left behind on another device
            model[0].bias = nn.Parameter(torch.zeros(13, device="meta"))
        try:
            ParoEngine(model, _sgd(model.parameters()), ParoConfig(strategy="NNN", group_size=1))
            errors[where] = "no error"
        except ValueError as exc:
            errors[where] = str(exc)
    return errors


def test_a_model_on_several_devices_or_not_materialised_is_named():
    errors = run_distributed(_engine_errors, 2, timeout=120)[0]
    assert "one device" in errors["split"] and "meta" in errors["split"] and "model.to(device)" in errors["split"], \
        errors
    assert "not materialised" in errors["meta"], errors


@pytest.mark.parametrize("config, types, probe", [("cpu:gloo,cuda:gloo", ("cpu", "cuda"), "cpu"),
                                                  ("cuda:nccl", ("cuda",), "cuda:1"),
                                                  ("cpu:gloo,cuda:nccl", ("cpu", "cuda"), "cuda:1")])
def test_backend_device_types_and_the_cpu_model_under_nccl_error(monkeypatch, config, types, probe):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # no GPU here: the rank's current device
    assert backend_device_types() == types
    # a bandwidth probe crosses NCCL's links where NCCL is there, even beside gloo
    assert collective_device(accelerator_first=True) == torch.device(probe)
    if "cpu" in types:
        assert collective_device() == torch.device("cpu")
        check_collective_device(torch.device("cpu"), None, "the model")
    else:
        assert collective_device() == torch.device("cuda", 1)
        with pytest.raises(ValueError, match=r"the model is on cpu, but the process group's backend \(cuda:nccl\) "
                                             r"communicates only cuda tensors: move it"):
            check_collective_device(torch.device("cpu"), None, "the model")
