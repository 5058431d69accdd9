"""The PaRO engine on sub-groups of the world, frozen (inference-only) engines, pinned weights and wrapper units.

4 gloo ranks in ONE `run_distributed` call. Ranks [0, 1] and [2, 3] each form a topology (groups of 1 and of 2
ranks); each pair trains its own model on its own data at the same time, and each must equal its own single-process
AdamW run: an engine that used the default group anywhere (a broadcast from rank 0, a world barrier) would mix the
pairs or hang. The same worker checks frozen engines (optimizer=None) with `gathered()` generation, and the PPO
wrapper pattern (the trainer calls ``wrapper.policy`` and the value model's backbone and score head directly).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hf_placement import build_topology, run_distributed
from paro_zero_backend import ParoConfig, ParoEngine, bytes_per_element, memory_bytes, resolve_strategy, traffic
from paro_zero_backend.testing import (
    from_numpy,
    make_adamw,
    make_batches,
    max_rel_diff,
    paro_train,
    reference_run,
    tiny_gpt2,
    to_numpy,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

WORLD = 4
PAIRS = ((0, 1), (2, 3))
SEEDS = (0, 5)  # each pair its own initial weights: a broadcast from the wrong source would show
STEPS, ACCUM = 2, 2
FP32_TOL = 1e-5
RUNS = (("GGG", 1), ("IIG", 2), ("IIG", 1), ("GGG", 2))  # (strategy, ranks per group inside the pair)


class PolicyAndValueWrapper(nn.Module):
    """The shape of TRL's PPO wrapper: the trainer never calls this forward, only the sub-models directly."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, **kwargs):
        return self.policy(**kwargs), self.value_model(**kwargs)


def _wrapper(seed: int = 7) -> PolicyAndValueWrapper:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    policy = tiny_gpt2(seed=seed)
    torch.manual_seed(seed + 1)
    cfg = GPT2Config(n_layer=1, n_embd=30, n_head=2, vocab_size=61, n_positions=16, num_labels=1, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)
    return PolicyAndValueWrapper(policy, GPT2ForSequenceClassification(cfg))


def _wrapper_units(w: PolicyAndValueWrapper) -> list[nn.Module]:
    vm = w.value_model
    return [w.policy, getattr(vm, vm.base_model_prefix), vm.score]


def _wrapper_loss(w: PolicyAndValueWrapper, ids: torch.Tensor) -> torch.Tensor:
    """What a PPO update does: policy logits, then the value model's backbone and score head called directly."""
    logits = w.policy(input_ids=ids).logits
    vm = w.value_model
    hidden = getattr(vm, vm.base_model_prefix)(input_ids=ids).last_hidden_state
    values = vm.score(hidden).squeeze(-1)
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    return lm + 0.5 * values.pow(2).mean()


def _wrapper_reference(data: torch.Tensor) -> dict[str, torch.Tensor]:
    w = _wrapper()
    opt = make_adamw(w.parameters())
    steps, s, n = data.shape[:3]
    for step in range(steps):
        for k in range(s):
            for r in range(n):
                (_wrapper_loss(w, data[step, k, r]) / (s * n)).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in w.named_parameters()}


def _memory_check(engine: ParoEngine, **dtypes) -> tuple[int, float]:
    pad = engine.padded_numel()
    want = memory_bytes(engine.strategy, pad["all"], pad["trainable"], engine.world_size, engine.group_size,
                        **bytes_per_element(**dtypes))["total"]
    return engine.memory_bytes()["total"], want


