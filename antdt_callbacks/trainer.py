"""`AntDTTrainerMixin`: the small part of the dataloader and step path a callback cannot reach.

- ``get_train_dataloader`` returns ``DataLoader(ServiceIterableDataset, batch_size=None, num_workers=0)`` *without*
  ``accelerator.prepare`` (which would dispatch from rank 0 or wrap it in ``IterableDatasetShard`` and drop samples).
- ``training_step`` runs the rank's batch as one or several micro-batches (memory cap: local accumulation under
  ``no_sync``, one all-reduce per step) and sets the weight of the DDP comm hook to ``b_i / sum_j b_j``, so the
  update equals the one of a single process on the union of the ranks' batches. It also measures the rank's local
  compute time (forward start to the last gradient bucket ready) for the Monitor.
- ``get_batch_samples`` skips Trainer's ``num_items_in_batch`` all-gather (the weighting replaces it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from .agent import AntDTAgent
from .config import AgentConfig
from .dataset import BatchMeta, ServiceIterableDataset

__all__ = ["AntDTTrainerMixin", "WeightedHookState", "weighted_allreduce_hook"]


@dataclass
class WeightedHookState:
    """Per-step weight of this rank's gradient and the time its last bucket became ready."""

    weight: float = 1.0
    last_ready: float = 0.0
    ready_event: Any = None  # on GPUs: a CUDA event recorded on the stream when the last bucket was ready
    process_group: Any = None


def weighted_allreduce_hook(state, bucket):  # no annotations: DDP checks them and this module defers them
    """DDP comm hook: ``grad = sum_i w_i * grad_i`` with ``w_i = b_i / sum b``, instead of DDP's plain mean.

    ``state`` is a `WeightedHookState`, ``bucket`` a ``dist.GradBucket``; returns a ``torch.futures.Future``."""
    state.last_ready = time.perf_counter()
    buf = bucket.buffer()
    if buf.is_cuda:
        state.ready_event = _cuda_event()
    buf.mul_(state.weight)
    fut = dist.all_reduce(buf, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _cuda_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _identity(x: Any) -> Any:
    return x


class AntDTTrainerMixin:
    """Mix into a `transformers.Trainer` (``class MyTrainer(AntDTTrainerMixin, Trainer)``).

    Args:
        antdt_config (`AgentConfig`, *optional*): client settings for the Agent it adds when none is passed.
        antdt_collate_fn (`Callable`, *optional*): list of samples -> dict batch (default: `default_collate`).
    """

    def __init__(self, *args: Any, antdt_config: AgentConfig | None = None, antdt_collate_fn=None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        a = self.args
        if a.gradient_accumulation_steps != 1:
            raise ValueError(f"gradient_accumulation_steps={a.gradient_accumulation_steps} is not supported with "
                             "AntDT: Trainer's accumulation count is global and cannot differ per rank. Set it to 1; "
                             "per-rank accumulation comes from AgentConfig.max_micro_batch.")
        if a.dataloader_num_workers != 0:
            raise ValueError(f"dataloader_num_workers={a.dataloader_num_workers}: shard leases cannot be shared with "
                             "DataLoader worker processes. Set it to 0 (prefetching runs on a thread).")
        if a.max_steps is None or a.max_steps <= 0:
            raise ValueError("max_steps must be > 0 with AntDT: the service-fed dataset has no length. Set an upper "
                             "bound; training stops on the same step on every rank when the data ends.")
        # Resuming must not fast-forward through the dataloader: the service rolls itself back instead.
        a.ignore_data_skip = True
        agents = [cb for cb in self.callback_handler.callbacks if isinstance(cb, AntDTAgent)]
        if not agents:
            self.add_callback(AntDTAgent(antdt_config))
        self._antdt_config = antdt_config
        self._antdt_collate = antdt_collate_fn
        self._antdt_dataset: ServiceIterableDataset | None = None
        self._antdt_hook = WeightedHookState()
        self._antdt_hooked = False

    @property
    def antdt_agent(self) -> AntDTAgent:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, AntDTAgent):
                return cb
        raise RuntimeError("no AntDTAgent among the callbacks.")

    def get_train_dataloader(self) -> DataLoader:
        if self._antdt_dataset is None:
            ds = self.train_dataset
            if not isinstance(ds, ServiceIterableDataset):
                if ds is None:
                    raise ValueError("train_dataset is required: a map-style dataset indexed by sample id.")
                cfg = self._antdt_config or self.antdt_agent.config
                ds = ServiceIterableDataset(ds, cfg, collate_fn=self._antdt_collate)
            self._antdt_dataset = ds
        return DataLoader(self._antdt_dataset, batch_size=None, num_workers=0, collate_fn=_identity)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    def _antdt_install_hook(self, model: torch.nn.Module) -> None:
        if self._antdt_hooked:
            return
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self._antdt_hook, weighted_allreduce_hook)
        self._antdt_hooked = True

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        meta: BatchMeta = inputs["antdt_meta"]
        micro = inputs.get("antdt_micro") or [{k: v for k, v in inputs.items() if k != "antdt_meta"}]
        self._antdt_install_hook(model)
        ddp = isinstance(model, DistributedDataParallel)
        self._antdt_hook.weight = meta.weight
        self._antdt_hook.last_ready, self._antdt_hook.ready_event = 0.0, None
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        n_local = meta.local_samples
        t0 = time.perf_counter()
        cuda = self.args.device.type == "cuda"
        start = _cuda_event() if cuda else None
        total = torch.zeros((), device=self.args.device)
        for j, mb in enumerate(micro):
            mb = self._prepare_inputs(mb)
            sync = j == len(micro) - 1
            ctx = model.no_sync() if (ddp and not sync) else contextlib.nullcontext()
            with ctx:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, mb)
                scale = meta.micro_sizes[j] / n_local if n_local else 1.0
                self.accelerator.backward(loss * scale)
            total = total + loss.detach() * scale
        if cuda:
            # GPU work runs asynchronously: the host clock would time kernel launches and hide a slow GPU, so the
            # times come from events on the stream (one synchronisation per step)
            stop = _cuda_event()
            stop.synchronize()
            ready = self._antdt_hook.ready_event if (ddp and self._antdt_hook.ready_event is not None) else stop
            meta.compute_s = start.elapsed_time(ready) / 1e3
            meta.sync_wait_s = ready.elapsed_time(stop) / 1e3
        else:
            done = time.perf_counter()
            end = self._antdt_hook.last_ready if (ddp and self._antdt_hook.last_ready) else done
            meta.compute_s = end - t0
            meta.sync_wait_s = done - end  # last bucket ready -> gradients reduced: waiting for the slowest rank
        self._antdt_dataset.current_meta = meta  # type: ignore[union-attr]
        # Trainer logs the mean over ranks of this value; scaling by w_i * world makes it the weighted global loss.
        world = dist.get_world_size() if ddp else 1
        return total * (meta.weight * world if ddp else 1.0)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        micro = inputs.get("antdt_micro") or [{k: v for k, v in inputs.items() if k != "antdt_meta"}]
        base = super().floating_point_ops  # type: ignore[misc]
        return sum(base(m) for m in micro)


def _make_trainer_class():
    from transformers import Trainer

    class AntDTTrainer(AntDTTrainerMixin, Trainer):
        """`transformers.Trainer` fed by the AntDT sharding service (see `AntDTTrainerMixin`)."""

    return AntDTTrainer


AntDTTrainer = _make_trainer_class()
__all__.append("AntDTTrainer")
