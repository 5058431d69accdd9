"""Colocated, interleaved and disaggregated PPO (staleness 0) end with the same actor and critic parameters.

All strategies of one world size run inside ONE `run_distributed` call (spawning is the expensive part), one after the
other with freshly built models and the same seeds. Disaggregated shadows are checked bit-exact against the trainer.
On 4 ranks every planner candidate, sharded ones included, is checked in `test_placement_sharding.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

pytestmark = pytest.mark.distributed

STRATEGIES = ("colocated", "interleaved", "disaggregated")


def _build(output_dir: str, placement, per_device: int = 4, iterations: int = 3, timeout_s: float = 120.0,
           stop_token: str | None = "eos", eval_rows: int = 0, num_mini_batches: int = 2, **extra):
    """A tiny PPO job under ``placement`` through ``PPOTrainer(..., placement=...)``; ``extra`` are PPOConfig fields
    (``max_staleness``, ``weight_sync``...)."""
    import torch.distributed as dist

    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.testing import (
        TargetTokenRewardModel,
        char_tokenizer,
        prompt_dataset,
        tiny_causal_lm,
        tiny_value_model,
    )

    world = dist.get_world_size() if dist.is_initialized() else 1
    tok = char_tokenizer()
    args = PPOConfig(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
        num_ppo_epochs=2, num_mini_batches=num_mini_batches, response_length=6, learning_rate=3e-3,
        total_episodes=per_device * world * iterations, bf16=False, report_to="none", disable_tqdm=True,
        temperature=1.0, kl_coef=0.05, num_sample_generations=0, save_strategy="no", gradient_checkpointing=False,
        seed=11, stop_token=stop_token, whiten_rewards=False, loss_normalization="mini_batch",
        local_rollout_forward_batch_size=2, per_device_eval_batch_size=2, placement_timeout_s=timeout_s, **extra,
    )
    trainer = PPOTrainer(
        args, tok, tiny_causal_lm(len(tok), 0), None, TargetTokenRewardModel(tok.convert_tokens_to_ids("z")),
        prompt_dataset(tok, 32, exclude="z"), tiny_value_model(len(tok), 1), placement=placement,
        eval_dataset=prompt_dataset(tok, eval_rows, seed=1) if eval_rows else None,
    )
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ != "PrinterCallback"]
    return trainer


def _params(trainer) -> dict[str, np.ndarray]:
    # numpy, not tensors: tensors cross process boundaries through shared memory that dies with the rank
    return {k: v.detach().numpy().copy() for k, v in trainer.model.state_dict().items()}


def _all_strategies(rank: int, world_size: int, output_dir: str, strategies: tuple[str, ...], per_device: int = 4,
                    iterations: int = 3, eval_rows: int = 0, nccl_alone: bool = False, **extra):
    """``nccl_alone``: build the placement's groups as on a world whose backend carries no CPU tensors (NCCL alone),
    so that the executors' channels and p2p weight syncs go over `RoleGroups.wire_group` (the world stays gloo)."""
    torch.set_num_threads(1)
    if nccl_alone:
        import hf_placement.groups as groups_module

        groups_module.backend_device_types = lambda group=None: ("cuda",)
    out = {}
    for name in strategies:
        trainer = _build(f"{output_dir}/{name}", name, per_device=per_device, iterations=iterations,
                         eval_rows=eval_rows, **extra)
        trainer.train()
        if name != "colocated":  # channels open on first use
            wire, channels = trainer.executor.context.role_groups.wire_group, _channels(trainer.executor)
            out.setdefault("wire", {})[name] = wire is not None and bool(channels) and all(
                c.group is wire for c in channels)
        table = trainer.generate_completions() if eval_rows else None
        phases = sorted({e.phase for e in trainer.timeline.events})
        scores = [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h]
        sync = [s.version for s in getattr(trainer.executor, "actor_sync", None).history] \
            if name == "disaggregated" else []
        out[name] = {"params": _params(trainer), "trainer": trainer.is_training_rank, "phases": phases,
                     "scores": scores, "sync_versions": sync,
                     "completion_scores": table["score"] if table else None,
                     "roles": trainer.plan.roles_of(rank),
                     "has_ref": trainer.ref_model is not None, "has_reward": trainer.reward_model is not None}
    return out


def _channels(executor) -> list:
    """Every channel the executor opened (role handles, experience, p2p weight syncs)."""
    found = []
    for obj in (executor, *[getattr(executor, a, None) for a in ("ref_handle", "reward_handle", "actor_sync",
                                                                  "critic_sync")]):
        found.extend(getattr(obj, "_channels", {}).values())
    return found