def _topology_checks(rank: int, tops: dict) -> dict:
    out = {}
    pair = 0 if rank < 2 else 1
    mine, other = tops[(pair, 1)], tops[(1 - pair, 1)]
    out["member"] = (mine.is_member, mine.rank, mine.ranks, mine.global_rank(1), mine.world_size, mine.num_groups)
    out["non_member"] = (other.is_member, other.rank, other.intra_group, other.inter_group, other.world_group)
    out["cached"] = build_topology(group_size=1, ranks=list(PAIRS[pair])) is mine
    out["default_group_size"] = tops["default"][pair].group_size  # LOCAL_WORLD_SIZE=4 clipped to the 2 members
    out["whole_world"] = build_topology(group_size=2, ranks=[0, 1, 2, 3]).world_group is dist.group.WORLD
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine.world_group)
    out["pair_sum"] = float(t)
    errors = {}
    for key, kwargs in (("unsorted", {"ranks": [1, 0]}), ("divisor", {"ranks": [0, 1], "group_size": 3}),
                        ("range", {"ranks": [0, 9]})):
        try:
            build_topology(**kwargs)
        except ValueError as exc:
            errors[key] = str(exc)
    try:
        ParoEngine(tiny_gpt2(), make_adamw(tiny_gpt2().parameters()), ParoConfig(strategy="GGG"), topology=other)
    except ValueError as exc:
        errors["non_member_engine"] = str(exc)
    try:
        model = tiny_gpt2()
        ParoEngine(model, make_adamw(model.parameters()), ParoConfig(strategy="auto"), topology=mine)
    except ValueError as exc:
        errors["auto"] = str(exc)
    out["errors"] = errors
    return out


def _train_pairs(rank: int, tops: dict, data: torch.Tensor) -> dict:
    pair = 0 if rank < 2 else 1
    pair_data = data[:, :, 2 * pair:2 * pair + 2]
    out = {}
    for strategy, m in RUNS:
        topo = tops[(pair, m)]
        model = tiny_gpt2(seed=SEEDS[pair])
        engine = ParoEngine(model, make_adamw(model.parameters()), ParoConfig(strategy=strategy, bucket_size=10**6),
                            topology=topo)
        paro_train(engine, pair_data, topo.rank)
        pad = engine.padded_numel()
        want = traffic(engine.strategy, pad["all"], pad["trainable"], 2, m, ACCUM, bytes_param=4, bytes_grad=4)
        out[(strategy, m)] = {
            "state": to_numpy(engine.consolidated_state_dict()),
            "traffic": ({k: engine.last_step_bytes[k] for k in ("intra", "inter", "flat")},
                        {k: int(round(want[k])) for k in ("intra", "inter", "flat")}),
            "memory": _memory_check(engine),
        }
        engine.remove_hooks()
    return out


