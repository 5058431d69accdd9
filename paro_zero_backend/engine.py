"""`ParoEngine`: PaRO-DP training (and sharded inference) for any of the 14 strategies, in plain ``torch.distributed``.

Procedure (paper §3.1), per bucket of parameters; the collectives of each point come from the schedule table
(`hf_placement.partition.schedule`), which the cost model prices too:

every micro-step
  1. forward: a forward pre-hook on each unit gathers its buckets (t_param) and the post-hook releases them;
  2. backward: a hook on the unit's output gradients gathers them again; a hook on the unit's input gradients
     (fired once the whole unit's backward ran) releases them;
  3. gradients: each parameter's gradient is moved into the bucket (``post_accumulate_grad`` hook); when a bucket
     is complete it is reduced to the g level (t_gradient; summed locally for g=N) and added to the accumulator;

at the accumulation boundary (a backward outside `no_sync`)
  4. sync_g turns the accumulator into this rank's os-shard gradient (t_sync_g), summed over ranks and then divided
     by ``n``: the caller already divides the loss by the number of micro-steps, so the engine averages over ranks;

in `step()`
  5. the user's optimizer, rebuilt over this rank's os-shard pieces of each parameter (so param groups, weight
     decay exclusions and per-element optimizers behave exactly as on one process), updates the fp32 master slice;
  6. sync_p rebuilds the p-level working slice from the updated os slices (t_sync_p).

`gathered()` pins every parameter for a block (generation, weight sync, export): one gather at entry, none in the
hooks, release at exit. The engine runs on the ranks of its topology (the world, or a sub-group built with
``hf_placement.build_topology(ranks=...)``) and never touches the default process group.

Tensor-name legend: ``p_store`` p-level slice (compute dtype), ``g_acc`` g-level accumulator (reduce dtype),
``master`` os-level fp32 slice (a view into ``p_store`` when computing in fp32: the os slice lies inside the p slice),
``full`` gathered working buffer; all flat, padded to a multiple of ``n``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hf_placement import Topology, build_topology, check_collective_device, collective_device
from hf_placement.partition import Level, Strategy, parse_strategy
from hf_placement.partition.schedule import gather_to_full, schedule_for, shard_span, slice_range

from ._buckets import Bucket, ParamSlot, build_buckets, build_units
from ._hooks import install_unit_hooks
from ._optimizer import OptimizerLike, rebuild_optimizer
from .collectives import CommCounter, _Comm
from .config import ParoConfig

__all__ = ["LocalState", "ParoEngine", "ShardPiece"]

logger = logging.getLogger(__name__)


class ShardPiece(NamedTuple):
    """What this rank holds of one trainable parameter's optimizer-state shard: elements ``[start, stop)`` of the
    flattened parameter ``name``, as ``tensor`` (the tensor the optimizer updates, whose ``state`` it keys)."""

    name: str
    shape: torch.Size
    start: int
    stop: int
    tensor: torch.Tensor


class LocalState(NamedTuple):
    """This rank's own slices (``tensors``, by bucket) and step counters (``counters``: global step, loss scale,
    fp16 overflow bookkeeping): with the optimizer's state dict, everything a same-topology resume needs."""

    tensors: dict[str, torch.Tensor]
    counters: dict[str, float]


