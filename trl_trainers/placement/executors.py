"""The three PPO executors of FlexRLHF (arXiv 2312.11819, `rlhf_placement.md` §1.3-1.5): one iteration each.

An executor schedules the stages of `PPOTrainer` (generation, experience, training) on the ranks a `PlacementPlan`
gives each role, and records a per-rank `Timeline` (``generation``, ``experience``, ``training``, ``sync`` and
``wait:*`` phases). With staleness 0 all three compute the same update (the equivalence contract, §4.3):

- sampling noise is keyed by the sample's global position (`PPOTrainer._sample_seed`), never by the rank;
- the global batch is cut into the same ``world_size`` shards of ``per_device_train_batch_size *
  gradient_accumulation_steps`` prompts, each generated and scored with the same padding and chunking as on a
  co-located rank, so rollouts and frozen forwards are bit-identical;
- whitening statistics are sums over the whole global batch (one all-reduce over the training group);
- the update is split-invariant when ``loss_normalization="mini_batch"`` (see `equivalence_issues`).

`ColocatedExecutor`: every rank runs every stage on its shard (TRL). `InterleavedExecutor`: the same, except that the
reference and reward forwards run only on their owner ranks (by default ref on the first half, reward on the second),
concurrently, via `hf_placement.run_concurrently`. `DisaggregatedExecutor`: training ranks hold actor + critic with
the optimizer; inference ranks hold the shadow actor, shadow critic, reference and reward model. Every iteration the
trainer pushes versioned weights to the shadows (`hf_placement.WeightSync`, bit-exact), the inference ranks generate
and score their shards and stream them to the trainers over `hf_placement.Channel`s (the trainer receives shard
``i`` while shard ``i + 1`` is generated), and the trainers train.

Why generation does not overlap *training* at staleness 0: TRL's PPO whitens advantages over the whole batch and
shuffles the whole batch into mini-batches for several epochs, so the first optimizer step needs every sample, and
the next iteration's samples need the weights after the last step. What overlaps at staleness 0 is generation on
several inference ranks, the transfer of finished shards, and the advantage computation. ``max_staleness=1`` (the
one-step-off-policy mode) is where generation overlaps training: the batch of iteration ``u + 1`` is generated with
the weights the trainer held at the start of iteration ``u`` (after ``u - 1`` updates) while the trainer trains on
batch ``u``; PPO's importance ratio against the sampler's log-probs corrects for the one-step lag.
"""

from __future__ import annotations

import itertools
import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers.utils import logging

from hf_placement import (
    Channel,
    ChannelError,
    PlacementPlan,
    RoleCall,
    RoleHandle,
    ShardedModule,
    Timeline,
    WeightSync,
)
from hf_placement import run_concurrently as _run_concurrently

from ..ppo_trainer import Experience
from ._experience import (
    concat_shards,
    experience_from,
    local_scores,
    ref_logprobs_fn,
    reward_scores_fn,
)

if TYPE_CHECKING:
    from ..ppo_trainer import PPOTrainer

__all__ = ["ColocatedExecutor", "DisaggregatedExecutor", "InterleavedExecutor", "PlacementError", "make_executor"]

logger = logging.get_logger(__name__)


