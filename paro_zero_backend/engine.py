"""`ParoEngine`: PaRO-DP training for any of the 14 strategies, in plain ``torch.distributed``.

Procedure (paper §3.1, notes ``paro.md`` §4.1), per bucket of parameters:

every micro-step
  1. forward: p=I/G buckets are all-gathered (AG_I / AG_G) by a forward pre-hook on their unit and released by
     the post-hook;
  2. backward: a hook on the unit's output gradients gathers them again; a hook on the unit's input gradients
     (fired once the whole unit's backward ran) releases them;
  3. gradients: each parameter's gradient is moved into the bucket (``post_accumulate_grad`` hook); when a bucket
     is complete it is added locally (g=N) or reduce-scattered inside the group (g=I: RS_I) or globally
     (g=G: RS_G) and added to the g-level accumulator;

at the accumulation boundary (a backward outside `no_sync`)
  4. sync_g turns the accumulator into this rank's os-shard gradient (AR_G, RS_I+AR_E, RS_G, AR_E, RS_E or
     nothing, by the (g, os) pair), summed over ranks and then divided by ``n``: the caller already divides the loss
     by the number of micro-steps, so the engine averages over ranks only;

in `step()`
  5. the user's optimizer, rebuilt over this rank's os-shard pieces of each parameter (so param groups, weight
     decay exclusions and per-element optimizers behave exactly as on one process), updates the fp32 master copy;
  6. sync_p rebuilds the p-level working copy from the updated shards (AG_I, AG_G, AG_E or a local copy).

Tensor-name legend: ``*_store`` p-level slice (compute dtype), ``g_acc`` g-level accumulator (reduce dtype),
``master`` os-level fp32 slice, ``full`` gathered working buffer; all flat, padded to a multiple of ``n``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_placement import build_topology

from ._buckets import Bucket, ParamSlot, build_buckets, build_units, level_range
from .collectives import CommCounter, _all_gather_single, _Comm
from .config import ParoConfig
from .strategies import Level, Strategy, parse_strategy

__all__ = ["ParoEngine"]

logger = logging.getLogger(__name__)

OptimizerLike = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested outputs (tuples, lists, dicts, HF ``ModelOutput``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class ParoEngine(nn.Module):
    """Wrap a model and its optimizer for PaRO-DP training.

    Args:
        model (`nn.Module`): the model, identical on every rank (rank 0's values are broadcast at start).
        optimizer (`torch.optim.Optimizer` or callable):
            an optimizer built over ``model.parameters()`` (its class, defaults and param groups are rebuilt over the
            os shards), or a factory ``fn(param_groups) -> Optimizer`` called with one group of shard pieces.
            Any optimizer that updates each element from that element's gradient and state (SGD, Adam, AdamW, ...)
            gives the same result as on one process.
        config (`ParoConfig`, *optional*): strategy and settings; defaults to ``ParoConfig()`` (IIG).
        topology (`hf_placement.Topology`, *optional*): defaults to ``build_topology(group_size=m)``.

    Example:

    ```python
    engine = ParoEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ParoConfig(strategy="IIG"))
    for step_batches in loader:  # s micro-batches per optimizer step
        for k, batch in enumerate(step_batches):
            ctx = engine.no_sync() if k < len(step_batches) - 1 else contextlib.nullcontext()
            with ctx:
                engine.backward(engine(**batch).loss / len(step_batches))
        engine.step()
    ```
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerLike, config: ParoConfig | None = None,
                 topology=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ParoEngine needs torch.distributed: call dist.init_process_group (or launch with "
                               "torchrun / accelerate launch) before building the engine.")
        self.module = model
        self.config = config if config is not None else ParoConfig()
        n = dist.get_world_size()
        m = self.config.resolve_group_size(n)
        self.topology = topology if topology is not None else build_topology(group_size=m,
                                                                             timeout_s=self.config.timeout_s)
        if self.topology.world_size != n or self.topology.group_size != m:
            raise ValueError(f"topology has world_size={self.topology.world_size}, group_size="
                             f"{self.topology.group_size}, but the run has {n} ranks and config group_size={m}.")
        self.rank = dist.get_rank()
        self.world_size, self.group_size = n, m
        self.compute_dtype = self.config.compute_dtype
        self.grad_dtype = self.config.grad_dtype
        self.counter = CommCounter()
        self._comm = _Comm(self.topology, self.counter, hierarchical=self.config.paro_cc)
        units, owner = build_units(model, self.config.unit_module_classes)
        self._units = units
        self.buckets, self.slots = build_buckets(model, owner, len(units), self.config.bucket_size, n)
        self._unit_buckets: list[list[Bucket]] = [[b for b in self.buckets if b.unit == u] for u in range(len(units))]
        self._slot_by_param = {id(s.param): s for s in self.slots}
        self.guideline = None  # the GuidelineTable behind strategy="auto" (inputs include the bandwidths used)
        self.strategy: Strategy = self._resolve_strategy()
        self._empty = torch.empty(0, dtype=self.compute_dtype)
        self._init_storage()
        self.optimizer = self._rebuild_optimizer(optimizer)
        # Runtime state.
        self._sync = True
        self._callback_queued = False
        self._grads_ready = False
        self._micro_steps = 0
        self.global_step = 0
        self.loss_scale = float(self.config.initial_loss_scale) if self.compute_dtype == torch.float16 else 1.0
        self._good_steps = 0
        self.skipped_steps = 0
        self.last_step_bytes: dict[str, int] = {}
        self.last_grad_norm: float | None = None
        self._handles: list[Any] = []
        self._install_hooks()
        logger.info("PaRO engine: strategy %s, n=%d, m=%d, %d buckets, paro_cc=%s, %s", self.strategy, n, m,
                    len(self.buckets), self.config.paro_cc, self.compute_dtype)

    # ------------------------------------------------------------------------------------------------- set-up
    def _resolve_strategy(self) -> Strategy:
        if self.config.strategy != "auto":
            return parse_strategy(self.config.strategy)
        from .cost_model import GuidelineInputs, advise

        cfg = self.config
        intra, inter = cfg.bandwidth_intra_gbps, cfg.bandwidth_inter_gbps
        if intra is None or inter is None:
            m_intra, m_inter = self._measure_bandwidths()
            intra = intra if intra is not None else m_intra
            inter = inter if inter is not None else m_inter
        psi = sum(s.numel for s in self.slots)
        psi_t = sum(s.numel for s in self.slots if s.trainable)
        table = advise(GuidelineInputs(
            num_params=psi, trainable_params=psi_t, world_size=self.world_size, group_size=self.group_size,
            bandwidth_intra_gbps=intra, bandwidth_inter_gbps=inter, accumulation_steps=cfg.gradient_accumulation_steps,
            device_memory_gb=cfg.device_memory_gb, working_memory_gb=cfg.working_memory_gb,
            compute_time_s=cfg.compute_time_s, bytes_param=torch.empty(0, dtype=self.compute_dtype).element_size(),
            bytes_grad=torch.empty(0, dtype=self.grad_dtype).element_size()))
        if table.recommended is None:
            raise ValueError("strategy='auto': no PaRO strategy fits in device_memory_gb="
                             f"{cfg.device_memory_gb} for this model; raise the memory, lower working_memory_gb, "
                             "freeze parameters or add ranks.\n" + table.format())
        self.guideline = table
        logger.info("strategy='auto' picked %s\n%s", table.recommended, table.format())
        return parse_strategy(table.recommended)

    def _measure_bandwidths(self) -> tuple[float, float]:
        """Time an all-gather over the intra and the inter group (rank 0's figures, broadcast to all ranks)."""
        x = torch.ones(1 << 20, dtype=torch.float32)
        out = []
        for group, k in ((self.topology.intra_group, self.group_size),
                         (self.topology.inter_group, self.topology.num_groups)):
            if k == 1:
                out.append(1e6)
                continue
            buf = torch.empty(x.numel() * k)
            _all_gather_single(buf, x, group=group)  # warm-up
            t0 = time.perf_counter()
            for _ in range(3):
                _all_gather_single(buf, x, group=group)
            dt = (time.perf_counter() - t0) / 3
            out.append((k - 1) * x.numel() * 4 * 8 / dt / 1e9)
        t = torch.tensor(out, dtype=torch.float64)
        dist.broadcast(t, src=0)
        return float(t[0]), float(t[1])

    def _range(self, level: Level, b: Bucket) -> tuple[int, int]:
        return level_range(level, b.size, self.world_size, self.group_size, self.rank)

    def _init_storage(self) -> None:
        st = self.strategy
        for b in self.buckets:
            full = torch.zeros(b.size, dtype=torch.float32)
            for s in b.slots:
                full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            dist.broadcast(full, src=0)  # identical start on every rank (not counted: set-up, not a training step)
            lo, hi = self._range(st.p, b)
            b.p_store = full[lo:hi].to(self.compute_dtype, copy=True)
            if b.trainable:
                lo, hi = self._range(st.os, b)
                b.master = full[lo:hi].clone()
                glo, ghi = self._range(st.g, b)
                b.g_acc = torch.zeros(ghi - glo, dtype=self.grad_dtype)
                for s in b.slots:
                    a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
                    if a < z:
                        b.pieces.append((s, a, z, b.master[a - lo:z - lo]))
            if st.p == Level.N:
                b.full = b.p_store
                self._point_params(b)
            else:
                self._release(b)

    def _rebuild_optimizer(self, optimizer: OptimizerLike) -> torch.optim.Optimizer:
        piece_of = {id(s.param): piece for b in self.buckets for (s, _, _, piece) in b.pieces}
        if isinstance(optimizer, torch.optim.Optimizer):
            if optimizer.state:
                raise ValueError("the optimizer already has state; build the engine before the first step, and "
                                 "resume with engine.load_sharded()/load_consolidated() instead.")
            groups = []
            for group in optimizer.param_groups:
                params = []
                for p in group["params"]:
                    slot = self._slot_by_param.get(id(p))
                    if slot is None:
                        raise ValueError("the optimizer holds a tensor that is not a parameter of the model; build "
                                         "it over model.parameters().")
                    if slot.trainable and id(p) in piece_of:
                        params.append(piece_of[id(p)])
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            try:
                return type(optimizer)(groups, **defaults)
            except TypeError as exc:
                raise TypeError(f"could not rebuild {type(optimizer).__name__} over the optimizer-state shards "
                                f"({exc}). Pass a factory instead: ParoEngine(model, lambda groups: "
                                "MyOptimizer(groups, ...)).") from exc
        if callable(optimizer):
            return optimizer([{"params": [piece for b in self.buckets for (_, _, _, piece) in b.pieces]}])
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, got {type(optimizer).__name__}.")

    # ------------------------------------------------------------------------------------------ gather/release
    def _point_params(self, b: Bucket) -> None:
        for s in b.slots:
            s.param.data = b.full[s.offset:s.offset + s.numel].view(s.shape)

    def _gather(self, b: Bucket) -> None:
        if b.full is not None:
            return
        b.full = self._comm.ag_intra(b.p_store) if self.strategy.p == Level.I else self._comm.ag_global(b.p_store)
        self._point_params(b)

    def _release(self, b: Bucket) -> None:
        b.full = None
        for s in b.slots:
            s.param.data = self._empty

    def _gather_unit(self, u: int) -> None:
        for b in self._unit_buckets[u]:
            self._gather(b)

    def _release_unit(self, u: int) -> None:
        for b in self._unit_buckets[u]:
            self._release(b)

    def _install_hooks(self) -> None:
        for s in self.slots:
            if s.trainable:
                self._handles.append(s.param.register_post_accumulate_grad_hook(self._on_grad))
        if self.strategy.p == Level.N:
            return
        for u, module in enumerate(self._units):
            if not self._unit_buckets[u]:
                continue
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(u), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._make_post_forward(u)))

    def _make_pre_forward(self, u: int):
        def hook(module, args, kwargs):
            self._gather_unit(u)
            if u != 0 and torch.is_grad_enabled():
                inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                remaining = [len(inputs)]

                def on_input_grad(grad):
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        self._release_unit(u)  # the unit's whole backward has run
                    return None

                for t in inputs:
                    t.register_hook(on_input_grad)
            return None

        return hook

    def _make_post_forward(self, u: int):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                def on_output_grad(grad):
                    self._ensure_callback()
                    self._gather_unit(u)
                    return None

                for t in _tensors(output):
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(on_output_grad)
            self._release_unit(u)
            return None

        return hook

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
        if self.strategy.g == Level.N:
            b.g_acc[slot.offset:slot.offset + slot.numel].add_(flat)
        else:
            if b.g_tmp is None:
                b.g_tmp = torch.zeros(b.size, dtype=self.grad_dtype)
            b.g_tmp[slot.offset:slot.offset + slot.numel].copy_(flat)
        b.arrived += 1
        if b.arrived == b.num_trainable:
            self._reduce_bucket(b)

    def _reduce_bucket(self, b: Bucket) -> None:
        """Per micro-step gradient reduction of one complete bucket (nothing for g=N)."""
        if b.reduced:
            return
        b.reduced = True
        if self.strategy.g == Level.N:
            return
        tmp = b.g_tmp if b.g_tmp is not None else torch.zeros(b.size, dtype=self.grad_dtype)
        part = self._comm.rs_intra(tmp) if self.strategy.g == Level.I else self._comm.rs_global(tmp)
        b.g_acc.add_(part)
        b.g_tmp = None

    def _post_backward(self) -> None:
        """End of one backward pass (queued on the autograd engine): flush, release, and sync at the boundary."""
        self._callback_queued = False
        for b in self.buckets:
            if b.trainable:
                self._reduce_bucket(b)  # buckets with unused parameters, in the same order on every rank
                b.arrived, b.reduced = 0, False
        if self.strategy.p != Level.N:
            for b in self.buckets:
                self._release(b)
        self._micro_steps += 1
        if self._sync:
            self._sync_gradients()

    def _sync_gradients(self) -> None:
        """sync_g: accumulated gradients -> this rank's os-shard gradient (sum over ranks, then / n)."""
        g, os_ = self.strategy.g, self.strategy.os
        c = self._comm
        for b in self.buckets:
            if not b.trainable:
                continue
            acc = b.g_acc
            if g == Level.N and os_ == Level.N:
                x = c.ar_global(acc)
            elif g == Level.N and os_ == Level.I:
                x = c.ar_inter(c.rs_intra(acc))
            elif g == Level.N:
                x = c.rs_global(acc)
            elif g == Level.I:
                x = c.ar_inter(acc) if os_ == Level.I else c.rs_inter(acc)
            else:
                x = acc
            b.master_grad = x.to(torch.float32, copy=True).div_(self.world_size * self.loss_scale)
            acc.zero_()
            lo, _ = self._range(os_, b)
            for _, a, z, piece in b.pieces:
                piece.grad = b.master_grad[a - lo:z - lo]
        self._grads_ready = True

    # ------------------------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

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

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, multiplied by the dynamic loss scale under fp16."""
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def _os_norm_group(self):
        return {Level.N: None, Level.I: self.topology.intra_group, Level.G: self.topology.world_group}[self.strategy.os]

    def _check_grads_ready(self, what: str) -> None:
        if not self._grads_ready:
            raise RuntimeError(f"{what} needs synchronized gradients: run the last micro-step's backward outside "
                               "engine.no_sync() (the accumulation boundary) first.")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm (over all ranks' os shards, one scalar all-reduce) and return it."""
        self._check_grads_ready("clip_grad_norm_")
        if float(norm_type) != 2.0:
            raise NotImplementedError(f"norm_type={norm_type} is not supported; PaRO clips the 2-norm.")
        sq = torch.zeros(1, dtype=torch.float64)
        for b in self.buckets:
            if b.trainable:
                sq += b.master_grad.double().pow(2).sum()
        group = self._os_norm_group()
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
        flag = torch.zeros(1)
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

    def _sync_params(self) -> None:
        """sync_p: rebuild the p-level working copy from the updated fp32 os shards."""
        p, os_ = self.strategy.p, self.strategy.os
        c = self._comm
        train = [b for b in self.buckets if b.trainable]
        srcs = [b.master.to(self.compute_dtype) for b in train]
        if os_ == Level.N or p == os_:
            outs = srcs
        elif (p, os_) == (Level.N, Level.I):
            outs = [c.ag_intra(x) for x in srcs]
        elif (p, os_) == (Level.N, Level.G):
            outs = c.ag_global_coalesced(srcs)
        else:  # (I, G)
            outs = [c.ag_inter(x) for x in srcs]
        for b, x in zip(train, outs):
            b.p_store.copy_(x)

    # ------------------------------------------------------------------------------------------ observability
    def memory_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank, by kind (persistent buffers only; activations and the transient
        gathered/gradient buffers come on top)."""
        params = sum(b.p_store.numel() * b.p_store.element_size() for b in self.buckets)
        grads = sum(b.g_acc.numel() * b.g_acc.element_size() for b in self.buckets if b.trainable)
        master = sum(b.master.numel() * b.master.element_size() for b in self.buckets if b.trainable)
        optim = 0
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    optim += v.numel() * v.element_size()
        return {"params": params, "grads": grads, "master": master, "optimizer": optim,
                "total": params + grads + master + optim}

    def padded_numel(self) -> dict[str, int]:
        """Ψ and Ψ' as laid out (bucket padding included): the sizes the traffic formulas apply to exactly."""
        return {"all": sum(b.size for b in self.buckets),
                "trainable": sum(b.size for b in self.buckets if b.trainable)}

    # --------------------------------------------------------------------------------------------- full values
    @contextlib.contextmanager
    def _uncounted(self) -> Iterator[None]:
        saved = dict(self.counter.bytes), dict(self.counter.calls)
        try:
            yield
        finally:
            self.counter.bytes.update(saved[0])
            self.counter.calls.update(saved[1])

    def _gather_level(self, x: torch.Tensor, level: Level) -> torch.Tensor:
        if level == Level.N:
            return x
        return self._comm.ag_intra(x) if level == Level.I else self._comm.ag_global(x)

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Collective: every parameter holds its full working value inside the block (for inspection/eval)."""
        with self._uncounted():
            for b in self.buckets:
                self._gather(b)
        try:
            yield
        finally:
            if self.strategy.p != Level.N:
                for b in self.buckets:
                    self._release(b)

    def consolidated_state_dict(self, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """Collective: full weights by parameter name (trainable ones from the fp32 master copy) plus the model's
        persistent buffers. Tied parameters appear once, under their first name."""
        out: dict[str, torch.Tensor] = {}
        with self._uncounted():
            for b in self.buckets:
                if b.trainable:
                    full = self._gather_level(b.master, self.strategy.os)
                else:
                    full = self._gather_level(b.p_store, self.strategy.p)
                for s in b.slots:
                    t = full[s.offset:s.offset + s.numel].view(s.shape)
                    out[s.name] = t.to(dtype, copy=True) if dtype is not None else t.clone()
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
        """Collective: rank 0 writes ``model.safetensors`` (+ ``config.json`` for HF models, loadable with
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