def _frozen(rank: int, tops: dict) -> dict:
    pair = 0 if rank < 2 else 1
    topo = tops[(pair, 2)]
    out = {}
    model = tiny_gpt2(seed=3).requires_grad_(False).eval()
    engine = ParoEngine(model, None, ParoConfig(strategy="GGG"), topology=topo)
    ids = torch.randint(1, 61, (2, 5), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out["logits"] = engine(input_ids=ids).logits.numpy().copy()  # per-unit gathers, no pinning
    b0 = engine.gathered_bytes
    with engine.gathered():
        b1 = engine.gathered_bytes
        with engine.gathered():  # re-entrant: the inner block neither gathers nor releases
            gen = engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        still = all(p.numel() > 0 for p in model.parameters())
        b2 = engine.gathered_bytes
    released = all(p.numel() == 0 for p in model.parameters())
    engine.module.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # unpinned: gathers per forward
    out["generate"] = gen.numpy().copy()
    out["bytes"] = (b1 - b0, b2 - b1, engine.gathered_bytes - b2)
    out["pinning"] = (still, released)
    out["memory"] = _memory_check(engine)
    errors = {}
    try:
        ParoEngine(tiny_gpt2(), None, ParoConfig(strategy="GGG"), topology=topo)
    except ValueError as exc:
        errors["trainable_without_optimizer"] = str(exc)
    try:
        engine.backward(engine(input_ids=ids).logits.sum())
    except RuntimeError as exc:
        errors["backward"] = str(exc)
    out["errors"] = errors
    # bf16 inference engine: 2 bytes per parameter slice, nothing else
    bf16 = ParoEngine(tiny_gpt2(seed=3).requires_grad_(False), None, ParoConfig(strategy="IIG", mixed_precision="bf16"),
                      topology=topo)
    out["memory_bf16"] = _memory_check(bf16, mixed_precision="bf16")
    return out


def _wrapper_run(rank: int, tops: dict, data: torch.Tensor) -> dict:
    pair = 0 if rank < 2 else 1
    topo = tops[(pair, 2)]
    pair_data = data[:, :, 2 * pair:2 * pair + 2]
    out = {}
    w = _wrapper()
    engine = ParoEngine(w, make_adamw(w.parameters()), ParoConfig(strategy="GGG", unit_module_classes=[]),
                        topology=topo, extra_units=_wrapper_units(w))
    for step in range(STEPS):
        # the first step runs pinned (forward, backward and the step inside gathered()): same result
        pinned = engine.gathered() if step == 0 else contextlib.nullcontext()
        with pinned:
            for k in range(ACCUM):
                with engine.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                    engine.backward(_wrapper_loss(w, pair_data[step, k, topo.rank]) / ACCUM)
            engine.step()
    out["state"] = to_numpy(engine.consolidated_state_dict())
    out["memory"] = _memory_check(engine)
    # reshard_after_forward=False keeps each unit's gathered parameters from its forward to its backward: the same
    # update with one parameter gather per micro-step instead of two; and pinning one sub-module gathers only it.
    out["reshard"] = {}
    for reshard in (True, False):
        w3 = _wrapper()
        eng = ParoEngine(w3, make_adamw(w3.parameters()),
                         ParoConfig(strategy="GGG", unit_module_classes=[], reshard_after_forward=reshard),
                         topology=topo, extra_units=_wrapper_units(w3))
        for step in range(STEPS):
            for k in range(ACCUM):
                with eng.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                    eng.backward(_wrapper_loss(w3, pair_data[step, k, topo.rank]) / ACCUM)
            eng.step()
        before = eng.gathered_bytes
        with eng.gathered(w3.policy):
            partial = (eng.gathered_bytes - before, all(p.numel() > 0 for p in w3.policy.parameters()),
                       all(p.numel() == 0 for p in w3.value_model.parameters()))
        out["reshard"][reshard] = {"state": to_numpy(eng.consolidated_state_dict()),
                                   "t_param": eng.last_step_terms.get("t_param", 0), "partial": partial,
                                   "policy_bytes": sum(b.p_store.numel() * 4 for b in eng.buckets
                                                       if any(s.name.startswith("policy.") for s in b.slots))}
    # Only the policy as a unit: the value model's parameters belong to the wrapper (root), whose forward never runs.
    w2 = _wrapper()
    bad = ParoEngine(w2, make_adamw(w2.parameters()), ParoConfig(strategy="GGG", unit_module_classes=[]),
                     topology=topo, extra_units=[w2.policy])
    try:
        _wrapper_loss(w2, pair_data[0, 0, topo.rank])
        out["unit_error"] = None
    except RuntimeError as exc:
        out["unit_error"] = str(exc)
    bad.remove_hooks()
    # "auto" resolved on the pair before the engine: bandwidths measured over the pair's groups
    model = tiny_gpt2()
    resolved = resolve_strategy(ParoConfig(strategy="auto", gradient_accumulation_steps=ACCUM), model, tops[(pair, 1)])
    out["auto"] = (resolved.config.strategy, resolved.guideline.inputs.world_size, resolved.guideline.inputs.group_size)
    return out


def _worker(rank: int, world: int, data: torch.Tensor) -> dict:
    # Collective: every rank builds every topology, in the same order.
    tops: dict = {}
    for m in (1, 2):
        for p, ranks in enumerate(PAIRS):
            tops[(p, m)] = build_topology(group_size=m, ranks=list(ranks))
    tops["default"] = [build_topology(ranks=list(ranks)) for ranks in PAIRS]
    return {"topology": _topology_checks(rank, tops), "train": _train_pairs(rank, tops, data),
            "frozen": _frozen(rank, tops), "wrapper": _wrapper_run(rank, tops, data)}


@pytest.fixture(scope="module")
def results():
    data = make_batches(STEPS, ACCUM, WORLD)
    refs = [to_numpy(reference_run(tiny_gpt2(seed=SEEDS[p]), data[:, :, 2 * p:2 * p + 2])) for p in range(2)]
    wrapper_refs = [to_numpy(_wrapper_reference(data[:, :, 2 * p:2 * p + 2])) for p in range(2)]
    model = tiny_gpt2(seed=3).requires_grad_(False).eval()
    ids = torch.randint(1, 61, (2, 5), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        frozen = {"logits": model(input_ids=ids).logits.numpy(),
                  "generate": model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).numpy()}
    out = run_distributed(_worker, WORLD, data, timeout=550)
    return {"ranks": out, "refs": refs, "wrapper_refs": wrapper_refs, "frozen": frozen}


def test_sub_group_topologies(results):
    for rank, res in enumerate(results["ranks"]):
        t = res["topology"]
        pair = PAIRS[rank // 2]
        assert t["member"] == (True, rank % 2, pair, pair[1], 2, 2)
        assert t["non_member"] == (False, -1, None, None, None)
        assert t["cached"] and t["whole_world"] and t["default_group_size"] == 2
        assert t["pair_sum"] == sum(pair)  # the pair's group holds exactly the pair
        errors = t["errors"]
        assert "strictly increasing" in errors["unsorted"] and "strictly increasing" in errors["range"]
        assert "group_size=3 does not divide the 2 ranks [0, 1]" in errors["divisor"] and "[1, 2]" in errors["divisor"]
        assert f"global rank {rank}" in errors["non_member_engine"]
        assert str(list(PAIRS[1 - rank // 2])) in errors["non_member_engine"]
        assert "resolve_strategy" in errors["auto"]


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-m{r[1]}")
def test_two_sub_group_engines_match_their_single_process_runs(results, run):
    for rank, res in enumerate(results["ranks"]):
        got = res["train"][run]
        assert max_rel_diff(from_numpy(got["state"]), from_numpy(results["refs"][rank // 2])) <= FP32_TOL, rank
        assert got["traffic"][0] == got["traffic"][1], (rank, got["traffic"])
        assert got["memory"][0] == got["memory"][1], (rank, got["memory"])


def test_frozen_engine_gathered_generation(results):
    want = results["frozen"]
    for res in results["ranks"]:
        f = res["frozen"]
        np.testing.assert_allclose(f["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(f["generate"], want["generate"])
        entry, during, unpinned = f["bytes"]
        assert entry > 0 and during == 0, f["bytes"]  # one gather for the whole generation
        assert unpinned >= 3 * entry, f["bytes"]  # unpinned: one gather per decoding forward
        assert f["pinning"] == (True, True)
        assert f["memory"][0] == f["memory"][1] and f["memory_bf16"][0] == f["memory_bf16"][1]
        assert "freeze the model" in f["errors"]["trainable_without_optimizer"]
        assert "inference-only" in f["errors"]["backward"]


def test_wrapper_units_match_single_process(results):
    for rank, res in enumerate(results["ranks"]):
        w = res["wrapper"]
        assert max_rel_diff(from_numpy(w["state"]), from_numpy(results["wrapper_refs"][rank // 2])) <= FP32_TOL
        assert w["memory"][0] == w["memory"][1]
        msg = w["unit_error"]
        assert msg is not None and "extra_units" in msg and "'<root>'" in msg and "value_model" in msg


def test_auto_is_resolved_on_the_sub_group(results):
    picks = [res["wrapper"]["auto"] for res in results["ranks"]]
    assert picks[0] == picks[1] and picks[2] == picks[3]
    assert all(p[1:] == (2, 1) for p in picks)


def test_reshard_after_forward_halves_the_parameter_gathers(results):
    for rank, res in enumerate(results["ranks"]):
        runs = res["wrapper"]["reshard"]
        for reshard in (True, False):
            got = from_numpy(runs[reshard]["state"])
            assert max_rel_diff(got, from_numpy(results["wrapper_refs"][rank // 2])) <= FP32_TOL, (rank, reshard)
        assert runs[False]["t_param"] * 2 == runs[True]["t_param"] > 0, rank
        sent, policy_full, value_released = runs[False]["partial"]
        assert policy_full and value_released  # a pin of the policy leaves the value model sharded
        assert sent == runs[False]["policy_bytes"]  # one all-gather of the policy's slices: (n-1) x this rank's
