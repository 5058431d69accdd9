"""`ParoTrainer`: `transformers.Trainer` trained by the PaRO-DP engine through `ParoAccelerator`.

Only the seams that must change are overridden:
- ``create_accelerator_and_postprocess``: the accelerator is a `ParoAccelerator` built from the same arguments
  Trainer builds for `Accelerator` (dataloader config, accumulation plugin, mixed precision, ...). Trainer's own
  accumulation loop then works unchanged: non-boundary micro-steps run inside ``accelerator.no_sync(model)``, which is
  the engine's ``no_sync``.
- ``save_model``: the full weights are a collective gather, so every rank gathers and the main process writes them
  with ``save_pretrained`` (Trainer's ``_save`` runs on the main process only, which would deadlock a gather).
- optimizer/scheduler checkpointing: the engine's per-rank sharded checkpoint in ``<checkpoint>/paro_sharded``
  (resume with the same strategy and launch topology) plus Trainer's ``scheduler.pt``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Trainer
from transformers.utils import logging

from .paro_accelerator import SHARDED_DIR, ParoAccelerator
from .paro_plugin import ParoPlugin

__all__ = ["ParoTrainer"]

logger = logging.get_logger(__name__)

SCHEDULER_NAME = "scheduler.pt"


class ParoTrainer(Trainer):
    """`Trainer` with PaRO-DP data parallelism.

    Args:
        paro_plugin (`ParoPlugin`, *optional*): PaRO settings; defaults to `ParoPlugin.from_env()`.
        *args, **kwargs: as for `transformers.Trainer`. DeepSpeed and FSDP training arguments are rejected.
    """

    def __init__(self, *args: Any, paro_plugin: ParoPlugin | None = None, **kwargs: Any):
        self.paro_plugin = paro_plugin if paro_plugin is not None else ParoPlugin.from_env()
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ accelerator
    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        # DDP kwargs do not apply: PaRO does not wrap the model in DDP.
        args.pop("kwargs_handlers", None)
        self._paro_accelerator_args = args
        return args

    def create_accelerator_and_postprocess(self) -> None:
        if self.args.deepspeed_plugin is not None or self.args.fsdp_plugin_args is not None:
            raise ValueError("ParoTrainer trains with PaRO-DP, which replaces DeepSpeed/FSDP: remove `deepspeed` / "
                             "`fsdp` from the TrainingArguments.")
        if self.args.parallelism_config is not None:
            raise ValueError("ParoTrainer does not combine with `parallelism_config` (TP/CP/FSDP meshes); PaRO is "
                             "pure data parallelism. Remove parallelism_config.")
        # The base method builds a plain Accelerator from the args (shared AcceleratorState, so this is cheap) and
        # runs its post-processing; we then swap in the PaRO accelerator built from exactly the same arguments.
        super().create_accelerator_and_postprocess()
        self.accelerator = ParoAccelerator(paro_plugin=self.paro_plugin, **self._paro_accelerator_args)
        self.gather_function = self.accelerator.gather_for_metrics
        if self.args.eval_use_gather_object:
            import functools

            self.gather_function = functools.partial(self.gather_function, use_gather_object=True)

    @property
    def paro_engine(self):
        return getattr(self.accelerator, "paro_engine", None)

    # ----------------------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective under PaRO: every rank gathers the full weights, the main process writes them
        (``save_pretrained`` format: safetensors + config, loadable with ``from_pretrained``)."""
        engine = self.paro_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.accelerator.get_state_dict(engine)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = self.paro_engine
        if engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        engine.save_sharded(os.path.join(output_dir, SHARDED_DIR))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = self.paro_engine
        if engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        sharded = os.path.join(checkpoint, SHARDED_DIR)
        if not os.path.isdir(sharded):
            raise FileNotFoundError(f"checkpoint {checkpoint!r} has no PaRO optimizer state ({SHARDED_DIR}/); it was "
                                    "not written by ParoTrainer. Resume from a ParoTrainer checkpoint, or start "
                                    "a new run from the weights (model_name_or_path) instead of resuming.")
        engine.load_sharded(sharded)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
