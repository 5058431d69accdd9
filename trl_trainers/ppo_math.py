"""PPO mathematics as small pure tensor functions.

Why a module of its own: the trainer composes these, and the placement executors of ``hf_placement`` (which run the
same algorithm with the models on different ranks) reuse them unchanged, so a placement can change *where* a number is
computed but never *how*. Nothing here touches a model, an optimizer or a process group, except the optional
``group``/``all_reduce`` hook of :func:`masked_whiten` that lets whitening statistics span several ranks.

Shapes: ``B`` = sequences in the batch, ``T`` = response positions. Masks are boolean tensors where ``True`` marks a
*valid* position (the inverse of TRL's ``padding_mask``); this keeps every formula a plain masked reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "INVALID_LOGPROB",
    "approx_kl",
    "compute_gae",
    "entropy_from_logits",
    "first_true_indices",
    "kl_penalty_rewards",
    "kl_per_token",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "response_masks",
    "truncate_after_stop_token",
    "value_loss",
]

# Log-probability written into padded response positions. A large finite value (not -inf) keeps ratios
# ``exp(new - old)`` finite at padding, where the losses mask them out anyway.
INVALID_LOGPROB = 1.0

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first ``True`` along the last dim, or the row length when a row has none. ``(B, T) -> (B,)``."""
    length = bools.size(-1)
    positions = torch.arange(length, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, torch.full_like(positions, length)).min(dim=-1).values


def truncate_after_stop_token(responses: torch.Tensor, stop_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Keep each response up to and including its first stop token; everything after becomes ``pad_token_id``."""
    stop_at = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    positions = torch.arange(responses.size(-1), device=responses.device)
    return responses.masked_fill(positions > stop_at, pad_token_id)


def response_masks(sequence_lengths: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validity masks from ``sequence_lengths`` (index of the last real response token, ``-1`` for an empty one).

    Returns ``(token_mask, value_mask)``: ``token_mask[b, t] = t <= len_b`` marks generated tokens (log-probs, policy
    loss, advantages); ``value_mask[b, t] = t <= len_b + 1`` also keeps the position right after the last token, where
    the score lands when the response stopped early (values and returns live there too).
    """
    positions = torch.arange(response_length, device=sequence_lengths.device).unsqueeze(0)
    lengths = sequence_lengths.unsqueeze(1)
    return positions <= lengths, positions <= lengths + 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is true (over ``dim`` only, when given)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


def _masked_sum_or_mean(values: torch.Tensor, mask: torch.Tensor, normalizer) -> torch.Tensor:
    if normalizer is None:
        return masked_mean(values, mask)
    return (values * mask.to(values.dtype)).sum() / normalizer


def _masked_moments(
    values: torch.Tensor, mask: torch.Tensor, all_reduce: AllReduce | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, biased variance) over the mask, optionally reduced over ranks through ``all_reduce`` (sum).

    Two passes (mean first, then squared deviations) so the distributed result equals the single-process one to
    rounding, not just algebraically.
    """
    maskf = mask.to(values.dtype)
    sums = torch.stack([maskf.sum(), (values * maskf).sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    count, total = sums[0], sums[1]
    mean = total / count
    sq = ((values - mean) ** 2 * maskf).sum()
    if all_reduce is not None:
        sq = all_reduce(sq.reshape(1)).reshape(())
    return count, mean, sq / count


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """Variance over masked positions; ``unbiased`` applies Bessel's correction (needs at least two positions)."""
    count, _, var = _masked_moments(values, mask, all_reduce)
    if unbiased:
        if count.item() < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 valid positions, got {int(count.item())}; "
                "enlarge the batch or the response length."
            )
        var = var * count / (count - 1)
    return var


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Normalise to unit (unbiased) variance over the masked positions; subtract the mean unless ``shift_mean=False``.

    ``all_reduce`` (a function summing a tensor over ranks, e.g. ``dist.all_reduce`` wrapped) makes the statistics
    span the global batch: that is what makes N ranks compute the same update as one process on the same batch.
    Padded positions are transformed too; callers zero them afterwards.
    """
    count, mean, var = _masked_moments(values, mask, all_reduce)
    if count.item() >= 2:
        var = var * count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``tokens`` under ``logits``: ``(B, T, V), (B, T) -> (B, T)``, in fp32 for stability."""
    logits = logits.float()
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution per position: ``(B, T, V) -> (B, T)``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled tokens (http://joschu.net/blog/kl-approx.html).

    With ``log_r = ref - policy``: ``k1 = -log_r`` (unbiased, can be negative), ``k3 = exp(log_r) - 1 - log_r``
    (unbiased, non-negative, lower variance).
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator={estimator!r} is not supported; use 'k1' or 'k3'.")


def kl_penalty_rewards(
    kl: torch.Tensor, scores: torch.Tensor, sequence_lengths: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * kl`` everywhere plus the sequence score at the end of each response.

    The score lands one position after the last real token (``len + 1``) when that position exists, else on the last
    token itself, so a response that fills the whole budget still receives its score. Returns
    ``(rewards, non_score_reward)``; both ``(B, T)``.
    """
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    length = rewards.size(1)
    end = torch.where(sequence_lengths + 1 < length, sequence_lengths + 1, sequence_lengths)
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, end] += scores.to(rewards.dtype)
    return rewards, non_score_reward


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response axis, bootstrapping with 0 after the last position.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lam * A_{t+1}``; returns ``A + V``. Padding
    must already be zero in ``rewards`` and ``values`` beyond the value mask (the trainer does this), so the episode
    ends at the response end. Returns ``(advantages, returns)``.
    """
    length = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (as a loss to minimise): masked mean of ``max(-A r, -A clip(r, 1-c, 1+c))``.

    ``normalizer`` replaces the local count of valid tokens as denominator (e.g. the token count of a whole mini-batch
    over all ranks, which makes the summed gradient independent of how the mini-batch is split).
    Returns ``(loss, clip_fraction, ratio)``; ``clip_fraction`` is the share of valid tokens where clipping was active.
    """
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = _masked_sum_or_mean(torch.maximum(unclipped, clipped), mask, normalizer)
    clip_fraction = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
    return loss, clip_fraction.detach(), ratio


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ``0.5 * masked_mean(max((V - R)^2, (clip(V, V_old +- c) - R)^2))``.

    ``normalizer`` as in :func:`policy_loss`. Returns ``(loss, clip_fraction)``.
    """
    clipped_values = torch.clamp(new_values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_err = (new_values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * _masked_sum_or_mean(torch.maximum(unclipped_err, clipped_err), mask, normalizer)
    clip_fraction = masked_mean((clipped_err > unclipped_err).to(new_values.dtype), mask)
    return loss, clip_fraction.detach()


def approx_kl(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Diagnostic ``0.5 * mean((new - old)^2)`` over all positions (TRL's ``policy/approxkl_avg``)."""
    return 0.5 * ((new_logprobs - old_logprobs) ** 2).mean()
