"""Disaggregated PPO with max_staleness=1 computes the one-step-off-policy update, checked against a 1-process replay.

The replay runs the same stage methods on one process: batch ``u`` is generated (and scored by the critic) with the
weights after ``max(0, u - 2)`` updates, then trained on. The 2-rank run must end with the same parameters.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

pytestmark = pytest.mark.distributed

ITERATIONS = 3


def _stale_run(rank: int, world_size: int, output_dir: str):
    from test_placement_ppo_equivalence import _build, _params

    torch.set_num_threads(1)
    # bucketed point-to-point weight sync (APP's transport) with small buckets, so several buckets travel
    trainer = _build(output_dir, "disaggregated", iterations=ITERATIONS, num_mini_batches=1, max_staleness=1,
                     weight_sync="bucketed_p2p")
    trainer.executor.actor_sync.bucket_bytes = 64 * 1024
    trainer.train()
    kinds = [(e.phase, e.start, e.end) for e in trainer.timeline.events]
    last = trainer.executor.actor_sync.history[-1]
    return _params(trainer), trainer.is_training_rank, kinds, (last.version, last.strategy, last.num_buckets)


def _replay(output_dir: str, lag: int = 2):
    from test_placement_ppo_equivalence import _build, _params

    torch.set_num_threads(1)
    # world 1: global batch 8 (one mini-batch: a single process shuffles its 8 rows as one shard)
    ref = _build(output_dir, "colocated", per_device=8, iterations=ITERATIONS, num_mini_batches=1)
    weights = {0: copy.deepcopy(ref.model.state_dict())}
    for update in range(1, ITERATIONS + 1):
        current = copy.deepcopy(ref.model.state_dict())
        ref.model.load_state_dict(weights[max(0, update - lag)])
        queries, seeds = ref.local_batch(update)
        exp = ref.make_experience(ref.rollout(queries, seeds))
        ref.model.load_state_dict(current)
        ref.train_on_experience(exp, update)
        ref.lr_scheduler.step()
        weights[update] = copy.deepcopy(ref.model.state_dict())
    return _params(ref)


@pytest.mark.slow
def test_staleness_one_matches_off_policy_replay(tmp_path):
    (p0, trains0, events0, v0), (p1, trains1, events1, v1) = run_distributed(
        _stale_run, 2, str(tmp_path / "run"), timeout=280)
    assert trains0 and not trains1
    assert v0 == v1 and v0[:2] == (ITERATIONS + 1, "bucketed_p2p") and v0[2] > 1
    expected = _replay(str(tmp_path / "replay"))
    for key in expected:
        np.testing.assert_allclose(p0[key], expected[key], rtol=1e-4, atol=2e-5, err_msg=key)
        np.testing.assert_array_equal(p1[key], p0[key], err_msg=f"shadow {key}")
    # the generator made ITERATIONS batches of 2 shards
    assert sum(1 for e in events1 if e[0] == "generation") == 2 * ITERATIONS
    # staleness is not a no-op: the synchronous replay (batch u from the weights after u - 1 updates) ends elsewhere
    synchronous = _replay(str(tmp_path / "sync"), lag=1)
    assert max(np.abs(synchronous[k] - expected[k]).max() for k in expected) > 1e-4
