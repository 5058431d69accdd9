"""Interleaving (APP's packing rule): actor and critic data-parallel on every rank, ref and reward on disjoint owners.

By default the reference model lives on the first half of the ranks and the reward model on the second half, so the
two frozen forwards run concurrently (`hf_placement.runtime.run_concurrently`). Non-owners send ``(query_responses,
context)`` / ``(queries, responses)`` to their owner and get log-probs / scores back; owners run one forward pass
per partner shard, so results are bit-identical to a co-located run. A sharded ref (reward) is sharded over its
owners only, so its all-gathers stay inside half the ranks (the placement paper's halved all-gather); it is gathered
once per scoring pass.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_placement.runtime import ChannelError, RoleCall, RoleHandle, run_concurrently

from ..ppo_phases import Experience, PPOPhases
from .executor import PlacementContext, PlacementError, PPOExecutor, register_executor, to_device

__all__ = ["InterleavedExecutor"]


@register_executor("interleaved")
class InterleavedExecutor(PPOExecutor):
    """Actor and critic on all ranks; ref and reward only on their owners, run concurrently."""

    def __init__(self, phases: PPOPhases, context: PlacementContext):
        super().__init__(phases, context)
        data = list(range(self.plan.world_size))
        wire = context.role_groups.wire_group if context.role_groups is not None else None
        self.ref_handle = RoleHandle(self.plan, "ref", data_ranks=data, timeout_s=self.timeout_s,
                                     timeline=self.timeline, group=wire)
        self.reward_handle = RoleHandle(self.plan, "reward", data_ranks=data, timeout_s=self.timeout_s,
                                        timeline=self.timeline, group=wire)

    def _ref(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.phases.ref_logprobs(batch["query_responses"], batch["context_length"])

    def _reward(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.phases.reward_scores(batch["queries"], batch["responses"])

    def frozen_forwards(self, ref_batch: dict[str, Any], reward_batch: dict[str, Any]) -> tuple[Any, Any]:
        """Reference log-probs and reward scores of this rank's batch, from their owners (concurrently)."""
        try:
            # One gather of each sharded frozen model on its owners for all the shards they serve.
            with self.context.sharding.gathered("ref", "reward"):
                out = run_concurrently([RoleCall(self.ref_handle, self._ref, ref_batch),
                                        RoleCall(self.reward_handle, self._reward, reward_batch)])
            return tuple(to_device(out, self.phases.device))
        except ChannelError as exc:
            raise PlacementError(f"rank {self.rank}: interleaved ref/reward dispatch failed with peer rank "
                                 f"{exc.peer} (owner or partner of channel '{exc.channel}'): {exc}") from exc

    def completion_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Reward scores of eval completions: only the reward owners hold the reward model."""
        with self.context.sharding.gathered("reward"):
            return self.reward_handle.call(self._reward, {"queries": queries, "responses": responses})

    def iteration(self, update: int) -> tuple[Experience, dict[str, torch.Tensor]]:
        phases = self.phases
        queries, seeds = phases.shard_batch(update, phases.dist.rank)
        with self.timeline.phase("generation"):
            rollout = phases.rollout(queries, seeds)
        start = time.time()
        scored = phases.policy_side_scores(rollout)
        scored["ref_logprobs"], scored["scores"] = self.frozen_forwards(
            {"query_responses": rollout.query_responses, "context_length": rollout.context_length},
            {"queries": rollout.queries, "responses": scored["responses"]})
        exp = phases.experience_from_scores(rollout, scored)
        self.timeline.record("experience", start, time.time())
        return exp, self.train(exp, update)