def _to_device(tree: Any, device: torch.device) -> Any:
    """Channels deliver tensors on their transfer device (CPU on gloo); move a received tree to the model's device."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


class PlacementError(RuntimeError):
    """A placed PPO iteration failed because a peer rank (named in the message) died, stalled or misbehaved."""


class _Executor:
    strategy = "base"

    def __init__(self, trainer: PPOTrainer, plan: PlacementPlan, timeout_s: float):
        self.trainer, self.plan, self.timeout_s = trainer, plan, float(timeout_s)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeline = Timeline(self.rank)

    # Whether this rank trains (holds the optimizer and produces Experience).
    @property
    def is_trainer(self) -> bool:
        return self.rank in self.plan.roles["actor"]

    def iteration(self, update: int) -> tuple[Experience | None, dict[str, torch.Tensor] | None]:
        raise NotImplementedError

    def finish(self, update: int) -> None:
        """Called once after the last iteration (the disaggregated executor syncs the shadows a last time)."""

    def _train(self, exp: Experience, update: int) -> dict[str, torch.Tensor]:
        with self.timeline.phase("training"):
            return self.trainer.train_on_experience(exp, update)


class ColocatedExecutor(_Executor):
    """Every role on every rank; each rank runs generation, experience and training on its shard (TRL's PPO).

    With ``plan.sharded_roles`` (``PlacementPlan.colocated(world, sharded=True)``: what All-colocated must do when the
    four models do not fit a device) those models are ZeRO-3-sharded over all ranks with `hf_placement.ShardedModule`:
    every forward all-gathers the weights (and every backward again), gradients are reduce-scattered into each rank's
    slice and the optimizer steps only the slices. Generation gathers the actor once for the whole rollout (TRL's
    ``ds3_gather_for_generation``). The update equals the unsharded one up to fp32 round-off.
    """

    strategy = "colocated"

    def __init__(self, trainer: PPOTrainer, plan: PlacementPlan, timeout_s: float):
        super().__init__(trainer, plan, timeout_s)
        self.units: dict[str, list[ShardedModule]] = {}
        if plan.sharded_roles and plan.world_size > 1:
            self._shard(trainer, list(plan.sharded_roles), timeout_s)

    def _shard(self, t: PPOTrainer, roles: list[str], timeout_s: float) -> None:
        if t.is_peft_model:
            raise ValueError("sharded roles with a PEFT (LoRA) policy are not supported: the adapter-disabled policy "
                             "serves as reference. Use an unsharded plan with LoRA.")
        if set(roles) & {"actor", "critic"} != {"actor", "critic"} and set(roles) & {"actor", "critic"}:
            raise ValueError(f"sharded_roles={roles}: actor and critic share one optimizer here, so shard both or "
                             "neither.")

        def seq_cls_units(model: torch.nn.Module, trainable: bool) -> list[ShardedModule]:
            # backbone and score head are called separately (score_head_outputs), so each is its own unit; a
            # rule-based model without parameters has nothing to shard
            parts = (getattr(model, model.base_model_prefix), model.score)
            return [ShardedModule(m, None, timeout_s, trainable=trainable) for m in parts
                    if next(m.parameters(), None) is not None]

        for role in roles:  # same order on every rank: the plan's role order
            if role == "actor":
                self.units[role] = [ShardedModule(t.model.policy, None, timeout_s, trainable=True)]
            elif role == "critic":
                self.units[role] = seq_cls_units(t.model.value_model, True)
            elif role == "ref" and t.ref_model is not None:
                self.units[role] = [ShardedModule(t.ref_model, None, timeout_s)]
            elif role == "reward":
                self.units[role] = seq_cls_units(t.reward_model, False)
        trained = [u for role in ("actor", "critic") for u in self.units.get(role, [])]
        if trained:
            # The optimizer now owns this rank's slices only (same hyper-parameters, fresh schedule).
            from transformers import get_scheduler

            args = t.args
            if t._user_optimizer:
                raise ValueError("a custom optimizer cannot be combined with sharded roles (it holds the full "
                                 "parameters); let PPOTrainer build AdamW, which then steps each rank's slice.")
            t.optimizer = torch.optim.AdamW([u.shard for u in trained], lr=args.learning_rate,
                                            betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                            weight_decay=args.weight_decay)
            t.lr_scheduler = get_scheduler(
                args.lr_scheduler_type, t.optimizer, num_warmup_steps=args.get_warmup_steps(args.num_total_batches),
                num_training_steps=args.num_total_batches, scheduler_specific_kwargs=args.lr_scheduler_kwargs or None)
            t.callback_handler.optimizer, t.callback_handler.lr_scheduler = t.optimizer, t.lr_scheduler
            t.trainable_params = [u.shard for u in trained]

            def reduce() -> None:
                with self.timeline.phase("reduce_scatter"):
                    for u in trained:
                        u.reduce_gradients()

            t.gradient_reducer = reduce

    @property
    def sharded_units(self) -> list[ShardedModule]:
        return [u for units in self.units.values() for u in units]

    def bytes_gathered(self) -> int:
        """Parameter all-gather traffic received by this rank so far (0 when nothing is sharded)."""
        return sum(u.bytes_gathered for u in self.sharded_units)

    @contextmanager
    def full_weights(self):
        """Every sharded model holds its full weights inside the block (collective)."""
        with ExitStack() as stack:
            for u in self.sharded_units:
                stack.enter_context(u.gathered())
            yield

    def iteration(self, update: int) -> tuple[Experience, dict[str, torch.Tensor]]:
        t = self.trainer
        queries, seeds = t.local_batch(update)
        actor = self.units.get("actor", [])
        with self.timeline.phase("generation"), ExitStack() as stack:
            for u in actor:  # one gather for the whole generation, not one per decode step
                stack.enter_context(u.gathered())
            rollout = t.rollout(queries, seeds)
        with self.timeline.phase("experience"):
            exp = t.make_experience(rollout)
        return exp, self._train(exp, update)


class InterleavedExecutor(_Executor):
    """Actor and critic data parallel on all ranks; ref and reward only on their owners, run concurrently.

    Non-owners send ``(query_responses, context)`` / ``(queries, responses)`` to their owner and get log-probs /
    scores back; owners run one forward per partner shard (``concat=False``), so results are bit-identical to a
    co-located run.
    """

    strategy = "interleaved"

    def __init__(self, trainer: PPOTrainer, plan: PlacementPlan, timeout_s: float):
        super().__init__(trainer, plan, timeout_s)
        data = list(range(plan.world_size))
        self.ref_handle = RoleHandle(plan, "ref", data_ranks=data, timeout_s=timeout_s, timeline=self.timeline)
        self.reward_handle = RoleHandle(plan, "reward", data_ranks=data, timeout_s=timeout_s,
                                        timeline=self.timeline)
        self._ref_fn, self._reward_fn = ref_logprobs_fn(trainer), reward_scores_fn(trainer)

    def frozen_forwards(self, ref_batch: dict[str, Any], reward_batch: dict[str, Any]) -> tuple[Any, Any]:
        """Reference log-probs and reward scores of this rank's batch, from their owners (concurrently)."""
        try:
            out = _run_concurrently([RoleCall(self.ref_handle, self._ref_fn, ref_batch),
                                     RoleCall(self.reward_handle, self._reward_fn, reward_batch)])
            return tuple(_to_device(out, self.trainer.device))
        except ChannelError as exc:
            raise PlacementError(f"rank {self.rank}: interleaved ref/reward dispatch failed with peer rank "
                                 f"{exc.peer} (owner or partner of channel '{exc.channel}'): {exc}") from exc

    def completion_scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Reward scores of eval completions: only the reward owners hold the reward model."""
        return self.reward_handle.call(self._reward_fn, {"queries": queries, "responses": responses})

    def iteration(self, update: int) -> tuple[Experience, dict[str, torch.Tensor]]:
        t = self.trainer
        queries, seeds = t.local_batch(update)
        with self.timeline.phase("generation"):
            rollout = t.rollout(queries, seeds)
        start = time.time()
        scored = local_scores(t, rollout)
        ctx = rollout.context_length
        ref_logprobs, scores = self.frozen_forwards(
            {"query_responses": rollout.query_responses, "context_length": ctx},
            {"queries": rollout.queries, "responses": scored["responses"]})
        scored.update(ref_logprobs=ref_logprobs, scores=scores)
        adv = t.compute_advantages(scored)
        exp = experience_from(rollout.query_responses, ctx, rollout.responses, scored["sequence_lengths"],
                              {**adv, "responses": scored["responses"]})
        self.timeline.record("experience", start, time.time())
        return exp, self._train(exp, update)


class DisaggregatedExecutor(_Executor):
    """Training group (actor, critic, optimizer) and inference group (shadow actor/critic, ref, reward).

    Shards: the global batch is cut into ``world_size`` shards of the co-located local batch size. Inference rank
    ``k`` (of ``I``) generates and scores shards ``k, k + I, ...``; shard ``v`` trains on training rank
    ``v // (world_size / T)`` (of ``T``), so each trainer's batch is the concatenation of the shards that co-located
    ranks ``[t * world/T, (t + 1) * world/T)`` would hold.
    """

    strategy = "disaggregated"
    _instances = itertools.count()

    def __init__(self, trainer: PPOTrainer, plan: PlacementPlan, timeout_s: float, role_groups: Any,
                 weight_sync: str = "broadcast", bucket_bytes: int = 100 * 2**20, max_staleness: int = 0):
        super().__init__(trainer, plan, timeout_s)
        if max_staleness not in (0, 1):
            raise ValueError(f"max_staleness={max_staleness!r}: use 0 (synchronous PPO) or 1 (one-step off-policy).")
        self.max_staleness = int(max_staleness)
        self._produced_upto = 0
        self.train_ranks = sorted(plan.roles["actor"])
        self.infer_ranks = sorted(plan.roles["rollout"])
        self.world = plan.world_size
        self.per_trainer = self.world // len(self.train_ranks)
        self.shard_size = trainer.shard_size
        is_peft = trainer.is_peft_model
        src = self.train_ranks[0]
        policy = trainer.model.policy if (self.rank == src or self.is_inference) else None
        value = trainer.model.value_model if (self.rank == src or self.is_inference) else None
        kwargs: dict[str, Any] = {"strategy": weight_sync, "timeout_s": timeout_s, "timeline": self.timeline,
                                  "bucket_bytes": bucket_bytes}
        if weight_sync == "broadcast":
            kwargs_actor = {**kwargs, "group": role_groups.sync_group("rollout")}
            kwargs_critic = {**kwargs, "group": role_groups.sync_group("value")}
        else:
            kwargs_actor = kwargs_critic = kwargs
        self.actor_sync = WeightSync(policy, src, self.infer_ranks, param_filter="lora" if is_peft else "all",
                                     **kwargs_actor)
        self.critic_sync = WeightSync(value, src, self.infer_ranks, **kwargs_critic)
        self._channels: dict[int, Channel] = {}
        # Channels are told apart by a tag hashed from their name: number the executors of this process (created in
        # the same order on every rank) so that two disaggregated trainers in one job never read each other's shards.
        self._instance = next(DisaggregatedExecutor._instances)
        self._ref_fn, self._reward_fn = ref_logprobs_fn(trainer), reward_scores_fn(trainer)

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
                                           max_in_flight=2 * self.world)
        return self._channels[peer]

    # ---------------------------------------------------------------- sync
    def _sync(self, version: int) -> None:
        try:
            self.actor_sync.sync(version)
            self.critic_sync.sync(version)
        except Exception as exc:
            raise PlacementError(f"rank {self.rank}: weight sync of version {version} from training rank "
                                 f"{self.train_ranks[0]} to inference ranks {self.infer_ranks} failed: {exc}") from exc

    # ---------------------------------------------------------------- inference side
    def _shard_message(self, update: int, shard: int) -> dict[str, Any]:
        t = self.trainer
        size = self.shard_size
        rows = t.global_batch_indices(update)[shard * size : (shard + 1) * size]
        seeds = [t._sample_seed(update, shard * size + i) for i in range(size)]
        queries = t._collate([t.train_dataset[i] for i in rows])
        with self.timeline.phase("generation"):
            rollout = t.rollout(queries, seeds)
        with self.timeline.phase("experience"):
            scored = local_scores(t, rollout)
            ctx = rollout.context_length
            scored["ref_logprobs"] = self._ref_fn({"query_responses": rollout.query_responses, "context_length": ctx})
            scored["scores"] = self._reward_fn({"queries": rollout.queries, "responses": scored["responses"]})
            part = t.per_sample_rewards(scored)
        return {"shard": shard, "version": update, "context_length": ctx, "query_responses": rollout.query_responses,
                "raw_responses": rollout.responses, **part}

    def _produce(self, update: int, flush: bool = True) -> None:
        mine = [v for v in range(self.world) if self.generator_of(v) == self.rank]
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
                    msg = _to_device(ch.recv(), self.trainer.device)
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
        t = self.trainer
        # The shadows receive the weights the trainer holds now (after update - 1 updates).
        self._sync(update)
        if self.is_inference:
            if self.max_staleness == 0:
                self._produce(update)
            else:  # batch update + 1 from these weights while the trainer trains on batch update
                total = self.trainer.args.num_total_batches
                for target in (update, update + 1):
                    if self._produced_upto < target <= total:
                        self._produce(target, flush=False)
            return None, None
        shards = self._collect(update)
        with self.timeline.phase("experience"):
            part = concat_shards(shards, t.pad_token_id)
            adv = t.batch_advantages(part)
            exp = experience_from(part["query_responses"], part["context_length"], part["raw_responses"],
                                  part["sequence_lengths"], adv)
        return exp, self._train(exp, update)

    def finish(self, update: int) -> None:
        """Push the final weights so the shadows equal the trained models when training ends."""
        if self.is_inference:
            self._flush(update)
        self._sync(update)


def make_executor(trainer: PPOTrainer, plan: PlacementPlan, timeout_s: float, role_groups: Any = None,
                  weight_sync: str = "broadcast", max_staleness: int = 0) -> _Executor:
    """The executor for ``plan``: colocated when every role is on every rank, disaggregated when shadow roles exist,
    interleaved otherwise (ref/reward on owner subsets, actor/critic on all ranks)."""
    if plan.is_disaggregated:
        return DisaggregatedExecutor(trainer, plan, timeout_s, role_groups, weight_sync=weight_sync,
                                     max_staleness=max_staleness)
    if plan.sharded_roles and plan.world_size > 1 and not all(
            sorted(plan.roles[r]) == list(range(plan.world_size)) for r in ("actor", "critic", "ref", "reward")):
        raise ValueError(f"sharded_roles={plan.sharded_roles} in a {plan.strategy} plan: this PPO runs sharded models "
                         "only in the colocated executor (All-colocated under a memory cap); interleaved and "
                         "disaggregated plans keep their models whole. Drop sharded_roles or use "
                         "PlacementPlan.colocated(world, sharded=True).")
    if max_staleness:
        raise ValueError(f"max_staleness={max_staleness} needs a disaggregated plan (generation on other ranks than "
                         f"training); this {plan.strategy} plan generates and trains on the same ranks. Use 0.")
    everyone = list(range(plan.world_size))
    if all(sorted(plan.roles[r]) == everyone for r in ("actor", "critic", "ref", "reward")):
        return ColocatedExecutor(trainer, plan, timeout_s)
    return InterleavedExecutor(trainer, plan, timeout_s)
