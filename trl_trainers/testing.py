"""Tiny, fully local PPO ingredients: a character tokenizer, GPT-2 policy/value models from config, and a
programmatic reward model. Used by the tests, the tour, the example script when no hub is reachable, and the benchmark.

Why a programmatic reward: a reward whose optimum is known (emit a target character) turns "PPO learns" into a
checkable claim on CPU in seconds, and it fails loudly when a sign or an advantage is wrong.
"""

from __future__ import annotations

import string
from types import SimpleNamespace

import torch
from torch import nn

__all__ = [
    "TargetTokenRewardModel",
    "char_tokenizer",
    "prompt_dataset",
    "tiny_causal_lm",
    "tiny_value_model",
]

CHARS = string.ascii_lowercase + string.digits + " .,!?"


def char_tokenizer(pad_token: str | None = "[PAD]"):
    """A character-level ``PreTrainedTokenizerFast`` built in-process (no download), left padding, EOS ``[EOS]``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[EOS]", "[UNK]"]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    kwargs = {"eos_token": "[EOS]", "unk_token": "[UNK]", "padding_side": "left"}
    if pad_token is not None:
        kwargs["pad_token"] = pad_token
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if pad_token is None:
        tok.pad_token = None
    return tok


def _gpt2_config(vocab_size: int, n_layer: int, n_embd: int, n_positions: int, **extra):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=max(1, n_embd // 16),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        **extra,
    )


def tiny_causal_lm(vocab_size: int, seed: int = 0, n_layer: int = 2, n_embd: int = 32, n_positions: int = 128):
    """A randomly initialised GPT-2 causal LM small enough for CPU tests."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(_gpt2_config(vocab_size, n_layer, n_embd, n_positions))


def tiny_value_model(vocab_size: int, seed: int = 0, n_layer: int = 2, n_embd: int = 32, n_positions: int = 128):
    """A randomly initialised one-label GPT-2 sequence classifier (backbone ``transformer`` + ``score`` head)."""
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(seed)
    return GPT2ForSequenceClassification(_gpt2_config(vocab_size, n_layer, n_embd, n_positions, num_labels=1))


class _CountingBackbone(nn.Module):
    """Hidden state at position ``t`` = running count of the target token up to ``t`` (a 1-dim "feature")."""

    def __init__(self, target_token_id: int):
        super().__init__()
        self.target_token_id = target_token_id

    def forward(self, input_ids, attention_mask=None, **_):
        hits = (input_ids == self.target_token_id).float()
        if attention_mask is not None:
            hits = hits * attention_mask.float()
        hidden = hits.cumsum(dim=1).unsqueeze(-1)
        return SimpleNamespace(hidden_states=(hidden,), last_hidden_state=hidden)


class TargetTokenRewardModel(nn.Module):
    """Reward model with the TRL reward-model interface whose score is ``scale * (#target tokens so far)``.

    It exposes ``base_model_prefix``/backbone/``score`` like ``AutoModelForSequenceClassification``, so both this
    package's trainer and TRL's use it unchanged.
    """

    base_model_prefix = "backbone"

    def __init__(self, target_token_id: int, scale: float = 1.0):
        super().__init__()
        self.backbone = _CountingBackbone(target_token_id)
        self.score = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.score.weight.fill_(scale)
        self.score.weight.requires_grad_(False)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        hidden = self.backbone(input_ids, attention_mask=attention_mask).hidden_states[-1]
        return SimpleNamespace(logits=self.score(hidden)[:, -1])


def prompt_dataset(tokenizer, n: int = 64, min_len: int = 3, max_len: int = 6, seed: int = 0, exclude: str = ""):
    """A ``datasets.Dataset`` of random lowercase prompts tokenised into ``input_ids`` (no padding)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    letters = [c for c in string.ascii_lowercase if c not in exclude]
    prompts = ["".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return Dataset.from_dict({"input_ids": ids})