def _check(results, world: int, iterations: int = 3):
    base = results[0]["colocated"]["params"]
    for r in range(world):
        for key in base:
            np.testing.assert_array_equal(results[r]["colocated"]["params"][key], base[key], err_msg=key)
    init = _initial_params()
    assert max(np.abs(base[k] - init[k]).max() for k in base) > 1e-3, "training did not move the parameters"
    # interleaved: same data-parallel split and bit-identical frozen forwards -> bit-identical parameters
    for r in range(world):
        inter = results[r]["interleaved"]
        for key in base:
            np.testing.assert_array_equal(inter["params"][key], base[key], err_msg=f"interleaved rank {r}: {key}")
    assert results[0]["interleaved"]["scores"] == results[0]["colocated"]["scores"]
    # ref and reward only on their owner halves
    half = world // 2
    for r in range(world):
        assert results[r]["interleaved"]["has_ref"] == (r < half)
        assert results[r]["interleaved"]["has_reward"] == (r >= half)
        assert "wait:ref" in results[r]["interleaved"]["phases"] or r < half
    # disaggregated: trainers match colocated to fp32 tolerance (prompts re-padded across shards); the shadows on the
    # inference ranks, after the final sync, are bit-identical to the trainer.
    dis = [results[r]["disaggregated"] for r in range(world)]
    trainers = [d for d in dis if d["trainer"]]
    shadows = [d for d in dis if not d["trainer"]]
    assert trainers and shadows
    assert "sync" in trainers[0]["phases"]  # the first training rank is the sync source
    for d in trainers:
        for key in base:
            # Adam divides by sqrt(v): fp32 summation-order noise in near-zero gradients becomes steps of ~1e-6..1e-5
            np.testing.assert_allclose(d["params"][key], base[key], rtol=1e-4, atol=2e-5, err_msg=key)
        assert "generation" not in d["phases"]
        assert "training" in d["phases"] and "wait:experience" in d["phases"]
    for d in shadows:
        assert "generation" in d["phases"] and "sync" in d["phases"] and "training" not in d["phases"]
        for key in base:
            np.testing.assert_array_equal(d["params"][key], trainers[0]["params"][key], err_msg=f"shadow {key}")
        assert d["sync_versions"] == list(range(1, iterations + 2))  # one per iteration, then the final push
    np.testing.assert_allclose(trainers[0]["scores"], results[0]["colocated"]["scores"], rtol=1e-5, atol=1e-6)


def _initial_params():
    from trl_trainers import PolicyAndValueWrapper
    from trl_trainers.testing import char_tokenizer, tiny_causal_lm, tiny_value_model

    n = len(char_tokenizer())
    wrapper = PolicyAndValueWrapper(tiny_causal_lm(n, 0), tiny_value_model(n, 1))
    return {k: v.detach().numpy().copy() for k, v in wrapper.state_dict().items()}


@pytest.mark.slow
def test_three_placements_same_update_two_ranks(tmp_path):
    results = run_distributed(_all_strategies, 2, str(tmp_path), STRATEGIES, eval_rows=8, timeout=280)
    _check(results, 2)
    # completions on the eval set (near-greedy): interleaved gets its scores from the reward owners, disaggregated
    # generates them on the inference rank with the shadow (synced to the final weights)
    col = results[0]["colocated"]["completion_scores"]
    assert len(col) == 8 and results[1]["colocated"]["completion_scores"] == col
    assert results[0]["interleaved"]["completion_scores"] == col == results[1]["interleaved"]["completion_scores"]
    assert results[0]["disaggregated"]["completion_scores"] is None  # the trainer leaves completions to the shadow
    assert len(results[1]["disaggregated"]["completion_scores"]) == 8


@pytest.mark.slow
def test_placements_over_the_wire_group_where_the_backend_has_no_cpu_transport(tmp_path):
    """The same equivalence with the placement's channels and p2p weight syncs on the gloo wire group that
    `build_role_groups` adds under NCCL alone (an NCCL rank pair that both send before receiving can wait on each
    other)."""
    results = run_distributed(_all_strategies, 2, str(tmp_path), STRATEGIES, nccl_alone=True,
                              weight_sync="bucketed_p2p", timeout=280)
    _check(results, 2)
    for r in range(2):
        assert results[r]["wire"] == {"interleaved": True, "disaggregated": True}, results[r]["wire"]
