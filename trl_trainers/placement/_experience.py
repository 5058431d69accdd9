"""Experience pieces shared by the placement executors, split where the placement cuts the PPO iteration.

`PPOTrainer.score_rollout` runs the four frozen forwards on one rank and `PPOTrainer.compute_advantages` turns them
into advantages in one go. A placement moves parts of that to other ranks, so this module offers the same
computation in pieces that can run apart:

- `local_scores`: sampler log-probs, processed responses, lengths and values (the actor/critic side);
- `ref_logprobs_fn` / `reward_scores_fn`: the reference and reward forwards on a message dict, for owner dispatch;
- `PPOTrainer.per_sample_rewards` (not here): masks, EOS penalty, KL and KL-penalised rewards of one shard;
- `PPOTrainer.batch_advantages` (not here): reward whitening, GAE and advantage whitening over the (possibly
  concatenated) shards, with statistics reduced over the training group, the only step that needs the whole batch.

Every piece processes the rows in chunks of ``local_rollout_forward_batch_size`` exactly like the trainer, so a shard
scored here is bit-identical to the same rows scored by `PPOTrainer.score_rollout` on a co-located rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import ppo_math as pm
from .._generation import score_head_outputs, sequence_scores
from ..ppo_trainer import Experience, PPOTrainer, Rollout

__all__ = [
    "concat_shards",
    "experience_from",
    "local_scores",
    "ref_logprobs_fn",
    "reward_scores_fn",
]


@torch.no_grad()
def local_scores(trainer: PPOTrainer, rollout: Rollout) -> dict[str, torch.Tensor]:
    """Sampler log-probs, stop-truncated responses, sequence lengths and critic values (no ref, no reward)."""
    args = trainer.args
    ctx = rollout.context_length
    chunk = args.local_rollout_forward_batch_size
    out: dict[str, list[torch.Tensor]] = {"logprobs": [], "values": [], "responses": [], "sequence_lengths": []}
    trainer.model.eval()
    for i in range(0, rollout.queries.size(0), chunk):
        query_response = rollout.query_responses[i : i + chunk]
        response = query_response[:, ctx:]
        out["logprobs"].append(rollout.logprobs[i : i + chunk])
        processed = response
        if trainer.stop_token_id is not None:
            processed = pm.truncate_after_stop_token(response, trainer.stop_token_id, trainer.pad_token_id)
        with trainer._autocast():
            full_values = score_head_outputs(trainer.model.value_model, query_response, trainer.pad_token_id)
        out["values"].append(full_values[:, ctx - 1 : -1].float())
        out["responses"].append(processed)
        out["sequence_lengths"].append(pm.first_true_indices(processed == trainer.pad_token_id) - 1)
    trainer.model.train()
    return {k: torch.cat(v) for k, v in out.items()}


def ref_logprobs_fn(trainer: PPOTrainer) -> Callable[[dict[str, Any]], torch.Tensor]:
    """``{"query_responses", "context_length"} -> (B, R)`` reference log-probs, computed on the ref owner."""

    @torch.no_grad()
    def fn(batch: dict[str, Any]) -> torch.Tensor:
        args = trainer.args
        qr, ctx = batch["query_responses"].to(trainer.device), int(batch["context_length"])
        chunk = args.local_rollout_forward_batch_size
        parts = []
        for i in range(0, qr.size(0), chunk):
            query_response = qr[i : i + chunk]
            with trainer._autocast():
                parts.append(trainer.ref_logprobs(query_response, ctx))
        return torch.cat(parts)

    return fn


def reward_scores_fn(trainer: PPOTrainer) -> Callable[[dict[str, Any]], torch.Tensor]:
    """``{"queries", "responses"} -> (B,)`` reward-model scores of the stop-truncated sequences, on the owner."""

    @torch.no_grad()
    def fn(batch: dict[str, Any]) -> torch.Tensor:
        # partners' inputs arrive on the channel's transfer device (CPU on gloo)
        queries, responses = batch["queries"].to(trainer.device), batch["responses"].to(trainer.device)
        chunk = trainer.args.local_rollout_forward_batch_size
        ctx = queries.size(1)
        parts = []
        for i in range(0, queries.size(0), chunk):
            with trainer._autocast():
                scores = sequence_scores(trainer.reward_model, torch.cat([queries[i : i + chunk],
                                                                          responses[i : i + chunk]], 1),
                                         trainer.pad_token_id, ctx)
            parts.append(scores.float())
        return torch.cat(parts)

    return fn


# Fill values when shards of different response widths are concatenated: every padded position is outside both
# masks, so GAE (which bootstraps with 0 after the last position) and the masked whitening see exactly what the
# narrower shard saw on its own.
_RIGHT_PAD = {"logprobs": pm.INVALID_LOGPROB, "ref_logprobs": pm.INVALID_LOGPROB, "values": 0.0, "kl": 0.0,
              "non_score_reward": 0.0, "rewards": 0.0, "token_mask": False, "value_mask": False}


def concat_shards(shards: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate shard messages (in order): prompts left-padded to the widest context, responses right-padded."""
    ctx = max(int(s["context_length"]) for s in shards)
    width = max(s["responses"].size(1) for s in shards)
    out: dict[str, Any] = {"context_length": ctx}
    pad = torch.nn.functional.pad
    for key in shards[0]:
        if key in ("context_length", "shard", "version"):
            continue
        parts = []
        for s in shards:
            t, c = s[key], int(s["context_length"])
            if key == "query_responses":
                query, response = t[:, :c], t[:, c:]
                t = torch.cat([pad(query, (ctx - c, 0), value=pad_token_id),
                               pad(response, (0, width - response.size(1)), value=pad_token_id)], 1)
            elif key in ("responses", "raw_responses"):
                t = pad(t, (0, width - t.size(1)), value=pad_token_id)
            elif key in _RIGHT_PAD:
                t = pad(t, (0, width - t.size(1)), value=_RIGHT_PAD[key])
            parts.append(t)
        out[key] = torch.cat(parts)
    return out


@torch.no_grad()
def experience_from(query_responses: torch.Tensor, context_length: int, raw_responses: torch.Tensor,
                    sequence_lengths: torch.Tensor, adv: dict[str, torch.Tensor]) -> Experience:
    """An `Experience` exactly as `PPOTrainer.make_experience` assembles it."""
    return Experience(
        query_responses=query_responses, responses=adv["responses"], context_length=context_length,
        logprobs=adv["logprobs"], ref_logprobs=adv["ref_logprobs"], values=adv["values"], scores=adv["scores"],
        sequence_lengths=sequence_lengths, token_mask=adv["token_mask"], value_mask=adv["value_mask"],
        kl=adv["kl"], non_score_reward=adv["non_score_reward"], rewards=adv["rewards"],
        advantages=adv["advantages"], returns=adv["returns"],
        extras={"contain_eos": adv["contain_eos"], "raw_responses": raw_responses},
    )
