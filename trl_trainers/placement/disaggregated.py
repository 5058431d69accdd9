"""Disaggregated (FlexRLHF, arXiv 2312.11819): a training group and an inference group joined by a weight sync.

Training ranks hold actor + critic with the optimizer; inference ranks hold the shadow actor and shadow critic (plain
copies, overwritten by every sync), the reference and the reward model. Every iteration the trainer pushes
versioned weights to the shadows (`hf_placement.runtime.WeightSync`, bit-exact), the inference ranks generate and
score their shards and stream them to the trainers over `hf_placement.runtime.Channel`s (the trainer receives shard
``i`` while shard ``i + 1`` is generated), and the trainers train. Sharded roles: actor + critic over the training
ranks (gathered for the weight sync), ref and reward over the inference ranks (gathered once per iteration).

Shards: the global batch is cut into ``world_size`` co-located shards. Inference rank ``k`` (of ``I``) generates
and scores shards ``k, k + I, ...``; shard ``v`` trains on training rank ``v // (world_size / T)`` (of ``T``), so each
trainer's batch is the concatenation of the shards that co-located ranks ``[t * world/T, (t + 1) * world/T)`` hold.

Why generation does not overlap *training* at staleness 0: PPO whitens advantages over the whole batch and shuffles
the whole batch into mini-batches for several epochs, so the first optimizer step needs every sample, and the next
iteration's samples need the weights after the last step. What overlaps at staleness 0 is generation on several
inference ranks, the transfer of finished shards and the advantage computation. With ``max_staleness=1`` the batch
of iteration ``u + 1`` is generated with the weights the trainer held at the start of iteration ``u`` while the
trainer trains on batch ``u``; PPO's importance ratio against the sampler's log-probs corrects for the lag.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from hf_placement.runtime import Channel, ChannelError, WeightSync

from ..ppo_phases import Experience, PPOPhases, concat_shards
from .executor import PlacementContext, PlacementError, PPOExecutor, register_executor, to_device

__all__ = ["DisaggregatedExecutor"]


@register_executor("disaggregated")
class DisaggregatedExecutor(PPOExecutor):
    """Training group (actor, critic, optimizer) and inference group (shadow actor/critic, ref, reward)."""

    _instances = itertools.count()

    def __init__(self, phases: PPOPhases, context: PlacementContext, bucket_bytes: int = 100 * 2**20):
        super().__init__(phases, context)
        plan = self.plan
        self.train_ranks = sorted(plan.roles["actor"])
        self.infer_ranks = sorted(plan.roles["rollout"])
        self.world = plan.world_size
        self.per_trainer = self.world // len(self.train_ranks)
        self._produced_upto = 0
        src = self.train_ranks[0]
        models = phases.models
        holds = self.rank == src or self.is_inference
        kwargs: dict[str, Any] = {"strategy": context.weight_sync, "timeout_s": self.timeout_s,
                                  "timeline": self.timeline, "bucket_bytes": bucket_bytes}
        groups = context.role_groups
        self._wire = groups.wire_group
        p2p = {**kwargs, "group": self._wire}
        actor_kwargs = {**kwargs, "group": groups.sync_group("rollout")} if context.weight_sync == "broadcast" \
            else p2p
        critic_kwargs = {**kwargs, "group": groups.sync_group("value")} if context.weight_sync == "broadcast" \
            else p2p
        self.actor_sync = WeightSync(models.policy if holds else None, src, self.infer_ranks,
                                     param_filter="lora" if models.is_peft_model else "all", **actor_kwargs)
        self.critic_sync = WeightSync(models.value_model if holds else None, src, self.infer_ranks, **critic_kwargs)
        self._channels: dict[int, Channel] = {}
        # Channels are told apart by a tag hashed from their name: number the executors of this process (created in
        # the same order on every rank) so that two disaggregated trainers in one job never read each other's shards.
        self._instance = next(DisaggregatedExecutor._instances)

    @property
    def is_inference(self) -> bool:
        return self.rank in self.infer_ranks

    @property
    def serves_completions(self) -> bool:
        """Eval completions come from the shadow policy on the inference ranks; trainers return none."""
        return self.is_inference

    # ---------------------------------------------------------------- routing
    def generator_of(self, shard: int) -> int:
        return self.infer_ranks[shard % len(self.infer_ranks)]

    def trainer_of(self, shard: int) -> int:
        return self.train_ranks[shard // self.per_trainer]

    def _channel(self, peer: int) -> Channel:
        if peer not in self._channels:
            gen, trn = (self.rank, peer) if self.is_inference else (peer, self.rank)
            # up to two iterations of shards stay in flight (staleness 1 sends batch u + 1 before u is taken)
            self._channels[peer] = Channel(peer, f"ppo{self._instance}:experience:{gen}->{trn}", self.timeout_s,
                                           group=self._wire, max_in_flight=2 * self.world)
        return self._channels[peer]

    # ---------------------------------------------------------------- sync
    def _sync(self, version: int) -> None:
        try:
            # A sharded trainer gathers its full weights (collective over the training ranks) for the source to send.
            with self.context.sharding.gathered("actor", "critic"):
                self.actor_sync.sync(version)
                self.critic_sync.sync(version)
        except Exception as exc:
            raise PlacementError(f"rank {self.rank}: weight sync of version {version} from training rank "
                                 f"{self.train_ranks[0]} to inference ranks {self.infer_ranks} failed: {exc}") from exc

    # ---------------------------------------------------------------- inference side
    def _shard_message(self, update: int, shard: int) -> dict[str, Any]:
        phases = self.phases
        queries, seeds = phases.shard_batch(update, shard)
        with self.timeline.phase("generation"):
            rollout = phases.rollout(queries, seeds)
        with self.timeline.phase("experience"):
            scored = phases.score_rollout(rollout)
            part = phases.per_sample_rewards(scored)
        return {"shard": shard, "version": update, "context_length": rollout.context_length,
                "query_responses": rollout.query_responses, "raw_responses": rollout.responses, **part}

    def _produce(self, update: int, flush: bool = True) -> None:
        mine = [v for v in range(self.world) if self.generator_of(v) == self.rank]
        # One gather of each sharded frozen model for all the shards this rank scores.
        with self.context.sharding.gathered("ref", "reward"):
            for v in mine:
                msg = self._shard_message(update, v)
                with self.timeline.phase("send:experience") as info:
                    try:
                        info["bytes"] = self._channel(self.trainer_of(v)).send(msg, wait=False)
                    except ChannelError as exc:
                        raise PlacementError(f"inference rank {self.rank}: could not send experience shard {v} of "
                                             f"iteration {update} to training rank {exc.peer}: {exc}") from exc
        self._produced_upto = update
        if flush:
            self._flush(update)

    def _flush(self, update: int) -> None:
        with self.timeline.phase("wait:send"):
            for peer, ch in self._channels.items():
                try:
                    ch.flush()
                except ChannelError as exc:
                    raise PlacementError(f"inference rank {self.rank}: training rank {peer} did not take the "
                                         f"experience of iteration {update}: {exc}") from exc

    # ---------------------------------------------------------------- training side
    def _collect(self, update: int) -> list[dict[str, Any]]:
        mine = [v for v in range(self.world) if self.trainer_of(v) == self.rank]
        shards = []
        for v in mine:
            gen = self.generator_of(v)
            with self.timeline.phase("wait:experience") as info:
                ch = self._channel(gen)
                before = ch.bytes_received
                try:
                    msg = to_device(ch.recv(), self.phases.device)
                except ChannelError as exc:
                    raise PlacementError(
                        f"training rank {self.rank}: inference rank {gen} (shadow actor / ref / reward) did not "
                        f"deliver experience shard {v} of iteration {update} within {self.timeout_s:g} s; it died or "
                        f"stalled. ({exc})") from exc
                info["bytes"] = ch.bytes_received - before
            if msg["shard"] != v or msg["version"] != update:
                raise PlacementError(f"training rank {self.rank}: expected shard {v} of iteration {update} from "
                                     f"inference rank {gen}, got shard {msg['shard']} of iteration {msg['version']}; "
                                     "the two sides disagree on the schedule.")
            shards.append(msg)
        return shards

    def iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        phases = self.phases
        # The shadows receive the weights the trainer holds now (after update - 1 updates).
        self._sync(update)
        if self.is_inference:
            if self.context.max_staleness == 0:
                self._produce(update)
            else:  # batch update + 1 from these weights while the trainer trains on batch update
                for target in (update, update + 1):
                    if self._produced_upto < target <= self.context.num_total_batches:
                        self._produce(target, flush=False)
            return None, None
        shards = self._collect(update)
        with self.timeline.phase("experience"):
            part = concat_shards(shards, phases.pad_token_id)
            adv = phases.batch_advantages(part)
            exp = phases.experience(part["query_responses"], part["context_length"], part["raw_responses"], adv)
        return exp, self.train(exp, update)

    def finish(self, update: int) -> None:
        """Push the final weights so the shadows equal the trained models when training ends."""
        if self.is_inference:
            self._flush(update)
        self._sync(update)
