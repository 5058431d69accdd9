"""Placed PPO fails loudly: bad plans get clear errors, a dead or stalled peer becomes an error naming it in time."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from hf_placement import PlacementPlan
from hf_placement.testing import run_distributed


def _args(tmp_path, **overrides):
    from trl_trainers import PPOConfig

    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=1, bf16=False,
                report_to="none", disable_tqdm=True, save_strategy="no", gradient_checkpointing=False,
                stop_token="eos", loss_normalization="mini_batch")
    base.update(overrides)
    return PPOConfig(**base)


def test_resolve_plan_accepts_names_plans_and_files(tmp_path):
    from trl_trainers.placement import resolve_plan

    assert resolve_plan("colocated", 2).strategy == "colocated"
    assert resolve_plan(None, 1).strategy == "colocated"
    assert resolve_plan("interleaved", 4).roles["reward"] == [2, 3]
    path = PlacementPlan.disaggregated(4, train_ranks=[0, 1]).save(tmp_path / "plan.yaml")
    plan = resolve_plan(str(path), 4)
    assert plan.is_disaggregated and plan.roles["actor"] == [0, 1]


def test_plan_from_config_fields():
    from trl_trainers.placement import plan_from_config

    assert plan_from_config(None, 2) == PlacementPlan.colocated(2)
    inter = plan_from_config("interleaved", 4, placement_ratios="ref=0.25,reward=0.25")
    assert inter.roles["ref"] == [0] and inter.roles["reward"] == [1]
    dis = plan_from_config("Disaggregated", 4, rollout_replicas=2)
    assert dis.rollout_replicas == 2 and dis.strategy == "disaggregated"
    assert plan_from_config(dis.to_dict(), 4) == dis
    with pytest.raises(ValueError, match="only applies to placement='interleaved'"):
        plan_from_config("colocated", 2, placement_ratios={"ref": 0.5})
    with pytest.raises(ValueError, match="rollout_replicas=2 only applies to placement='disaggregated'"):
        plan_from_config("interleaved", 2, rollout_replicas=2)
    with pytest.raises(ValueError, match="is not a strategy"):
        plan_from_config("separation", 2)
    with pytest.raises(ValueError, match="plan is for world_size=4 but the job has 2"):
        plan_from_config(dis, 2)
    with pytest.raises(ValueError, match="'role=ratio' items"):
        plan_from_config("interleaved", 2, placement_ratios="ref:0.5")


def test_resolve_plan_rejects_plans_ppo_cannot_run():
    from trl_trainers.placement import resolve_plan

    with pytest.raises(ValueError, match="world_size"):
        resolve_plan(PlacementPlan.colocated(2), 4)
    half_actor = PlacementPlan.custom(2, {"actor": [0], "critic": [0, 1], "ref": [0, 1], "reward": [1]})
    with pytest.raises(ValueError, match="role 'actor' is on ranks \\[0\\]"):
        resolve_plan(half_actor, 2)
    split_infer = PlacementPlan.custom(3, {"actor": [0], "critic": [0], "rollout": [1, 2], "value": [1, 2],
                                           "ref": [1], "reward": [2]})
    with pytest.raises(ValueError, match="same inference ranks"):
        resolve_plan(split_infer, 3)
    with pytest.raises(ValueError, match="do not divide world_size=3"):
        resolve_plan(PlacementPlan.disaggregated(3, train_ranks=[0, 1]), 3)
    with pytest.raises(ValueError, match="not a strategy"):
        resolve_plan("sideways", 2)


def test_every_planner_candidate_resolves_to_a_registered_executor(tmp_path):
    """What `python -m hf_placement plan` can recommend, PPOTrainer runs: every candidate resolves, has an executor,
    and a sharded candidate keeps its sharding (it is never silently run unsharded)."""
    from hf_placement.planner import candidate_plans
    from trl_trainers.placement import executor_kind, registered_executors, resolve_plan, shard_specs

    for world in (2, 3, 4):
        for name, plan in candidate_plans(world):
            resolved = resolve_plan(plan, world, _args(tmp_path))
            assert resolved.sharded_roles == plan.sharded_roles, name
            assert executor_kind(resolved) in registered_executors(), name
            specs = shard_specs(resolved, ranks_per_node=None)
            assert {r for s in specs for r in s.roles} == set(plan.sharded_roles), name


def test_sharded_plans_ppo_cannot_run_are_refused(tmp_path):
    from trl_trainers.placement import resolve_plan

    cases = [
        (PlacementPlan.disaggregated(4, sharded_roles=["value"]), "shadow role"),
        (PlacementPlan.colocated(2).__class__(world_size=2, roles=PlacementPlan.colocated(2).roles,
                                              sharded_roles=["actor"]), "shard both or neither"),
        (PlacementPlan.colocated(2).__class__(world_size=2, roles=PlacementPlan.colocated(2).roles,
                                              sharded_roles={"actor": "GGG", "critic": "NNG"}), "same strategy"),
        (PlacementPlan.interleaved(4, sharded_roles={"ref": "NNG"}), "p=N"),
        (PlacementPlan.interleaved(4, sharded_roles={"ref": "GIN"}), "invalid"),
    ]
    for plan, message in cases:
        with pytest.raises(ValueError, match=message):
            resolve_plan(plan, plan.world_size, _args(tmp_path))
    with pytest.raises(NotImplementedError, match="ds3_gather_for_generation=False"):
        resolve_plan(PlacementPlan.colocated(2, sharded=True), 2, _args(tmp_path, ds3_gather_for_generation=False))


def test_equivalence_issues_name_the_fix(tmp_path):
    from trl_trainers.placement import equivalence_issues

    dis = PlacementPlan.disaggregated(2)
    assert equivalence_issues(_args(tmp_path), dis) == []
    assert equivalence_issues(_args(tmp_path, num_mini_batches=2), PlacementPlan.interleaved(2)) == []
    # several mini-batches are equivalent (shards shuffled by their global index); a per-micro-batch loss mean with a
    # stop token is not guaranteed to be, and staleness 1 is off-policy by design
    assert equivalence_issues(_args(tmp_path, num_mini_batches=2), dis) == []
    issues = equivalence_issues(_args(tmp_path, num_mini_batches=2, loss_normalization="micro_batch"), dis, 1)
    assert len(issues) == 2
    assert "max_staleness=1" in issues[0] and "loss_normalization='mini_batch'" in issues[1]


def test_single_process_placed_trainer_is_colocated(tmp_path):
    """Without a process group the placed trainer is PPOTrainer: same parameters, bit for bit."""
    from test_placement_ppo_equivalence import _build, _params

    from trl_trainers import PPOTrainer

    torch.set_num_threads(1)
    placed = _build(str(tmp_path / "placed"), "colocated", iterations=2)
    with pytest.raises(ValueError, match="ratio 0.5 for role .ref. gives 0.5 of 1 ranks"):
        _build(str(tmp_path / "x"), "interleaved")  # one rank cannot be split into owner halves
    placed.train()
    plain_src = _build(str(tmp_path / "plain"), "colocated", iterations=2)
    plain = PPOTrainer(plain_src.args, plain_src.processing_class, plain_src.model.policy, plain_src.ref_model,
                       plain_src.reward_model, plain_src.train_dataset, plain_src.model.value_model)
    plain.callback_handler.callbacks = [c for c in plain.callback_handler.callbacks
                                        if type(c).__name__ != "PrinterCallback"]
    plain.train()
    a, b = _params(placed), {k: v.detach().numpy() for k, v in plain.model.state_dict().items()}
    for key in a:
        assert (a[key] == b[key]).all(), key
    phases = {e.phase for e in placed.timeline.events}
    assert phases == {"generation", "experience", "training"}
    assert placed.phase_history[0].keys() == phases


def _fail_inference_rank(rank: int, world_size: int, output_dir: str, mode: str, timeout_s: float):
    """Disaggregated run whose inference rank 1 stalls (sleeps) or dies (leaves) in iteration 2."""
    from test_placement_ppo_equivalence import _build

    torch.set_num_threads(1)
    trainer = _build(output_dir, "disaggregated", iterations=3, timeout_s=timeout_s)
    executor = trainer.executor
    original = executor._produce

    class _Died(Exception):
        pass

    def produce(update: int) -> None:
        if update == 2:
            if mode == "stall":
                time.sleep(timeout_s + 3)
            raise _Died
        original(update)

    executor._produce = produce
    start = time.monotonic()
    try:
        trainer.train()
    except _Died:
        return "left"
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "finished"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["stall", "die"])
def test_dead_or_stalled_inference_rank_fails_the_trainer_in_time(tmp_path, mode):
    timeout_s = 8.0
    survivor, other = run_distributed(_fail_inference_rank, 2, str(tmp_path), mode, timeout_s, timeout=200)
    assert other in ("left", "finished") or other[0] == "PlacementError"
    kind, message, elapsed = survivor
    assert kind == "PlacementError", message
    assert "training rank 0" in message and "inference rank 1" in message and "iteration 2" in message
    # it returned an error (the harness would raise RankTimeoutError after 200 s otherwise)
    assert elapsed > 0


def test_placement_from_config_field_and_alias(tmp_path):
    """``PPOConfig.placement`` and the ``PlacedPPOTrainer`` alias reach the same code path as ``placement=``."""
    from test_placement_ppo_equivalence import _build, _params

    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.placement import ColocatedExecutor, PlacedPPOTrainer

    torch.set_num_threads(1)
    direct = _build(str(tmp_path / "direct"), "colocated", iterations=1)
    direct.train()
    args = copy.copy(direct.args)
    args.output_dir, args.placement = str(tmp_path / "field"), "colocated"
    via_field = PPOTrainer(args, direct.processing_class, _fresh_policy(), None, direct.reward_model,
                           direct.train_dataset, _fresh_value())
    assert via_field.plan.strategy == "colocated" and isinstance(via_field.executor, ColocatedExecutor)
    args.placement = None
    with pytest.warns(FutureWarning, match="PlacedPPOTrainer is deprecated"):
        alias = PlacedPPOTrainer(args, direct.processing_class, _fresh_policy(), None, direct.reward_model,
                                 direct.train_dataset, _fresh_value(), placement_timeout_s=30.0)
    assert alias.plan.strategy == "colocated" and alias.args.placement_timeout_s == 30.0
    for trainer in (via_field, alias):
        trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                              if type(c).__name__ != "PrinterCallback"]
        trainer.train()
        for key, value in _params(direct).items():
            assert (_params(trainer)[key] == value).all(), key
    # without any placement the trainer runs the default, co-located executor
    fresh = copy.copy(args)
    fresh.batch_size = fresh.num_total_batches = None
    plain = PPOTrainer(fresh, direct.processing_class, _fresh_policy(), None, direct.reward_model,
                       direct.train_dataset, _fresh_value())
    assert plain.plan.strategy == "colocated" and isinstance(plain.executor, ColocatedExecutor)
    assert plain.is_training_rank and plain.gather_timeline() == [plain.timeline]
    # TRL's runtime fields are filled on the trainer's copy; the caller's config is never modified
    assert fresh.batch_size is None and fresh.num_total_batches is None
    assert plain.args.batch_size == plain.layout.batch_size == 4 and plain.args.num_total_batches == 1
    with pytest.raises(ValueError, match="mutually exclusive"):
        PPOTrainer(args, direct.processing_class, _fresh_policy(), None, direct.reward_model, direct.train_dataset,
                   _fresh_value(), group=object(), placement="colocated")
    for field, value, match in [("max_staleness", 2, "max_staleness"), ("weight_sync", "carrier", "weight_sync"),
                                ("placement_timeout_s", 0, "placement_timeout_s")]:
        with pytest.raises(ValueError, match=match):
            PPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{field: value})
    with pytest.raises(ValueError, match="needs placement='disaggregated'"):
        _build(str(tmp_path / "stale"), "colocated", max_staleness=1)


def _fresh_policy():
    from trl_trainers.testing import char_tokenizer, tiny_causal_lm

    return tiny_causal_lm(len(char_tokenizer()), 0)


def _fresh_value():
    from trl_trainers.testing import char_tokenizer, tiny_value_model

    return tiny_value_model(len(char_tokenizer()), 1)