class ParoEngine(nn.Module):
    """Wrap a model and its optimizer for PaRO-DP training, or a frozen model for sharded inference.

    Args:
        model (`nn.Module`): the model, identical on every member rank (member 0's values are broadcast at start).
        optimizer (`torch.optim.Optimizer` or callable, *optional*):
            an optimizer built over ``model.parameters()`` (its class, defaults and param groups are rebuilt over the
            os shards), or a factory ``fn(param_groups) -> Optimizer`` called with one group of shard pieces.
            Any optimizer that updates each element from that element's gradient and state (SGD, Adam, AdamW, ...)
            gives the same result as on one process. ``None`` for a model without trainable parameters (a reference
            or reward model sharded for inference).
        config (`ParoConfig`, *optional*): a concrete strategy and settings; defaults to ``ParoConfig()`` (IIG).
            ``strategy="auto"`` is resolved before the engine, by `paro_zero_backend.resolve_strategy`.
        topology (`hf_placement.Topology`, *optional*): the ranks the engine runs on and their groups; defaults to
            ``build_topology(group_size=config.group_size)`` over the whole world. For a sub-group, build it on every
            rank (``build_topology(ranks=[...])`` is collective) and the engine on the member ranks only.
        extra_units (`Sequence[nn.Module]`, *optional*): modules gathered whole by their own forward pre-hook, for
            sub-modules the caller runs directly (a wrapper whose own forward never runs, such as a policy + value
            wrapper whose trainer calls ``wrapper.policy(...)`` and ``wrapper.value_model.score(...)``). Running a
            module whose parameters belong to a unit that has not gathered them raises an error naming the unit;
            parameters read without running their module (functional code) must be read inside `gathered()`.

    Example:

    ```python
    engine = ParoEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ParoConfig(strategy="IIG"))
    for step_batches in loader:  # s micro-batches per optimizer step
        for k, batch in enumerate(step_batches):
            ctx = engine.no_sync() if k < len(step_batches) - 1 else contextlib.nullcontext()
            with ctx:
                engine.backward(engine(**batch).loss / len(step_batches))
        engine.step()
    with engine.gathered():  # full weights for generation: one gather, not one per layer and token
        out = engine.module.generate(prompt_ids, max_new_tokens=32)
    ```
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike | None = None, config: ParoConfig | None = None,
                 topology: Topology | None = None, *, extra_units: Sequence[nn.Module] = ()):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ParoEngine needs torch.distributed: call dist.init_process_group (or launch with "
                               "torchrun / accelerate launch) before building the engine.")
        self.module = model
        self.config = config if config is not None else ParoConfig()
        if self.config.strategy == "auto":
            raise ValueError("ParoEngine needs a concrete strategy, got strategy='auto': resolve it first with "
                             "paro_zero_backend.resolve_strategy(config, model, topology).config (the integrations "
                             "ParoAccelerator and deepspeed_initialize do this for you).")
        self.topology = self._check_topology(topology)
        self.device = self._model_device(model)
        self.rank, self.world_size, self.group_size = (self.topology.rank, self.topology.world_size,
                                                       self.topology.group_size)
        self.strategy: Strategy = parse_strategy(self.config.strategy)
        self.schedule = schedule_for(self.strategy, self.config.reshard_after_forward)
        self.compute_dtype = self.config.compute_dtype
        self.grad_dtype = self.config.grad_dtype
        self.counter = CommCounter()
        self._comm = _Comm(self.topology, self.counter, hierarchical=self.config.paro_cc)
        units, owner = build_units(model, self.config.unit_module_classes, extra_units)
        self._units = units
        self.buckets, self.slots = build_buckets(model, owner, len(units), self.config.bucket_size, self.world_size)
        self._unit_buckets: list[list[Bucket]] = [[b for b in self.buckets if b.unit == u] for u in range(len(units))]
        self._slot_by_param = {id(s.param): s for s in self.slots}
        self._partitioned = bool(self.schedule.param.collectives)  # p != N: working parameters come and go
        # fp32 compute: the fp32 master slice is a view into the working slice, no second copy (see _init_storage)
        self._master_is_param = self.compute_dtype == torch.float32
        if optimizer is None and any(s.trainable for s in self.slots):
            raise ValueError("optimizer=None builds an inference-only engine, but the model has trainable parameters "
                             f"(e.g. {next(s.name for s in self.slots if s.trainable)!r}). Pass the optimizer, or "
                             "freeze the model first (model.requires_grad_(False)) to shard it for inference.")
        self._empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
        self._init_storage()
        self.optimizer: torch.optim.Optimizer | None = None if optimizer is None else rebuild_optimizer(
            optimizer, set(self._slot_by_param),
            {id(s.param): piece for b in self.buckets for (s, _, _, piece) in b.pieces},
            [piece for b in self.buckets for (_, _, _, piece) in b.pieces])
        # Runtime state.
        self._sync = True
        self._callback_queued = False
        self._grads_ready = False
        self._micro_steps = 0
        self.global_step = 0
        self.loss_scale = float(self.config.initial_loss_scale) if self.compute_dtype == torch.float16 else 1.0
        self._good_steps = 0
        self.skipped_steps = 0
        self.gathered_bytes = 0  # parameter all-gather bytes sent since the engine was built (training + pinning)
        self.last_step_bytes: dict[str, int] = {}
        self.last_step_terms: dict[str, int] = {}
        self.last_grad_norm: float | None = None
        self._handles: list[Any] = []
        self._install_hooks()
        logger.info("PaRO engine: strategy %s on ranks %s, n=%d, m=%d, %d buckets, paro_cc=%s, %s", self.strategy,
                    list(self.topology.ranks), self.world_size, self.group_size, len(self.buckets),
                    self.config.paro_cc, self.compute_dtype)

    # ------------------------------------------------------------------------------------------------- set-up
    def _check_topology(self, topology: Topology | None) -> Topology:
        if topology is None:
            m = self.config.resolve_group_size(dist.get_world_size())
            return build_topology(group_size=m, timeout_s=self.config.timeout_s)
        if not topology.is_member:
            raise ValueError(f"ParoEngine built on global rank {dist.get_rank()}, which is not one of the topology's "
                             f"ranks {list(topology.ranks)}: build the topology on every rank, and the engine only "
                             "where topology.is_member is True.")
        if self.config.group_size is not None and self.config.group_size != topology.group_size:
            raise ValueError(f"config group_size={self.config.group_size} but the topology has group_size="
                             f"{topology.group_size}; leave config.group_size unset to use the topology's.")
        return topology

    def _model_device(self, model: nn.Module) -> torch.device:
        """The one device of the model's parameters: every flat buffer, gathered copy and control scalar lives there,
        so the engine runs on gloo CPU ranks and on NCCL GPU ranks alike."""
        devices = {p.device for p in model.parameters()}
        if not devices:
            return collective_device(self.topology.world_group)
        if len(devices) > 1:
            raise ValueError(f"ParoEngine needs the whole model on one device, but its parameters are on "
                             f"{sorted(map(str, devices))}: move it first (model.to(device)); the engine shards it.")
        (device,) = devices
        if device.type == "meta":
            raise ValueError("the model's parameters are on the meta device (not materialised): build or load its "
                             "weights (e.g. model.to_empty(device=...) and initialise them) before the engine.")
        check_collective_device(device, self.topology.world_group, "the model")
        return device

    def _slice(self, level: Level, b: Bucket) -> tuple[int, int]:
        return slice_range(level, b.size, self.world_size, self.group_size, self.rank)

    def _init_storage(self) -> None:
        st = self.strategy
        src = self.topology.global_rank(0)
        for b in self.buckets:
            full = torch.zeros(b.size, dtype=torch.float32, device=self.device)
            for s in b.slots:
                full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            # identical start on every member (not counted: set-up, not a training step)
            dist.broadcast(full, src=src, group=self.topology.world_group)
            plo, phi = self._slice(st.p, b)
            b.p_store = full[plo:phi].to(self.compute_dtype, copy=True)
            if b.trainable:
                lo, hi = self._slice(st.os, b)
                assert plo <= lo and hi <= phi, "the os slice lies inside the p slice (os is at least as fine as p)"
                b.master = b.p_store[lo - plo:hi - plo] if self._master_is_param else full[lo:hi].clone()
                glo, ghi = self._slice(st.g, b)
                b.g_acc = torch.zeros(ghi - glo, dtype=self.grad_dtype, device=self.device)
                for s in b.slots:
                    a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if a < z:
                        b.pieces.append((s, a, z, b.master[a - lo:z - lo]))
        self._refresh_working_params()

    def _refresh_working_params(self) -> None:
        """After the p-level slices changed wholesale (set-up, loading): point the model's parameters at the working
        copy (p=N), or drop the gathered copies (p=I/G; gathered again at once while pinned)."""
        for b in self.buckets:
            if self._partitioned:
                b.full = None
                for s in b.slots:
                    s.param.data = self._empty
            else:
                b.full = b.p_store
                self._point_params(b)
        if self._partitioned:
            self._gather([b for b in self.buckets if b.pins])

    # ------------------------------------------------------------------------------------------ gather/release
    def _point_params(self, b: Bucket) -> None:
        for s in b.slots:
            s.param.data = b.full[s.offset:s.offset + s.numel].view(s.shape)

    def _gather(self, buckets: Sequence[Bucket]) -> None:
        """t_param: gather the buckets not already gathered (one schedule lookup, pipelined across buckets)."""
        todo = [b for b in buckets if b.full is None]
        if not todo:
            return
        before = self.counter.sent()
        with self.counter.term(self.schedule.param.term):
            fulls = self._comm.run_each(self.schedule.param.collectives, [b.p_store for b in todo])
        for b, full in zip(todo, fulls):
            b.full = full
            self._point_params(b)
        self.gathered_bytes += self.counter.sent() - before

    def _release(self, b: Bucket) -> None:
        if b.pins:
            return
        b.full = None
        for s in b.slots:
            s.param.data = self._empty

    def _install_hooks(self) -> None:
        for s in self.slots:
            if s.trainable:
                self._handles.append(s.param.register_post_accumulate_grad_hook(self._on_grad))
        if self._partitioned:
            self._handles.extend(install_unit_hooks(self))

    # -------------------------------------------------------------------------------------------- gradients
    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._post_backward)

    def _on_grad(self, param: torch.Tensor) -> None:
        self._ensure_callback()
        slot: ParamSlot = self._slot_by_param[id(param)]
        b = self.buckets[slot.bucket]
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        flat = grad.reshape(-1)
        if not self.schedule.gradient.collectives:  # no per-micro-step reduction: accumulate the full gradient
            b.g_acc[slot.offset:slot.offset + slot.numel].add_(flat)
        else:
            if b.g_tmp is None:
                b.g_tmp = torch.zeros(b.size, dtype=self.grad_dtype, device=self.device)
            b.g_tmp[slot.offset:slot.offset + slot.numel].copy_(flat)
        b.arrived += 1
        if b.arrived == b.num_trainable:
            self._reduce_bucket(b)

    def _reduce_bucket(self, b: Bucket) -> None:
        """t_gradient: per micro-step reduction of one complete bucket to the g level (nothing for g=N)."""
        if b.reduced:
            return
        b.reduced = True
        phase = self.schedule.gradient
        if not phase.collectives:
            return
        tmp = b.g_tmp if b.g_tmp is not None else torch.zeros(b.size, dtype=self.grad_dtype, device=self.device)
        with self.counter.term(phase.term):
            b.g_acc.add_(self._comm.run(phase.collectives, tmp))
        b.g_tmp = None

    def _post_backward(self) -> None:
        """End of one backward pass (queued on the autograd engine): flush, release, and sync at the boundary."""
        self._callback_queued = False
        for b in self.buckets:
            if b.trainable:
                self._reduce_bucket(b)  # buckets with unused parameters, in the same order on every rank
                b.arrived, b.reduced = 0, False
        if self._partitioned:
            for b in self.buckets:
                self._release(b)
        self._micro_steps += 1
        if self._sync:
            self._sync_gradients()

    def _sync_gradients(self) -> None:
        """t_sync_g: accumulated gradients -> this rank's os-shard gradient (sum over ranks, then / n)."""
        phase = self.schedule.sync_g
        for b in self.buckets:
            if not b.trainable:
                continue
            with self.counter.term(phase.term):
                x = self._comm.run(phase.collectives, b.g_acc)
            b.master_grad = x.to(torch.float32, copy=True).div_(self.world_size * self.loss_scale)
            b.g_acc.zero_()
            lo, _ = self._slice(self.strategy.os, b)
            for _, a, z, piece in b.pieces:
                piece.grad = b.master_grad[a - lo:z - lo]
        self._grads_ready = True

    def _sync_params(self) -> None:
        """t_sync_p: rebuild the p-level working slices from the updated fp32 os slices."""
        phase = self.schedule.sync_p
        train = [b for b in self.buckets if b.trainable]
        if not phase.collectives:
            if not self._master_is_param:  # p == os: a local cast; in fp32 the update already landed in place
                for b in train:
                    b.p_store.copy_(b.master)
        else:
            with self.counter.term(phase.term):
                outs = self._comm.run_each(phase.collectives, [b.master.to(self.compute_dtype) for b in train])
            for b, x in zip(train, outs):
                b.p_store.copy_(x)
        pinned = [b for b in train if b.pins]
        if pinned and self._partitioned:  # pinned working copies follow the update
            for b in pinned:
                b.full = None
            self._gather(pinned)

    # ------------------------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def gathered(self, *modules: nn.Module) -> Iterator[None]:
        """Collective over the engine's ranks: the parameters hold their full working values inside the block.

        One gather of every p-level bucket at entry (counted as t_param traffic and in ``gathered_bytes``), none in
        the forward/backward hooks while pinned, release at exit. Re-entrant (a bucket is gathered by the first block
        that holds it and released by the last). Use it for generation (TRL's ``ds3_gather_for_generation=True``: one
        gather per rollout instead of one per layer and decoding step), weight sync and inspection. A `step()` inside
        the block re-gathers the updated parameters.

        ``modules`` (optional): pin only the buckets holding parameters of these sub-modules, e.g. only the policy of
        a policy + value wrapper for generation; the others keep gathering per call. Every rank must pass the same
        sub-modules (the gather is collective).
        """
        if modules:
            params = {id(p) for m in modules for p in m.parameters()}
            held = [b for b in self.buckets if any(id(s.param) in params for s in b.slots)]
        else:
            held = list(self.buckets)
        for b in held:
            b.pins += 1
        try:
            self._gather(held)
            yield
        finally:
            for b in held:
                b.pins -= 1
            if self._partitioned:
                for b in held:
                    self._release(b)

    def summon_full_params(self) -> contextlib.AbstractContextManager[None]:
        """Same as `gathered()` (the FSDP name)."""
        return self.gathered()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps inside are not the accumulation boundary: gradients are still reduced per the strategy's g
        level every micro-step, only the boundary work (sync_g) is deferred. Same seam as DDP's ``no_sync``."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    @property
    def at_step_boundary(self) -> bool:
        """No micro-step has run since the last `step()` (a checkpoint can be written)."""
        return self._micro_steps == 0 and not self._grads_ready

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, multiplied by the dynamic loss scale under fp16."""
        self._check_trainable("backward()")
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def _check_trainable(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what} on an inference-only engine (built with optimizer=None for a frozen model); "
                               "build the engine with an optimizer over trainable parameters to train.")

    def _check_grads_ready(self, what: str) -> None:
        self._check_trainable(what)
        if not self._grads_ready:
            raise RuntimeError(f"{what} needs synchronized gradients: run the last micro-step's backward outside "
                               "engine.no_sync() (the accumulation boundary) first.")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (over all ranks' os shards, one scalar all-reduce) and return it."""
        self._check_grads_ready("clip_grad_norm_")
        if float(norm_type) != 2.0:
            raise NotImplementedError(f"norm_type={norm_type} is not supported; PaRO clips the 2-norm.")
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for b in self.buckets:
            if b.trainable:
                sq += b.master_grad.double().pow(2).sum()
        group = self._comm.group(shard_span(self.strategy.os))
        if group is not None:
            self._comm.control_all_reduce(sq, group)
        total = sq.sqrt().to(torch.float32)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for b in self.buckets:
            if b.trainable:
                b.master_grad.mul_(coef)
        self.last_grad_norm = float(total)
        return total[0]

    def _found_inf(self) -> bool:
        flag = torch.zeros(1, device=self.device)
        for b in self.buckets:
            if b.trainable and not torch.isfinite(b.master_grad).all():
                flag.fill_(1.0)
                break
        self._comm.control_all_reduce(flag, self.topology.world_group, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def step(self) -> bool:
        """Optimizer step on the os shards and parameter rebuild (sync_p). Returns False if fp16 overflow skipped it."""
        self._check_grads_ready("step()")
        applied = True
        if self.compute_dtype == torch.float16 and self._found_inf():
            applied = False
            self.skipped_steps += 1
            self.loss_scale = max(self.loss_scale / 2.0, self.config.min_loss_scale)
            self._good_steps = 0
            logger.info("fp16 overflow: step skipped, loss scale now %s", self.loss_scale)
        else:
            if self.config.max_grad_norm is not None:
                self.clip_grad_norm_(self.config.max_grad_norm)
            self.optimizer.step()
            self._sync_params()
            if self.compute_dtype == torch.float16:
                self._good_steps += 1
                if self._good_steps >= self.config.loss_scale_window:
                    self.loss_scale *= 2.0
                    self._good_steps = 0
        self._clear_grads()
        self.global_step += 1
        self._micro_steps = 0
        self.last_step_bytes = self.counter.snapshot()
        self.last_step_terms = dict(self.counter.terms)
        self.counter.reset()
        return applied

    def _clear_grads(self) -> None:
        for b in self.buckets:
            if b.trainable:
                b.master_grad = None
                for _, _, _, piece in b.pieces:
                    piece.grad = None
        self._grads_ready = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated and synchronized gradients (`step()` already does this after updating)."""
        for b in self.buckets:
            if b.trainable:
                b.g_acc.zero_()
                b.g_tmp = None
        self._clear_grads()

    # ------------------------------------------------------------------------------------------ observability
    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank, by kind, each storage counted once.

        ``params`` (p-level slices), ``grads`` (g-level accumulators), ``master`` (the fp32 os slices when they are
        a separate copy: 0 in fp32, where they are views into ``params``), ``optimizer`` (the optimizer's
        per-element state, priced per element of this rank's os slices, padding included) and their ``total``,
        which equals ``paro_zero_backend.memory_bytes(strategy, **padded_numel, n, m, **bytes_per_element(...))``
        once the optimizer has run a step. ``optimizer_allocated`` (not in ``total``) is what the optimizer actually
        holds: no state for padding, plus per-tensor scalars such as Adam's ``step``. Activations and the transient
        gathered/gradient buffers come on top.
        """
        train = [b for b in self.buckets if b.trainable]
        params = sum(b.p_store.numel() * b.p_store.element_size() for b in self.buckets)
        grads = sum(b.g_acc.numel() * b.g_acc.element_size() for b in train)
        master = 0 if self._master_is_param else sum(b.master.numel() * b.master.element_size() for b in train)
        per_element, allocated, covered = 0, 0, 0
        if self.optimizer is not None:
            for b in train:
                for _, _, _, piece in b.pieces:
                    state = self.optimizer.state.get(piece, {})
                    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
                    allocated += sum(v.numel() * v.element_size() for v in tensors)
                    elementwise = [v for v in tensors if v.dim() > 0 and v.numel() == piece.numel()]
                    if elementwise:
                        per_element += sum(v.numel() * v.element_size() for v in elementwise)
                        covered += piece.numel()
        optim = round(per_element / covered * sum(b.master.numel() for b in train)) if covered else 0
        return {"params": params, "grads": grads, "master": master, "optimizer": optim,
                "total": params + grads + master + optim, "optimizer_allocated": allocated}

    def padded_numel(self) -> dict[str, int]:
        """Ψ and Ψ' as laid out (bucket padding included): the sizes the traffic formulas apply to exactly."""
        return {"all": sum(b.size for b in self.buckets),
                "trainable": sum(b.size for b in self.buckets if b.trainable)}

    # ------------------------------------------------------------------------------- state for checkpoints
    @contextlib.contextmanager
    def _uncounted(self) -> Iterator[None]:
        saved = dict(self.counter.bytes), dict(self.counter.calls), dict(self.counter.terms)
        try:
            yield
        finally:
            self.counter.bytes.update(saved[0])
            self.counter.calls.update(saved[1])
            self.counter.terms.clear()
            self.counter.terms.update(saved[2])

    def shard_pieces(self) -> list[ShardPiece]:
        """This rank's pieces of the trainable parameters' optimizer-state shards, in layout order."""
        return [ShardPiece(s.name, s.shape, a - s.offset, z - s.offset, piece)
                for b in self.buckets for (s, a, z, piece) in b.pieces]

    def full_values(self, piece_values: Callable[[ShardPiece], torch.Tensor | None] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: ``(name, full tensor)`` per parameter (first name of tied ones), bucket by bucket.

        Without ``piece_values``: the full fp32 values (trainable parameters from the master copy). With it: for the
        trainable parameters only, the full tensor assembled from ``piece_values(piece)`` on every rank (e.g. an
        optimizer state; a None or missing piece reads as zeros). Checkpoint traffic, not counted as a step's.
        The yielded tensors are views into a per-bucket buffer: copy what you keep.
        """
        with self._uncounted():
            for b in self.buckets:
                if piece_values is not None and not b.trainable:
                    continue
                if piece_values is not None:
                    lo, _ = self._slice(self.strategy.os, b)
                    flat = torch.zeros(b.master.numel(), dtype=torch.float32, device=self.device)
                    for s, a, z, piece in b.pieces:
                        value = piece_values(ShardPiece(s.name, s.shape, a - s.offset, z - s.offset, piece))
                        if value is not None:
                            flat[a - lo:z - lo].copy_(value.reshape(-1))
                    full = self._comm.run(gather_to_full(self.strategy.os), flat)
                elif b.trainable:
                    full = self._comm.run(gather_to_full(self.strategy.os), b.master.float())
                else:
                    full = self._comm.run(gather_to_full(self.strategy.p), b.p_store.float())
                for s in b.slots:
                    yield s.name, full[s.offset:s.offset + s.numel].view(s.shape)

    def load_full_values(self, values: Mapping[str, torch.Tensor]) -> None:
        """Set every parameter from its full value (``values`` by parameter name, e.g. a consolidated checkpoint):
        this rank keeps its p and os slices. Local; every rank must load the same values."""
        for b in self.buckets:
            full = torch.zeros(b.size, dtype=torch.float32, device=self.device)
            for s in b.slots:
                full[s.offset:s.offset + s.numel].copy_(values[s.name].reshape(-1))
            lo, hi = self._slice(self.strategy.p, b)
            b.p_store.copy_(full[lo:hi])
            if b.trainable and not self._master_is_param:
                lo, hi = self._slice(self.strategy.os, b)
                b.master.copy_(full[lo:hi])
        self._refresh_working_params()

    def local_state(self) -> LocalState:
        """This rank's slices and counters (see `LocalState`); the tensors are the live buffers, not copies."""
        tensors: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            tensors[f"bucket{b.index}.param"] = b.p_store
            if b.trainable and not self._master_is_param:
                tensors[f"bucket{b.index}.master"] = b.master
        counters = {"global_step": self.global_step, "loss_scale": self.loss_scale, "good_steps": self._good_steps,
                    "skipped_steps": self.skipped_steps}
        return LocalState(tensors, counters)

    def load_local_state(self, state: LocalState) -> None:
        """Restore what `local_state` returned on the same rank of the same topology and strategy."""
        for b in self.buckets:
            b.p_store.copy_(state.tensors[f"bucket{b.index}.param"])
            key = f"bucket{b.index}.master"
            if b.trainable and key in state.tensors:  # absent in fp32, where the master slice is part of param
                b.master.copy_(state.tensors[key])
        c = state.counters
        self.global_step, self.loss_scale = int(c["global_step"]), float(c["loss_scale"])
        self._good_steps, self.skipped_steps = int(c["good_steps"]), int(c["skipped_steps"])
        self._refresh_working_params()

    def consolidated_state_dict(self, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """Collective: full weights by parameter name (trainable ones from the fp32 master copy) plus the model's
        persistent buffers. Tied parameters appear once, under their first name."""
        out = {name: t.to(dtype, copy=True) if dtype is not None else t.clone() for name, t in self.full_values()}
        params = {id(p) for p in self.module.parameters()}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in params and name not in out:
                out[name] = t.detach().clone()
        return out

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_sharded(self, directory: str) -> None:
        """Collective: per-rank shard files + metadata; `load_sharded` resumes bit-identically (same topology)."""
        from .checkpoint import save_sharded

        save_sharded(self, directory)

    def load_sharded(self, directory: str) -> None:
        from .checkpoint import load_sharded

        load_sharded(self, directory)

    def save_consolidated(self, directory: str, include_optimizer: bool = True) -> None:
        """Collective: member 0 writes ``model.safetensors`` (+ ``config.json`` for HF models, loadable with
        ``from_pretrained``) and, optionally, the full optimizer state, loadable into any strategy/world size."""
        from .checkpoint import save_consolidated

        save_consolidated(self, directory, include_optimizer=include_optimizer)

    def load_consolidated(self, directory: str) -> None:
        from .checkpoint import load_consolidated

        load_consolidated(self, directory)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
