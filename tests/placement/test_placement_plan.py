"""PlacementPlan validation and serialisation, the memory accountant, the planner's cost model and its CLI.
Single process, no process groups."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_placement import PlacementPlan
from hf_placement.groups import planned_rank_sets
from hf_placement.planner import (
    Calibration,
    Hardware,
    ModelSizes,
    Workload,
    candidate_plans,
    estimate,
    model_state_bytes,
    rank_plans,
    shard_verdict,
)
from hf_placement.runtime import select_tensors
from hf_placement.runtime.channels import pack_tree, unpack_tree

REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------------- constructors
def test_constructors_follow_the_paper():
    colo = PlacementPlan.colocated(4)
    assert all(colo.roles[r] == [0, 1, 2, 3] for r in ("actor", "critic", "ref", "reward"))
    inter = PlacementPlan.interleaved(4)  # APP: ref on the first half, reward on the second
    assert inter.roles["ref"] == [0, 1] and inter.roles["reward"] == [2, 3] and inter.roles["actor"] == [0, 1, 2, 3]
    assert inter.partners("ref") == {0: [2], 1: [3]} and inter.partners("reward") == {2: [0], 3: [1]}
    assert inter.owner_of("reward", 1) == 3 and inter.owner_of("ref", 0) == 0
    quarter = PlacementPlan.interleaved(8, ratios={"ref": 0.25, "reward": 0.25})
    assert quarter.roles["ref"] == [0, 1] and quarter.roles["reward"] == [2, 3]
    assert quarter.partners("ref") == {0: [2, 4, 6], 1: [3, 5, 7]}  # ceil(6/2) = 3 partners each
    dis = PlacementPlan.disaggregated(4, rollout_replicas=2)
    assert dis.roles["actor"] == [0, 1] and dis.roles["rollout"] == [2, 3]
    assert dis.replica_ranks() == [[2], [3]] and dis.data_ranks() == [2, 3]
    assert dis.sync_pairs() == [("actor", "rollout"), ("critic", "value")]
    assert dis.experience_routes() == {2: [0], 3: [1]}
    assert PlacementPlan.disaggregated(3, train_ranks=[0]).experience_routes() == {1: [0], 2: [0]}
    assert PlacementPlan.disaggregated(3, train_ranks=[0, 1]).experience_routes() == {2: [0, 1]}
    with pytest.raises(ValueError, match="only in disaggregated plans"):
        inter.experience_routes()
    dis2 = PlacementPlan.disaggregated(3, infer_ranks=[0])
    assert dis2.roles["actor"] == [1, 2] and dis2.roles["reward"] == [0]
    custom = PlacementPlan.custom(4, {"actor": [0, 1, 2, 3], "critic": [0, 1, 2, 3], "ref": [0], "reward": [3]})
    assert custom.partners("reward", data_ranks=[0, 1, 2, 3]) == {3: [0, 1, 2]}
    assert "reward   [3]" in custom.describe()


def test_group_creation_order_is_a_pure_function_of_the_plan():
    dis = PlacementPlan.disaggregated(4, rollout_replicas=2)
    sets = planned_rank_sets(dis, extra_rank_sets=[[1, 0]])
    # roles (deduplicated), replicas, one sync group (actor->rollout and critic->value share [0, 2, 3]); the extra
    # set [1, 0] is the actor group already
    assert sets == [(0, 1), (2, 3), (2,), (3,), (0, 2, 3)]
    assert sets == planned_rank_sets(PlacementPlan.from_dict(dis.to_dict()), extra_rank_sets=[[0, 1]])


# ------------------------------------------------------------------------------------------------------- validation
BAD_PLANS = [
    # (kwargs, substring of the error)
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [], "reward": [0, 1]}), "role 'ref' has no"),
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [0]}), "role 'reward' is missing"),
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [0], "reward": [1], "judge": [0]}),
     "unknown role(s) ['judge']"),
    (dict(world_size=2, roles={"actor": [0, 2], "critic": [0, 1], "ref": [0], "reward": [1]}),
     "role 'actor' has rank(s) [2] outside the world of 2"),
    (dict(world_size=2, roles={"actor": [0, 0, 1], "critic": [0, 1], "ref": [0], "reward": [1]}), "more than once"),
    (dict(world_size=4, roles={"actor": [0, 1, 2, 3], "critic": [0, 1, 2, 3], "ref": [0, 1, 2], "reward": [2, 3]}),
     "roles 'ref' [0, 1, 2] and 'reward' [2, 3] partially overlap"),
    (dict(world_size=4, roles={"actor": [0, 1], "critic": [0, 1], "ref": [2, 3], "reward": [2, 3], "rollout": [1, 2],
                               "value": [2, 3]}), "role 'rollout' (shadow model) shares rank(s) [1] with 'actor'"),
    (dict(world_size=4, roles={"actor": [0, 1], "critic": [0, 1], "ref": [2, 3], "reward": [2, 3],
                               "rollout": [2, 3]}), "'rollout' is placed but 'value' is not"),
    (dict(world_size=4, roles={"actor": [0, 1, 2], "critic": [0, 1, 2], "ref": [0], "reward": [1]}),
     "rank(s) [3] hold no role: world_size=4 does not match"),
    (dict(world_size=0, roles={}), "world_size must be a positive integer"),
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [0], "reward": [1]}, strategy="flat"),
     "strategy='flat' is not one of"),
    (dict(world_size=3, roles={"actor": [0], "critic": [0], "ref": [1, 2], "reward": [1, 2], "rollout": [1, 2],
                               "value": [1, 2]}, rollout_replicas=3), "rollout_replicas=3 does not divide the 2"),
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [0], "reward": [1]}, rollout_replicas=2),
     "needs a 'rollout' role"),
    (dict(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": [0], "reward": [1]},
          sharded_roles=["rollout"]), "sharded_roles names role(s) ['rollout']"),
]


@pytest.mark.parametrize("kwargs,message", BAD_PLANS, ids=[m[:30] for _, m in BAD_PLANS])
def test_bad_plans_name_the_problem(kwargs, message):
    with pytest.raises(ValueError) as err:
        PlacementPlan(**kwargs)
    assert message in str(err.value)


def test_bad_types_and_ratios():
    with pytest.raises(TypeError, match="role 'ref' has a non-integer rank"):
        PlacementPlan(world_size=2, roles={"actor": [0, 1], "critic": [0, 1], "ref": ["0"], "reward": [1]})
    with pytest.raises(ValueError, match="ratios do not pack"):
        PlacementPlan.interleaved(4, ratios={"ref": 0.75, "reward": 0.5})
    with pytest.raises(ValueError, match="whole number of ranks"):
        PlacementPlan.interleaved(4, ratios={"ref": 0.3, "reward": 0.7})
    with pytest.raises(ValueError, match=r"unknown role\(s\) \['rollout'\]"):
        PlacementPlan.interleaved(4, ratios={"rollout": 0.5})
    with pytest.raises(ValueError, match="share rank"):
        PlacementPlan.disaggregated(4, train_ranks=[0, 1], infer_ranks=[1, 2, 3])
    with pytest.raises(ValueError, match="world_size >= 2"):
        PlacementPlan.disaggregated(1)


def test_world_size_and_batch_checks():
    plan = PlacementPlan.interleaved(4)
    with pytest.raises(ValueError, match="plan is for world_size=4 but the job has 2 ranks"):
        plan.check_world_size(2)
    plan.check_batch(8, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"batch size 6 does not divide among the 4 owner ranks of role 'actor'"):
        plan.check_batch(6)
    with pytest.raises(ValueError, match=r"micro batch size 3 does not divide the per-rank share 2 of role 'actor'"):
        plan.check_batch(8, micro_batch_size=3)
    odd = PlacementPlan.custom(4, {"actor": [0, 1, 2, 3], "critic": [0, 1, 2, 3], "ref": [0, 1, 2], "reward": [3]})
    with pytest.raises(ValueError, match=r"batch size 4 does not divide among the 3 owner ranks of role 'ref'"):
        odd.check_batch(4)


# ---------------------------------------------------------------------------------------------------- serialisation
@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_load_roundtrip(tmp_path, suffix):
    plan = PlacementPlan.disaggregated(4, rollout_replicas=2, sharded_roles=["ref"])
    path = plan.save(tmp_path / f"plan{suffix}")
    assert PlacementPlan.load(path) == plan
    assert plan.sharded_roles == {"ref": "GGG"}  # a list of roles means ZeRO-3 ("GGG") for each


def test_sharded_roles_carry_a_strategy_per_role():
    plan = PlacementPlan.interleaved(4, sharded_roles={"actor": "iig", "critic": "IIG", "reward": "GGG"})
    assert plan.sharded_roles == {"actor": "IIG", "critic": "IIG", "reward": "GGG"}  # normalised, role order
    assert "reward   [2, 3] (sharded, GGG)" in plan.describe()
    assert PlacementPlan.from_dict(plan.to_dict()) == plan
    assert PlacementPlan.colocated(2, sharded="NNG").sharded_roles == dict.fromkeys(("actor", "critic", "ref",
                                                                                     "reward"), "NNG")
    with pytest.raises(TypeError, match="list of roles or a mapping"):
        PlacementPlan.colocated(2).__class__(world_size=2, roles=PlacementPlan.colocated(2).roles,
                                             sharded_roles="actor")
    # the intra group of a role: ranks per node clipped to the role's size, and it must split the role evenly
    assert plan.role_group_size("actor", 2) == 2 and plan.role_group_size("ref", 4) == 2
    assert plan.role_group_size("actor") == 4
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        plan.role_group_size("actor", 3)


def test_unknown_keys_and_missing_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown plan key\(s\) \['ratio', 'replicas'\]; valid keys are"):
        PlacementPlan.from_dict({"world_size": 2, "roles": {}, "replicas": 2, "ratio": 1})
    with pytest.raises(ValueError, match="missing required key 'roles'"):
        PlacementPlan.from_dict({"world_size": 2})
    bad = tmp_path / "bad.yaml"
    bad.write_text("world_size: 2\nroles: {actor: [0, 1], critic: [0, 1], ref: [0], reward: [1]}\nstratgy: x\n")
    with pytest.raises(ValueError, match=r"unknown plan key\(s\) \['stratgy'\]"):
        PlacementPlan.load(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PlacementPlan.load(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------------------------------------- memory
PHI = 1_000_000.0


@pytest.mark.parametrize("precision,colo,inter,trainer,generator,colo_z3", [
    ("fp32", 40, 36, 32, 16, 20),
    ("bf16", 36, 34, 32, 8, 18),
])
def test_memory_table_of_the_doc(precision, colo, inter, trainer, generator, colo_z3):
    sizes = ModelSizes(actor=PHI)
    per_param = lambda plan: [model_state_bytes(plan, sizes, precision).rank_bytes(r) / PHI
                              for r in range(plan.world_size)]
    assert per_param(PlacementPlan.colocated(2)) == [colo, colo]
    assert per_param(PlacementPlan.interleaved(2)) == [inter, inter]
    assert per_param(PlacementPlan.disaggregated(2)) == [trainer, generator]
    assert per_param(PlacementPlan.colocated(2, sharded=True)) == [colo_z3, colo_z3]


def test_memory_lora_row_and_cap_verdicts():
    sizes = ModelSizes(actor=PHI, lora_fraction=1e-4)
    colo = model_state_bytes(PlacementPlan.colocated(2), sizes, "bf16").rank_bytes(0) / PHI
    inter = model_state_bytes(PlacementPlan.interleaved(2), sizes, "bf16").rank_bytes(0) / PHI
    assert colo == pytest.approx(8, abs=0.01) and inter == pytest.approx(6, abs=0.01)
    cap = 38 * PHI  # between 36 and 40 bytes/param, fp32
    v = shard_verdict(PlacementPlan.colocated(2), ModelSizes(actor=PHI), cap)
    assert v.must_shard and v.fits_sharded and "must shard" in v.message
    for plan in (PlacementPlan.interleaved(2), PlacementPlan.disaggregated(2)):
        assert shard_verdict(plan, ModelSizes(actor=PHI), cap).fits
    tight = shard_verdict(PlacementPlan.colocated(2), ModelSizes(actor=PHI), 10 * PHI)
    assert not tight.fits_sharded and "does not fit even sharded" in tight.message
    assert model_state_bytes(PlacementPlan.colocated(2), {"actor": PHI}).over_cap(cap) == [0, 1]
    with pytest.raises(ValueError, match="precision='fp16'"):
        model_state_bytes(PlacementPlan.colocated(2), sizes, "fp16")


# ------------------------------------------------------------------------------------------------------ cost model
def test_planner_under_a_memory_cap():
    w = Workload(actor_params=26e6, batch_size=16, prompt_len=16, response_len=32)
    free = {e.name: e for e in rank_plans(w, Hardware.cpu(2))}
    assert all(e.fits for e in free.values())
    capped = rank_plans(w, Hardware.cpu(2, memory_cap_bytes=38 * 26e6))
    by_name = {e.name: e for e in capped}
    assert not by_name["colocated"].fits and "must shard" in by_name["colocated"].notes
    assert by_name["colocated-sharded"].fits and by_name["interleaved"].fits and by_name["disaggregated-1t1i"].fits
    assert capped[-1].name == "colocated"  # over the cap: ranked after every plan that fits
    assert by_name["colocated-sharded"].time_s > free["colocated"].time_s  # sharding pays parameter gathers
    # interleaving holds fewer model-state bytes per rank than co-located
    assert by_name["interleaved"].memory_max_bytes < free["colocated"].memory_max_bytes
    best = capped[0]
    assert best.fits and best.name != "colocated"


def test_planner_responds_to_the_workload():
    hw = Hardware.cpu(2)
    short = {e.name: e.time_s for e in rank_plans(Workload(actor_params=4e6, response_len=8), hw)}
    long = {e.name: e.time_s for e in rank_plans(Workload(actor_params=4e6, response_len=256), hw)}
    assert all(long[k] > short[k] for k in short)
    # a slower link hurts sharded co-location (parameter gathers) far more than DP co-location (one grad all-reduce)
    w = Workload(actor_params=26e6)
    fast = {e.name: e.time_s for e in rank_plans(w, Hardware.cpu(2, link_bandwidth=1e10))}
    slow = {e.name: e.time_s for e in rank_plans(w, Hardware.cpu(2, link_bandwidth=1e8))}
    assert slow["colocated-sharded"] - fast["colocated-sharded"] > 3 * (slow["colocated"] - fast["colocated"])
    # calibration reproduces the measured single-device phase times exactly
    cal = Calibration(generate_s=2.0, inference_s=3.0, train_s=4.0)
    one = estimate(PlacementPlan.colocated(1), w, Hardware.cpu(1), cal)
    assert one.phases["generate"] == pytest.approx(2.0) and one.phases["inference"] == pytest.approx(3.0)
    assert one.phases["train"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="plan is for 2 ranks but hardware.devices=4"):
        estimate(PlacementPlan.colocated(2), w, Hardware.cpu(4))
    with pytest.raises(ValueError, match="Workload.batch_size=0"):
        Workload(actor_params=1e6, batch_size=0)


def test_gradient_syncs_count_optimizer_steps_and_use_the_reduce_scatter_bandwidth():
    # Every optimizer step (ppo_epochs x mini_batches) synchronises the gradients of a replicated role once
    # (all-reduce); a sharded role follows its PaRO strategy's schedule, at the measured reduce-scatter bandwidth.
    hw = Hardware.cpu(2, link_bandwidth=1e8, link_latency_s=0.0)
    train = {}
    for mb in (1, 2):
        w = Workload(actor_params=26e6, ppo_epochs=2, mini_batches=mb)
        train[mb] = {name: estimate(plan, w, hw).phases["train"] for name, plan in
                     (("dp", PlacementPlan.colocated(2)), ("sharded", PlacementPlan.colocated(2, sharded=True)))}
    w1 = Workload(actor_params=26e6, ppo_epochs=2, mini_batches=1)
    grad_bytes = (w1.sizes.actor + w1.sizes.critic) * hw.weight_bytes
    extra_opt = 2 * 16 * (w1.sizes.actor + w1.sizes.critic) * 2 / hw.mem_bandwidth  # two more optimizer passes
    allreduce = 2 * 0.5 * grad_bytes / hw.link_bandwidth  # per step, both models, n = 2
    assert train[2]["dp"] - train[1]["dp"] == pytest.approx(2 * allreduce + extra_opt, rel=1e-6)
    slow_rs = Hardware.cpu(2, link_bandwidth=1e8, link_latency_s=0.0, reduce_scatter_bandwidth=2.5e7)
    w2 = Workload(actor_params=26e6, ppo_epochs=2, mini_batches=2)
    sharded = PlacementPlan.colocated(2, sharded=True)
    # ZeRO-3 ("GGG") reduce-scatters the gradients every micro-step: min(K=4, batch 8) x 2 epochs = 8 of them
    extra_rs = 8 * 0.5 * grad_bytes * (1 / 2.5e7 - 1 / 1e8)  # at a quarter of the bandwidth
    assert estimate(sharded, w2, slow_rs).phases["train"] - train[2]["sharded"] == pytest.approx(extra_rs, rel=1e-6)
    # a replicated role's all-reduce at its own measured bandwidth (gloo's native all-reduce beats its all-gather)
    fast_ar = Hardware.cpu(2, link_bandwidth=1e8, link_latency_s=0.0, all_reduce_bandwidth=4e8)
    saved_ar = 4 * allreduce * (1 - 1e8 / 4e8)  # four steps at four times the bandwidth
    dp = PlacementPlan.colocated(2)
    assert train[2]["dp"] - estimate(dp, w2, fast_ar).phases["train"] == pytest.approx(saved_ar, rel=1e-6)
    with pytest.raises(ValueError, match="all_reduce_bandwidth=0"):
        Hardware.cpu(2, all_reduce_bandwidth=0)
    with pytest.raises(ValueError, match="Workload.mini_batches=0"):
        Workload(actor_params=1e6, mini_batches=0)


def test_candidates_shard_only_what_the_trainer_shards():
    names = dict(candidate_plans(4))
    assert names["colocated-sharded"].sharded_roles == dict.fromkeys(("actor", "critic", "ref", "reward"), "GGG")
    inter = names["interleaved-sharded"]
    assert inter.sharded_roles == dict.fromkeys(("actor", "critic", "ref", "reward"), "GGG")
    assert inter.roles["ref"] == [0, 1] and inter.roles["reward"] == [2, 3]  # sharded inside their halves
    assert names["disaggregated-2t2i-sharded"].sharded_roles == dict.fromkeys(("actor", "critic", "ref", "reward"),
                                                                              "GGG")
    assert set(names["disaggregated-1t3i-sharded"].sharded_roles) == {"ref", "reward"}  # one trainer: whole
    assert "disaggregated-1t1i-sharded" not in dict(candidate_plans(2))  # nothing to shard on one rank per side
    assert not any(set(p.sharded_roles) & {"rollout", "value"} for _, p in candidate_plans(4))


def test_memory_of_a_sharded_role_follows_its_strategy():
    sizes = ModelSizes(actor=PHI)
    per_rank = lambda plan, m=None: model_state_bytes(plan, sizes, "fp32", ranks_per_node=m).rank_bytes(0) / PHI
    # ZeRO-1 (NNG): full weights and gradients, Adam state / 4; IIG with 2 ranks per node: weights and grads / 2
    assert per_rank(PlacementPlan.colocated(4, sharded="NNG")) == pytest.approx(2 * (4 + 4 + 8 / 4) + 4 + 4)
    assert per_rank(PlacementPlan.colocated(4, sharded="IIG"), 2) == pytest.approx(2 * (2 + 2 + 2) + 2 + 2)
    assert per_rank(PlacementPlan.colocated(4, sharded="IIG")) == per_rank(PlacementPlan.colocated(4, sharded=True))


def test_compare_to_measured():
    from hf_placement.planner import compare_to_measured

    out = compare_to_measured({"colocated": 10.0, "interleaved": 9.0, "disaggregated": 12.0, "only-predicted": 1.0},
                              {"colocated": 8.0, "interleaved": 10.0, "disaggregated": 12.0})
    assert out["plans"] == ["colocated", "disaggregated", "interleaved"]
    assert out["rel_error"]["colocated"] == pytest.approx(0.25) and out["max_rel_error"] == pytest.approx(0.25)
    assert out["pick"] == "interleaved" and out["measured_best"] == "colocated"
    assert out["pick_regret"] == pytest.approx(10.0 / 8.0 - 1)
    with pytest.raises(ValueError, match="no plan is both predicted"):
        compare_to_measured({"a": 1.0}, {"b": 1.0})


def test_plan_cli(tmp_path, capsys):
    from hf_placement.__main__ import main

    help_text = subprocess.run([sys.executable, "-m", "hf_placement", "plan", "--help"], capture_output=True,
                               text=True, cwd=REPO, check=True).stdout
    assert "--memory-cap" in help_text and "--measured-generate-s" in help_text
    assert "--measured-train-concurrent-s" in help_text and "--all-reduce-bandwidth" in help_text
    out = tmp_path / "ranking.json"
    assert main(["plan", "--actor-params", "26M", "--devices", "2", "--memory-cap", "38x", "--batch-size", "16",
                 "--response-len", "32", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "NO (must shard)" in printed and "colocated-sharded" in printed
    data = json.loads(out.read_text())
    ranking = {e["name"]: e for e in data["ranking"]}
    assert ranking["colocated"]["fits"] is False and ranking["interleaved"]["fits"] is True
    assert data["best"] != "colocated" and data["hardware"]["memory_cap_bytes"] == pytest.approx(38 * 26e6)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--actor-params", "lots", "--devices", "2"])
    assert exit_info.value.code == 2 and "not a parameter count" in capsys.readouterr().err
    assert main(["plan", "--actor-params", "1M", "--devices", "2", "--batch-size", "2", "--micro-batches", "4"]) == 2
    assert "micro_batches=4 exceeds batch_size=2" in capsys.readouterr().err
    assert main(["plan", "--actor-params", "1M", "--devices", "2", "--measured-train-half-s", "1.0"]) == 2
    assert "train_half_s needs train_s" in capsys.readouterr().err
    assert main(["plan", "--actor-params", "1M", "--devices", "2", "--measured-train-concurrent-s", "1.0"]) == 2
    assert "train_concurrent_s needs train_s" in capsys.readouterr().err
    # a measured all-reduce bandwidth reaches the cost model: slower gradient sync, slower data-parallel training
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    for bw, path in (("10GB", fast), ("10MB", slow)):
        assert main(["plan", "--actor-params", "26M", "--devices", "2", "--all-reduce-bandwidth", bw,
                     "--output", str(path)]) == 0
    train = {p: {e["name"]: e["phases"]["train"] for e in json.loads(p.read_text())["ranking"]} for p in (fast, slow)}
    assert train[slow]["colocated"] > train[fast]["colocated"]
    assert json.loads(slow.read_text())["hardware"]["all_reduce_bandwidth"] == pytest.approx(1e7)
    assert main(["plan", "--actor-params", "1M", "--devices", "2", "--measured-train-s", "2.0",
                 "--measured-train-half-s", "1.0", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["calibration"]["train_half_s"] == 1.0


# ----------------------------------------------------------------------------------------- wire format, LoRA filter
def test_pack_unpack_is_bit_exact():
    msg = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": [torch.tensor([True, False]), (torch.arange(3), 2.5)],
           "c": torch.tensor(float("nan")), "d": None}
    header, payload = pack_tree(msg)
    back = unpack_tree(header, payload)
    assert torch.equal(back["a"], msg["a"]) and back["a"].dtype == torch.bfloat16
    assert torch.equal(back["b"][0], msg["b"][0]) and back["b"][1][1] == 2.5 and back["d"] is None
    assert back["c"].view(torch.int32) == msg["c"].view(torch.int32)  # NaN payload bits preserved
    with pytest.raises(TypeError, match="cannot send an object of type set"):
        pack_tree({"x": {1, 2}})


def test_lora_filter_selects_peft_adapters_only():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0", "2"]))
    lora = [n for n, _ in select_tensors(model, "lora")]
    assert lora and all("lora_A" in n or "lora_B" in n for n in lora) and len(lora) == 4
    assert [n for n, _ in select_tensors(model, "trainable")] == lora
    assert len(select_tensors(model, "all")) > len(lora)
    with pytest.raises(ValueError, match="param_filter='adapters'"):
        select_tensors(model, "adapters")


@pytest.mark.slow
@pytest.mark.distributed
def test_calibration_measurements_have_the_right_shape():
    from hf_placement.planner.calibrate import measure_links, parallel_efficiency, spin_for

    links = measure_links(2, sizes=[1024, 65536], repeats=1, timeout=240)
    assert links["sizes"] == [1024, 65536]
    for op in ("p2p", "broadcast", "all_gather", "reduce_scatter", "all_reduce"):
        assert links["seconds"]["65536"][op] > 0 and links["fit"][op]["bandwidth"] > 0
    eff = parallel_efficiency(processes=1, seconds=0.2)
    assert eff["single_iterations"] > 0 and eff["efficiency"] > 0
    # the loop unit, callable inside running ranks: it spins for the time asked (not a fixed count)
    t0 = time.perf_counter()
    short, long = spin_for(0.05), spin_for(0.2)
    assert time.perf_counter() - t0 >= 0.25 and 0 < short < long
    with pytest.raises(ValueError, match="world_size >= 2"):
        measure_links(1)


def _busy(rank: int, world: int) -> dict[str, float]:
    from hf_placement.planner.calibrate import busy_collective_latency

    torch.set_num_threads(1)
    return busy_collective_latency(repeats=5, burst_s=(0.002, 0.004))


def test_collective_cost_between_computations_is_measured_and_priced():
    from hf_placement.testing import run_distributed

    for res in run_distributed(_busy, 2, timeout=120):
        assert res["repeats"] == 5 and res["mean"] > 0 and res["median"] > 0 and res["idle"] > 0
    # the planner charges it once per collective call: a sharded plan (tens of calls per iteration) pays far more
    # of it than a replicated one (one gradient all-reduce per optimizer step)
    w = Workload(actor_params=1e6)
    cost = {name: estimate(plan, w, Hardware.cpu(2, collective_overhead_s=0.002)).time_s
            - estimate(plan, w, Hardware.cpu(2)).time_s
            for name, plan in (("dp", PlacementPlan.colocated(2)), ("z3", PlacementPlan.colocated(2, sharded=True)))}
    assert cost["dp"] == pytest.approx(2 * 0.002)  # one all-reduce per optimizer step, for actor and critic
    assert cost["z3"] > 5 * cost["dp"]
    with pytest.raises(ValueError, match="collective_overhead_s"):
        Hardware.cpu(2, collective_overhead_s=-1)


def test_two_point_calibration_splits_fixed_and_per_sample_work():
    # A phase measured at the whole batch S and at S/2 is t(b) = t(S) * (f + (1 - f) b / S), f = 2 t(S/2)/t(S) - 1.
    w = Workload(actor_params=7e6, batch_size=16)
    hw = Hardware.cpu(2, parallel_efficiency=1.0)
    plan = PlacementPlan.colocated(2)  # every rank does half the batch
    proportional = Calibration(generate_s=1.0, generate_half_s=0.5, train_s=2.0, train_half_s=1.0,
                               inference_s=0.4, inference_half_s=0.2)
    fixed = Calibration(generate_s=1.0, generate_half_s=1.0, train_s=2.0, train_half_s=2.0,
                        inference_s=0.4, inference_half_s=0.4)
    mixed = Calibration(generate_s=1.0, generate_half_s=0.75, train_s=2.0, train_half_s=1.5,
                        inference_s=0.4, inference_half_s=0.3)
    est = {name: estimate(plan, w, hw, cal).phases for name, cal in
           (("proportional", proportional), ("fixed", fixed), ("mixed", mixed))}
    assert est["proportional"]["generate"] == pytest.approx(0.5)
    assert est["fixed"]["generate"] == pytest.approx(1.0)
    assert est["mixed"]["generate"] == pytest.approx(0.75)
    assert est["proportional"]["inference"] == pytest.approx(0.2)
    assert est["fixed"]["inference"] == pytest.approx(0.4)
    # training adds the gradient all-reduce on top of the compute
    allreduce = est["fixed"]["train"] - 2.0
    assert allreduce > 0 and est["proportional"]["train"] == pytest.approx(1.0 + allreduce)
    # the single-device whole batch is reproduced whatever the split
    one = estimate(PlacementPlan.colocated(1), w, Hardware.cpu(1), mixed)
    assert one.phases["generate"] == pytest.approx(1.0) and one.phases["train"] == pytest.approx(2.0)
    assert mixed.fixed_fraction("generate") == pytest.approx(0.5) and Calibration(train_s=1.0).fixed_fraction(
        "train") is None
    with pytest.raises(ValueError, match="generate_half_s needs generate_s"):
        Calibration(generate_half_s=1.0)


def test_sharded_training_pays_the_engine_overhead_measured_on_one_device():
    w = Workload(actor_params=1e6)
    hw = Hardware.cpu(2)
    base = Calibration(generate_s=1.0, inference_s=1.0, train_s=2.0)
    engine = Calibration(generate_s=1.0, inference_s=1.0, train_s=2.0, train_sharded_s=3.0)
    assert engine.sharded_train_factor() == 1.5 and base.sharded_train_factor() == 1.0
    sharded, plain = PlacementPlan.colocated(2, sharded=True), PlacementPlan.colocated(2)
    t = {(n, c): estimate(p, w, hw, cal).phases["train"] for n, p in (("z3", sharded), ("dp", plain))
         for c, cal in (("base", base), ("engine", engine))}
    assert t[("dp", "engine")] == t[("dp", "base")]  # unsharded plans do not pay it
    compute = estimate(plain, w, hw, base).phases["train"] - estimate(plain, w, Hardware.cpu(2, link_bandwidth=1e30,
                                                                                            link_latency_s=0.0,
                                                                                            all_reduce_bandwidth=1e30),
                                                                     base).phases["train"]
    assert t[("z3", "engine")] - t[("z3", "base")] == pytest.approx(
        0.5 * (t[("dp", "base")] - compute), rel=1e-6)  # half the training compute on top
    with pytest.raises(ValueError, match="train_sharded_s needs train_s"):
        Calibration(train_sharded_s=1.0)


def test_concurrent_calibration_is_the_slowdown_of_phases_that_run_on_every_device():
    # A phase measured alone and while every device runs it: the ratio slows exactly the phases that keep every
    # device busy (co-located, staleness-1 disaggregated), not the alternating synchronous disaggregated schedule,
    # and it replaces the machine's parallel efficiency for those phases.
    w = Workload(actor_params=7e6, batch_size=16)
    hw = Hardware.cpu(2, parallel_efficiency=0.5)
    alone = Calibration(generate_s=1.0, generate_half_s=0.5, inference_s=0.4, inference_half_s=0.2, train_s=2.0,
                        train_half_s=1.0)
    contended = Calibration(**{**vars(alone), "generate_concurrent_s": 1.5, "inference_concurrent_s": 0.4,
                               "train_concurrent_s": 3.0})
    assert contended.concurrent_slowdown("generate") == pytest.approx(1.5)
    assert alone.concurrent_slowdown("generate") is None
    col = estimate(PlacementPlan.colocated(2), w, hw, contended).phases
    assert col["generate"] == pytest.approx(0.5 * 1.5)
    assert col["inference"] == pytest.approx(0.2)  # slowdown 1: no contention, whatever the efficiency says
    # without concurrent times the efficiency applies (1 / 0.5)
    assert estimate(PlacementPlan.colocated(2), w, hw, alone).phases["generate"] == pytest.approx(1.0)
    sync = estimate(PlacementPlan.disaggregated(2), Workload(actor_params=7e6, batch_size=16, max_staleness=0), hw,
                    contended).phases
    assert sync["generate"] == pytest.approx(1.0)  # the generator runs alone: whole batch, no slowdown
    async_ = estimate(PlacementPlan.disaggregated(2), Workload(actor_params=7e6, batch_size=16, max_staleness=1), hw,
                      contended).phases
    assert async_["generate"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="train_concurrent_s needs train_s"):
        Calibration(train_concurrent_s=1.0)
    with pytest.raises(ValueError, match="generate_concurrent_s=0"):
        Calibration(generate_s=1.0, generate_concurrent_s=0)
