"""The one PPO step pipeline: generation, scoring, experience and training, over explicit models and settings.

`PPOPhases` holds what one rank needs to run the phases of a PPO iteration (the config, the batch layout, the models
this rank holds, the training backend and the data-parallel context of the training group) and offers each phase as
a method. `PPOTrainer` and every placement executor call these same methods; a placement only decides *where* each
one runs (which ranks generate, which rank owns the reference or reward model, which ranks train):

1. `PPOPhases.rollout`: sample responses for left-padded prompts (generation);
2. scoring, in pieces that can run on different ranks: `policy_side_scores` (sampler log-probs, stop-truncated
   responses, lengths, critic values), `ref_logprobs` and `reward_scores` (the frozen models, possibly on their
   owners), assembled by `score_rollout`;
3. experience: `per_sample_rewards` (masks, EOS penalty, KL-penalised rewards: per sample, any shard) then
   `batch_advantages` (reward whitening, GAE, advantage whitening: statistics over the whole global batch, reduced
   over the training group), assembled by `make_experience`;
4. `train_on_experience`: ``num_ppo_epochs`` passes of clipped policy + value loss over mini-batches with gradient
   accumulation, one optimizer over policy and value model (as TRL), through the training backend.

Every forward runs in chunks of ``local_rollout_forward_batch_size`` rows, so a shard scored on any rank is
bit-identical to the same rows scored on a co-located rank.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import ppo_math as pm
from ._distributed import DistContext
from ._generation import policy_response_logits, sample_responses, score_head_outputs, sequence_scores
from .batch_layout import BatchLayout
from .ppo_config import PPOConfig

if TYPE_CHECKING:
    from .training_backend import TrainingBackend

__all__ = ["Experience", "PPOModels", "PPOPhases", "PolicyAndValueWrapper", "Rollout", "concat_shards"]


class PolicyAndValueWrapper(nn.Module):
    """Holds policy and value model so one optimizer, one checkpoint and one ``.train()`` cover both (as in TRL)."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, query_responses: torch.Tensor, pad_token_id: int, context_length: int,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The training forward: temperature-scaled policy logits of the response tokens ``(B, R, V)`` and the value
        head's per-position outputs ``(B, L)``. One call, so engines whose hooks start at the root see it."""
        logits = policy_response_logits(self.policy, query_responses, pad_token_id, context_length, temperature)
        return logits, score_head_outputs(self.value_model, query_responses, pad_token_id)


@dataclass
class Rollout:
    """Output of the generation phase for a batch of prompts."""

    queries: torch.Tensor  # (B, P) left-padded prompt ids
    query_responses: torch.Tensor  # (B, P + R)
    logprobs: torch.Tensor  # (B, R) sampler log-probs of the emitted tokens (temperature-scaled distribution)

    @property
    def context_length(self) -> int:
        return self.queries.size(1)

    @property
    def responses(self) -> torch.Tensor:
        return self.query_responses[:, self.context_length :]


@dataclass
class Experience:
    """Everything the PPO update needs for one rank's share of the batch (all ``(B, R)`` unless noted)."""

    query_responses: torch.Tensor  # (B, P + R)
    responses: torch.Tensor
    context_length: int
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor  # (B,)
    sequence_lengths: torch.Tensor  # (B,)
    token_mask: torch.Tensor  # valid generated tokens
    value_mask: torch.Tensor  # token_mask plus the position after the last token
    kl: torch.Tensor
    non_score_reward: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class PPOModels:
    """The models this rank holds (``None`` for a frozen model that lives on other ranks under a placement).

    ``ref_model`` is ``None`` with a PEFT policy and no separate reference: the adapter-disabled policy serves.
    """

    model: PolicyAndValueWrapper
    ref_model: nn.Module | None
    reward_model: nn.Module | None
    is_peft_model: bool = False

    @property
    def policy(self) -> nn.Module:
        return self.model.policy

    @property
    def value_model(self) -> nn.Module:
        return self.model.value_model


