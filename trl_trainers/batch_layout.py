"""How one PPO iteration's batch is cut: a pure function of the config, the world size and the placement.

TRL derives these sizes inside its trainer and writes them into the config. Here they are computed once, by
`compute_batch_layout`, into a frozen `BatchLayout` that the trainer and the placement executors read; the config a
user passes is never modified. Every placement shares the *co-located* layout: the global batch is ``world_size``
shards of ``per_device_train_batch_size * gradient_accumulation_steps`` prompts, whichever ranks generate or train
them, so switching the placement changes where things run, not what is learned.

A rank that trains several co-located shards (a disaggregated trainer holds ``world_size / #trainers`` of them)
cuts each shard into mini-batch slices exactly as the co-located rank holding it would, so the global mini-batches
are the same rows under every placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BatchLayout", "compute_batch_layout"]


def _exact_div(a: int, b: int, what: str, fix: str) -> int:
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}. {fix}")
    return a // b


@dataclass(frozen=True)
class BatchLayout:
    """Batch sizes of one PPO iteration (TRL's names for the co-located view, plus this rank's training cut).

    Co-located view (identical on every rank and under every placement):

    - ``world_size``: ranks of the job, i.e. co-located shards of the global batch;
    - ``local_batch_size``: prompts per shard (``per_device_train_batch_size * gradient_accumulation_steps``);
    - ``batch_size``: the global rollout batch (``local_batch_size * world_size``);
    - ``micro_batch_size``: ``per_device_train_batch_size * world_size`` (TRL's name);
    - ``mini_batch_size`` / ``local_mini_batch_size``: one optimizer step's share of the global batch / of a shard;
    - ``total_episodes`` / ``num_total_batches``: prompts to consume and the PPO iterations that takes.

    This rank's training cut:

    - ``shards_per_rank``: co-located shards the rank trains on (1 unless it is a disaggregated trainer);
    - ``train_micro_batch``: sequences per forward/backward pass;
    - ``accumulation_steps``: micro-batches per optimizer step on this rank.
    """

    world_size: int
    local_batch_size: int
    batch_size: int
    micro_batch_size: int
    mini_batch_size: int
    local_mini_batch_size: int
    total_episodes: int
    num_total_batches: int
    shards_per_rank: int
    train_micro_batch: int
    accumulation_steps: int

    @property
    def rank_batch_size(self) -> int:
        """Sequences this rank trains on per iteration (all of its shards)."""
        return self.local_batch_size * self.shards_per_rank

    @property
    def rank_mini_batch_size(self) -> int:
        """Sequences this rank contributes to one optimizer step."""
        return self.local_mini_batch_size * self.shards_per_rank

    def config_fields(self) -> dict[str, int]:
        """The values TRL writes into ``PPOConfig``'s runtime fields (world_size, batch_size, ...)."""
        return {"world_size": self.world_size, "local_batch_size": self.local_batch_size,
                "batch_size": self.batch_size, "micro_batch_size": self.micro_batch_size,
                "mini_batch_size": self.mini_batch_size, "local_mini_batch_size": self.local_mini_batch_size,
                "total_episodes": self.total_episodes, "num_total_batches": self.num_total_batches}


def compute_batch_layout(per_device_train_batch_size: int, gradient_accumulation_steps: int, num_mini_batches: int,
                         world_size: int, dataset_size: int, total_episodes: int | None = None,
                         num_train_epochs: float = 1.0, shards_per_rank: int = 1) -> BatchLayout:
    """The `BatchLayout` of a job, validated (errors name the sizes and the fix).

    Args:
        per_device_train_batch_size / gradient_accumulation_steps / num_mini_batches: the config's values.
        world_size: ranks of the job (co-located shards).
        dataset_size: rows of the training set (one global batch must fit).
        total_episodes: prompts to consume; default ``num_train_epochs * dataset_size`` (as TRL).
        shards_per_rank: co-located shards this rank trains on (a divisor of ``world_size``).
    """
    if world_size < 1 or shards_per_rank < 1 or world_size % shards_per_rank:
        raise ValueError(f"shards_per_rank={shards_per_rank} must divide world_size={world_size}: the global batch "
                         "is cut into world_size shards shared equally by the training ranks.")
    local = per_device_train_batch_size * gradient_accumulation_steps
    batch = local * world_size
    mini = _exact_div(batch, num_mini_batches, "batch_size (per_device_train_batch_size * gradient_accumulation_steps "
                      "* world_size) must be a multiple of num_mini_batches", "Change num_mini_batches or the batch "
                      "sizes.")
    local_mini = _exact_div(local, num_mini_batches, "local_batch_size (per_device_train_batch_size * "
                            "gradient_accumulation_steps) must be a multiple of num_mini_batches",
                            "Change num_mini_batches or the batch sizes.")
    # Micro-batches: per_device_train_batch_size sequences, or the whole mini-batch slice when that is smaller (TRL).
    micro = min(per_device_train_batch_size, local_mini)
    _exact_div(local_mini, micro, "local_mini_batch_size (local_batch_size / num_mini_batches) must be a multiple of "
               "per_device_train_batch_size", "Make gradient_accumulation_steps a multiple of num_mini_batches.")
    if dataset_size < batch:
        raise ValueError(f"train_dataset has {dataset_size} rows, fewer than one global rollout batch "
                         f"(batch_size={batch}). Add prompts or lower per_device_train_batch_size / "
                         "gradient_accumulation_steps.")
    episodes = int(num_train_epochs * dataset_size) if total_episodes is None else int(total_episodes)
    return BatchLayout(world_size=world_size, local_batch_size=local, batch_size=batch,
                       micro_batch_size=per_device_train_batch_size * world_size, mini_batch_size=mini,
                       local_mini_batch_size=local_mini, total_episodes=episodes,
                       num_total_batches=math.ceil(episodes / batch), shards_per_rank=shards_per_rank,
                       train_micro_batch=micro, accumulation_steps=local_mini * shards_per_rank // micro)
