"""All-colocated (TRL, DeepSpeed-Chat): every role on every rank; each rank runs every phase on its shard.

The default executor of `PPOTrainer`. With ``plan.sharded_roles`` (what All-colocated must do when the four models do
not fit a device) those models are sharded over all ranks by the PaRO engine (`trl_trainers.placement.sharding`);
the phases pin each sharded model for the phase that uses it, and the update equals the unsharded one up to fp32
round-off.
"""

from __future__ import annotations

import torch

from ..ppo_phases import Experience
from .executor import PPOExecutor, register_executor

__all__ = ["ColocatedExecutor"]


@register_executor("colocated")
class ColocatedExecutor(PPOExecutor):
    """Generation, experience and training of co-located shard ``rank`` on rank ``rank``."""

    def iteration(self, update: int) -> tuple[Experience, dict[str, torch.Tensor]]:
        phases = self.phases
        queries, seeds = phases.shard_batch(update, phases.dist.rank)
        with self.timeline.phase("generation"):
            rollout = phases.rollout(queries, seeds)
        with self.timeline.phase("experience"):
            exp = phases.make_experience(rollout)
        return exp, self.train(exp, update)