class PPOPhases:
    """The phases of a PPO iteration on one rank (see the module docstring).

    Args:
        args (`PPOConfig`): read only.
        layout (`BatchLayout`): batch sizes of the job and of this rank's training cut.
        models (`PPOModels`): the models this rank holds.
        dist (`DistContext`): collectives of the training group (whitening statistics, loss normalisation).
        backend (`TrainingBackend`): optimizer and gradient synchronisation of policy + value model.
        pad_token_id / eos_token_id / stop_token_id: token ids from the tokenizer and the config.
        device (`torch.device`): where the models run.
        train_dataset: rows with an ``input_ids`` column; ``data_collator`` (optional) builds ``input_ids`` batches.
        pin_weights (`Callable[[str], ContextManager]`, *optional*): ``pin_weights(role)`` holds the full weights of
            a sharded role (``"actor"``, ``"critic"``, ``"ref"``, ``"reward"``) for a whole phase: one gather per
            rollout or scoring pass instead of one per forward call. Default: nothing is sharded.
        all_finished (`Callable[[bool], bool]`, *optional*): makes generation's early stop collective (see
            `sample_responses`); needed when the policy gathers its weights per forward call.
    """

    def __init__(self, args: PPOConfig, layout: BatchLayout, models: PPOModels, dist: DistContext,
                 backend: TrainingBackend | None, pad_token_id: int, eos_token_id: int | None,
                 stop_token_id: int | None, device: torch.device, train_dataset: Any, data_collator: Any = None,
                 pin_weights: Callable[[str], AbstractContextManager[Any]] | None = None,
                 all_finished: Callable[[bool], bool] | None = None):
        self.args, self.layout, self.models, self.dist, self.backend = args, layout, models, dist, backend
        self.pin_weights = pin_weights or (lambda role: nullcontext())
        self.all_finished = all_finished
        self.pad_token_id, self.eos_token_id, self.stop_token_id = pad_token_id, eos_token_id, stop_token_id
        self.device, self.train_dataset, self.data_collator = device, train_dataset, data_collator

    # ------------------------------------------------------------------ inputs
    def collate(self, rows: list[dict]) -> torch.Tensor:
        """Left-pad prompt ids (or use the user's collator), returning ``input_ids`` on the device."""
        if self.data_collator is not None:
            return self.data_collator(rows)["input_ids"].to(self.device)
        ids = [list(r["input_ids"]) for r in rows]
        width = max(len(x) for x in ids)
        padded = [[self.pad_token_id] * (width - len(x)) + x for x in ids]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    def global_batch_indices(self, update: int) -> list[int]:
        """Dataset rows of iteration ``update`` (1-based): a per-epoch global permutation, last partial batch dropped.

        Depends only on the seed and the iteration, so a resumed run sees the same prompts it would have seen.
        """
        n, batch = len(self.train_dataset), self.layout.batch_size
        per_epoch = n // batch
        epoch, slot = divmod(update - 1, per_epoch)
        gen = torch.Generator().manual_seed(self.args.seed * 7919 + epoch)
        perm = torch.randperm(n, generator=gen)
        return perm[slot * batch : (slot + 1) * batch].tolist()

    def sample_seed(self, update: int, global_position: int) -> int:
        """Sampling seed of the sample at ``global_position`` of iteration ``update``: never depends on the rank."""
        return (self.args.seed * 1_000_003 + update * 100_003 + global_position) % (2**62)

    def shard_batch(self, update: int, shard: int) -> tuple[torch.Tensor, list[int]]:
        """Prompts and sampling seeds of co-located shard ``shard`` (the local batch of co-located rank ``shard``)."""
        size = self.layout.local_batch_size
        rows = self.global_batch_indices(update)[shard * size : (shard + 1) * size]
        seeds = [self.sample_seed(update, shard * size + i) for i in range(size)]
        return self.collate([self.train_dataset[i] for i in rows]), seeds

    # ------------------------------------------------------------------ helpers
    def autocast(self):
        if self.args.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @contextmanager
    def null_ref_context(self):
        """With PEFT and no separate reference: run the policy with adapters disabled (or the named ref adapter)."""
        policy = self.models.policy
        ref_adapter = self.args.ref_adapter_name
        ctx = policy.disable_adapter() if self.models.is_peft_model and not ref_adapter else nullcontext()
        with ctx:
            if ref_adapter:
                policy.set_adapter(ref_adapter)
            try:
                yield
            finally:
                if ref_adapter:
                    policy.set_adapter(self.args.model_adapter_name or "default")

    def _chunks(self, rows: int) -> range:
        return range(0, rows, self.args.local_rollout_forward_batch_size)

    # ------------------------------------------------------------------ 1. generation
    @torch.no_grad()
    def rollout(self, queries: torch.Tensor, sample_seeds: list[int], temperature: float | None = None) -> Rollout:
        """Sample ``response_length`` tokens per prompt in chunks of ``local_rollout_forward_batch_size``."""
        args = self.args
        temperature = args.temperature if temperature is None else temperature
        policy = self.models.policy
        was_training = policy.training
        policy.eval()
        chunk = args.local_rollout_forward_batch_size
        outs, logprobs = [], []
        # TRL's ds3_gather_for_generation: a sharded policy is gathered once for the whole rollout, or per forward.
        pinned = self.pin_weights("actor") if args.ds3_gather_for_generation else nullcontext()
        with pinned, self.autocast():
            for i in self._chunks(queries.size(0)):
                qr, lp = sample_responses(
                    policy, queries[i : i + chunk], pad_token_id=self.pad_token_id,
                    response_length=args.response_length, temperature=temperature,
                    sample_seeds=sample_seeds[i : i + chunk], stop_token_id=self.stop_token_id,
                    all_finished=self.all_finished,
                )
                outs.append(qr)
                logprobs.append(lp)
        policy.train(was_training)
        width = max(o.size(1) for o in outs)  # chunks may stop early at different lengths
        outs = [torch.nn.functional.pad(o, (0, width - o.size(1)), value=self.pad_token_id) for o in outs]
        steps = width - queries.size(1)
        logprobs = [torch.nn.functional.pad(lp, (0, steps - lp.size(1)), value=pm.INVALID_LOGPROB) for lp in logprobs]
        return Rollout(queries=queries, query_responses=torch.cat(outs), logprobs=torch.cat(logprobs))

    # ------------------------------------------------------------------ 2. scoring
    @torch.no_grad()
    def policy_side_scores(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """Sampler log-probs, stop-truncated responses, sequence lengths and critic values (no ref, no reward)."""
        ctx = rollout.context_length
        chunk = self.args.local_rollout_forward_batch_size
        out: dict[str, list[torch.Tensor]] = {"logprobs": [], "values": [], "responses": [], "sequence_lengths": []}
        self.models.model.eval()
        with self.pin_weights("critic"):
            for i in self._chunks(rollout.queries.size(0)):
                query_response = rollout.query_responses[i : i + chunk]
                processed = query_response[:, ctx:]
                out["logprobs"].append(rollout.logprobs[i : i + chunk])
                if self.stop_token_id is not None:
                    processed = pm.truncate_after_stop_token(processed, self.stop_token_id, self.pad_token_id)
                with self.autocast():
                    full_values = score_head_outputs(self.models.value_model, query_response, self.pad_token_id)
                out["values"].append(full_values[:, ctx - 1 : -1].float())
                out["responses"].append(processed)
                out["sequence_lengths"].append(pm.first_true_indices(processed == self.pad_token_id) - 1)
        self.models.model.train()
        return {k: torch.cat(v) for k, v in out.items()}

    @torch.no_grad()
    def ref_logprobs(self, query_responses: torch.Tensor, context_length: int) -> torch.Tensor:
        """``(B, R)`` reference log-probs of the response tokens (the adapter-disabled policy when there is no ref
        model). Runs where the reference lives (its owner ranks under a placement)."""
        qr, ctx = query_responses.to(self.device), int(context_length)
        chunk = self.args.local_rollout_forward_batch_size
        parts = []
        with self.pin_weights("ref" if self.models.ref_model is not None else "actor"):
            for i in self._chunks(qr.size(0)):
                query_response = qr[i : i + chunk]
                with self.autocast():
                    if self.models.ref_model is None:
                        with self.null_ref_context():
                            logits = policy_response_logits(self.models.policy, query_response, self.pad_token_id, ctx,
                                                            self.args.temperature)
                    else:
                        logits = policy_response_logits(self.models.ref_model, query_response, self.pad_token_id, ctx,
                                                        self.args.temperature)
                    parts.append(pm.logprobs_from_logits(logits, query_response[:, ctx:]))
        return torch.cat(parts)

    @torch.no_grad()
    def reward_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``(B,)`` reward-model scores of the stop-truncated sequences. Runs where the reward model lives."""
        queries, responses = queries.to(self.device), responses.to(self.device)
        chunk = self.args.local_rollout_forward_batch_size
        ctx = queries.size(1)
        parts = []
        with self.pin_weights("reward"):
            for i in self._chunks(queries.size(0)):
                with self.autocast():
                    scores = sequence_scores(self.models.reward_model, torch.cat([queries[i : i + chunk],
                                                                                 responses[i : i + chunk]], 1),
                                             self.pad_token_id, ctx)
                parts.append(scores.float())
        return torch.cat(parts)

    def score_rollout(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """All four frozen forwards on this rank: `policy_side_scores` plus reference log-probs and reward scores."""
        scored = self.policy_side_scores(rollout)
        scored["ref_logprobs"] = self.ref_logprobs(rollout.query_responses, rollout.context_length)
        scored["scores"] = self.reward_scores(rollout.queries, scored["responses"])
        return scored

    # ------------------------------------------------------------------ 3. experience
    @torch.no_grad()
    def per_sample_rewards(self, scored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Masks, EOS penalty, KL and KL-penalised rewards. Nothing here mixes samples: any shard, any rank."""
        args = self.args
        responses, lengths = scored["responses"], scored["sequence_lengths"]
        scores = scored["scores"].clone()
        contain_eos = (responses == self.eos_token_id).any(dim=-1)
        if args.missing_eos_penalty is not None:
            scores[~contain_eos] -= args.missing_eos_penalty
        token_mask, value_mask = pm.response_masks(lengths, responses.size(1))
        logprobs = scored["logprobs"].masked_fill(~token_mask, pm.INVALID_LOGPROB)
        ref_logprobs = scored["ref_logprobs"].masked_fill(~token_mask, pm.INVALID_LOGPROB)
        values = scored["values"].masked_fill(~value_mask, 0.0)
        kl = pm.kl_per_token(logprobs, ref_logprobs, args.kl_estimator)
        rewards, non_score_reward = pm.kl_penalty_rewards(kl, scores, lengths, args.kl_coef)
        return {
            "responses": responses, "sequence_lengths": lengths, "scores": scores, "logprobs": logprobs,
            "ref_logprobs": ref_logprobs, "values": values, "kl": kl, "non_score_reward": non_score_reward,
            "rewards": rewards, "token_mask": token_mask, "value_mask": value_mask, "contain_eos": contain_eos,
        }

    @torch.no_grad()
    def batch_advantages(self, part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reward whitening, GAE and advantage whitening: the only step that needs the whole global batch.

        Whitening statistics are summed over ``self.dist`` (the training group), which holds the global batch once.
        """
        args = self.args
        token_mask, value_mask = part["token_mask"], part["value_mask"]
        reduce = self.dist.all_reduce_sum if self.dist.world_size > 1 else None
        rewards = part["rewards"]
        if args.whiten_rewards:
            rewards = pm.masked_whiten(rewards, value_mask, shift_mean=False, all_reduce=reduce)
            rewards = rewards.masked_fill(~value_mask, 0.0)
        advantages, returns = pm.compute_gae(rewards, part["values"], args.gamma, args.lam)
        advantages = pm.masked_whiten(advantages, token_mask, all_reduce=reduce).masked_fill(~token_mask, 0.0)
        return {**part, "rewards": rewards, "advantages": advantages, "returns": returns}

    def compute_advantages(self, scored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Masks, EOS penalty, KL-penalised rewards, GAE and whitening (statistics over the training group)."""
        return self.batch_advantages(self.per_sample_rewards(scored))

    @staticmethod
    def experience(query_responses: torch.Tensor, context_length: int, raw_responses: torch.Tensor,
                   adv: dict[str, torch.Tensor]) -> Experience:
        """Assemble an `Experience` from the output of `batch_advantages`."""
        return Experience(
            query_responses=query_responses, responses=adv["responses"], context_length=context_length,
            logprobs=adv["logprobs"], ref_logprobs=adv["ref_logprobs"], values=adv["values"], scores=adv["scores"],
            sequence_lengths=adv["sequence_lengths"], token_mask=adv["token_mask"], value_mask=adv["value_mask"],
            kl=adv["kl"], non_score_reward=adv["non_score_reward"], rewards=adv["rewards"],
            advantages=adv["advantages"], returns=adv["returns"],
            extras={"contain_eos": adv["contain_eos"], "raw_responses": raw_responses},
        )

    def experience_from_scores(self, rollout: Rollout, scored: dict[str, torch.Tensor]) -> Experience:
        """Advantages of a scored rollout (whitening over the training group) as an `Experience`."""
        adv = self.compute_advantages(scored)
        return self.experience(rollout.query_responses, rollout.context_length, rollout.responses, adv)

    def make_experience(self, rollout: Rollout) -> Experience:
        """`score_rollout` then the advantages: the experience phase when every model lives on this rank."""
        return self.experience_from_scores(rollout, self.score_rollout(rollout))

    # ------------------------------------------------------------------ 4. training
    def train_on_experience(self, exp: Experience, update: int) -> dict[str, torch.Tensor]:
        """PPO epochs x mini-batches x micro-batches; one optimizer step per mini-batch (gradients averaged over
        micro-batches and ranks by the backend). Returns per-(epoch, mini-batch, micro-batch) statistics."""
        if self.backend is None:
            raise RuntimeError("this rank holds no trained model (a disaggregated inference rank); it cannot train.")
        args, layout, backend = self.args, self.layout, self.backend
        ctx = exp.context_length
        accum, micro = layout.accumulation_steps, layout.train_micro_batch
        shape = (args.num_ppo_epochs, args.num_mini_batches, accum)
        stats = {k: torch.zeros(shape, device=self.device)
                 for k in ("approxkl", "pg_clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        model = self.models.model
        model.train()
        shards, shard = layout.shards_per_rank, layout.local_batch_size
        first_shard = self.dist.rank * shards
        shard_mini = layout.local_mini_batch_size
        for epoch in range(args.num_ppo_epochs):
            # One permutation per co-located shard keyed by its global index (= the rank holding it when co-located),
            # so every placement forms the same global mini-batches from the same rows.
            orders = []
            for s in range(shards):
                gen = torch.Generator().manual_seed(self.sample_seed(update, 0) * 31 + epoch * 7 + first_shard + s)
                orders.append(torch.randperm(shard, generator=gen) + s * shard)
            for mb in range(args.num_mini_batches):
                mini = torch.cat([o[mb * shard_mini : (mb + 1) * shard_mini] for o in orders])
                backend.zero_grad()
                tok_norm = val_norm = None
                if args.loss_normalization == "mini_batch":
                    # Global token counts of this mini-batch; x world_size because gradients are averaged over ranks.
                    counts = torch.stack([exp.token_mask[mini].sum(), exp.value_mask[mini].sum()]).double()
                    counts = self.dist.all_reduce_sum(counts) / self.dist.world_size
                    tok_norm, val_norm = counts[0].float(), counts[1].float()
                for k, mstart in enumerate(range(0, layout.rank_mini_batch_size, micro)):
                    idx = mini[mstart : mstart + micro].to(self.device)
                    token_mask, value_mask = exp.token_mask[idx], exp.value_mask[idx]
                    with backend.micro_step(last=k == accum - 1):
                        with self.autocast():
                            logits, vfull = backend.train_forward(model, exp.query_responses[idx], self.pad_token_id,
                                                                  ctx, args.temperature)
                            vpred = vfull[:, ctx - 1 : -1].float()
                        new_logprobs = pm.logprobs_from_logits(logits, exp.responses[idx])
                        new_logprobs = new_logprobs.masked_fill(~token_mask, pm.INVALID_LOGPROB)
                        vpred = vpred.masked_fill(~value_mask, 0.0)
                        vf_loss, vf_clipfrac = pm.value_loss(
                            vpred, exp.values[idx], exp.returns[idx], value_mask, args.cliprange_value, val_norm)
                        pg_loss, pg_clipfrac, ratio = pm.policy_loss(
                            new_logprobs, exp.logprobs[idx], exp.advantages[idx], token_mask, args.cliprange,
                            tok_norm)
                        loss = pg_loss + args.vf_coef * vf_loss
                        backend.backward(loss if tok_norm is not None else loss / accum)
                    with torch.no_grad():
                        at = (epoch, mb, k)
                        stats["approxkl"][at] = pm.approx_kl(new_logprobs, exp.logprobs[idx])
                        stats["pg_clipfrac"][at] = pg_clipfrac
                        if tok_norm is None:
                            stats["pg_loss"][at] = pg_loss.detach()
                            stats["vf_loss"][at] = vf_loss.detach()
                        else:  # report the micro-batch mean either way
                            stats["pg_loss"][at] = pg_loss.detach() * tok_norm / token_mask.sum()
                            stats["vf_loss"][at] = vf_loss.detach() * val_norm / value_mask.sum()
                        stats["vf_clipfrac"][at] = vf_clipfrac
                        stats["entropy"][at] = pm.entropy_from_logits(logits.detach()).mean()
                        stats["ratio"][at] = ratio.detach().mean()
                    del logits, vfull, vpred, loss
                backend.step()
        return stats


# Fill values when shards of different response widths are concatenated: every padded position is outside both
# masks, so GAE (which bootstraps with 0 after the last position) and the masked whitening see exactly what the
# narrower shard saw on its own.
_RIGHT_PAD = {"logprobs": pm.INVALID_LOGPROB, "ref_logprobs": pm.INVALID_LOGPROB, "values": 0.0, "kl": 0.0,
              "non_score_reward": 0.0, "rewards": 0.0, "token_mask": False, "value_mask": False}


def concat_shards(shards: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate shard messages (in order): prompts left-padded to the widest context, responses right-padded.

    A rank that trains on several shards scored elsewhere (a disaggregated trainer) joins them with this before
    `PPOPhases.batch_advantages`.
    """
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

