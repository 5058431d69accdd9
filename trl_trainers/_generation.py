"""Sampling with a per-sequence random stream, and the forward passes PPO needs from each model.

Why our own sampling loop instead of ``model.generate``: every sequence draws its noise from a generator seeded by the
sequence's *global* position in the rollout (``sample_seeds``), so the tokens sampled for a prompt do not depend on
which rank it lands on, on the chunk size, or on its neighbours in the batch. That is what lets 1 rank and N ranks (or
any placement) produce bit-identical rollouts and hence the same update. Sampling uses the exponential-race form of
the Gumbel-max trick (``argmax(logits/T - log E)``, ``E ~ Exp(1)``), which draws exactly from ``softmax(logits/T)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["policy_response_logits", "sample_responses", "score_head_outputs", "sequence_scores"]


def _inputs(query_responses: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Attention mask from padding, pad ids replaced by 0, positions counted over real tokens (left padding)."""
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.long().cumsum(1) - attention_mask.long()
    input_ids = query_responses.masked_fill(~attention_mask, 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


@torch.no_grad()
def sample_responses(
    model: torch.nn.Module,
    queries: torch.Tensor,
    *,
    pad_token_id: int,
    response_length: int,
    temperature: float,
    sample_seeds: list[int],
    stop_token_id: int | None = None,
    all_finished: Callable[[bool], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``response_length`` tokens for left-padded ``queries`` with a KV cache.

    Returns ``(query_responses, logprobs)``: ``(B, P + R')`` token ids and ``(B, R')`` log-probabilities of the emitted
    tokens under the temperature-scaled distribution, ``R' <= response_length`` (the loop stops early once every
    sequence has emitted its stop token, like ``generate``; finished sequences are padded with ``pad_token_id``).
    Only the chosen tokens' log-probs are kept, not the ``(B, R, V)`` logits TRL keeps: with a 50k vocabulary that
    tensor is the largest object of the rollout.

    ``all_finished(local_done) -> bool`` (optional) makes the early stop collective, as ``generate(synced_gpus=True)``
    does: a model whose forward gathers weights per layer (ZeRO-3 without ``ds3_gather_for_generation``) must run
    the same number of steps on every rank. The extra steps emit padding only.
    """
    if len(sample_seeds) != queries.size(0):
        raise ValueError(f"sample_seeds has {len(sample_seeds)} entries for {queries.size(0)} queries.")
    device = queries.device
    generators = [torch.Generator().manual_seed(int(seed)) for seed in sample_seeds]
    inputs = _inputs(queries, pad_token_id)
    attention_mask = inputs["attention_mask"].long()
    next_position = inputs["position_ids"][:, -1:] + 1
    out = model(**inputs, use_cache=True, return_dict=True)
    # transformers >= 5.2x names the KV cache `cache`; older releases `past_key_values`.
    cache_key = "cache" if "cache" in out else "past_key_values"
    past = out[cache_key]
    step_logits = out.logits[:, -1, :].float() / (temperature + 1e-7)
    finished = torch.zeros(queries.size(0), dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for step in range(response_length):
        vocab = step_logits.size(-1)
        uniform = torch.stack([torch.rand(vocab, generator=g) for g in generators]).to(device)
        exponential = -torch.log1p(-uniform)  # Exp(1) noise, finite because rand < 1
        token = torch.argmax(step_logits - torch.log(exponential), dim=-1)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        logprobs.append(
            step_logits.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(step_logits, dim=-1))
        if stop_token_id is not None:
            finished = finished | (token == stop_token_id)
            done = bool(finished.all())
            if all_finished is not None:
                done = all_finished(done)
            if done:
                break
        if step == response_length - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        out = model(
            input_ids=token.unsqueeze(1),
            attention_mask=attention_mask,
            position_ids=next_position,
            use_cache=True,
            return_dict=True,
            **{cache_key: past},
        )
        past = out[cache_key]
        next_position = next_position + 1
        step_logits = out.logits[:, -1, :].float() / (temperature + 1e-7)
    responses = torch.stack(tokens, dim=1)
    return torch.cat([queries, responses], dim=1), torch.stack(logprobs, dim=1)


def policy_response_logits(
    model: torch.nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int, temperature: float
) -> torch.Tensor:
    """Temperature-scaled logits that predicted each response token: ``(B, R, V)``."""
    out = model(**_inputs(query_responses, pad_token_id), return_dict=True)
    return out.logits[:, context_length - 1 : -1] / (temperature + 1e-7)


def score_head_outputs(model: torch.nn.Module, query_responses: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Per-position scalar of a sequence-classification model: ``score(backbone(x).hidden_states[-1])``, ``(B, L)``.

    Uses the TRL convention for reward and value models: the backbone lives at ``model.<base_model_prefix>`` and the
    one-output head at ``model.score``.
    """
    prefix = getattr(model, "base_model_prefix", None)
    backbone = getattr(model, prefix, None) if prefix else None
    if backbone is None or not hasattr(model, "score"):
        raise TypeError(
            f"{type(model).__name__} cannot serve as reward/value model: it needs a backbone at "
            "`model.<base_model_prefix>` and a `score` head, e.g. "
            "AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)."
        )
    out = backbone(**_inputs(query_responses, pad_token_id), return_dict=True, output_hidden_states=True,
                   use_cache=False)
    return model.score(out.hidden_states[-1]).squeeze(-1)


def sequence_scores(
    model: torch.nn.Module, query_responses: torch.Tensor, pad_token_id: int, context_length: int
) -> torch.Tensor:
    """Reward-model score at the last non-pad response token (the prompt's last token for an empty response)."""
    per_position = score_head_outputs(model, query_responses, pad_token_id)
    response_is_pad = query_responses[:, context_length:] == pad_token_id
    length = response_is_pad.size(1)
    positions = torch.arange(length, device=query_responses.device).expand_as(response_is_pad)
    first_pad = torch.where(response_is_pad, positions, torch.full_like(positions, length)).min(dim=-1).values
    last = first_pad - 1 + context_length
    return per_position[torch.arange(per_position.size(0), device=per_position.device), last]
