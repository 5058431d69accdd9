"""`PlacedPPOTrainer`: the first placement API (placement settings as keyword arguments), kept as a thin alias."""

from __future__ import annotations

import copy
import warnings

from hf_placement import PlacementPlan

from ..ppo_config import PPOConfig
from ..ppo_trainer import PPOTrainer

__all__ = ["PlacedPPOTrainer"]


class PlacedPPOTrainer(PPOTrainer):
    """`PPOTrainer` with the placement settings as keyword arguments (deprecated: use ``PPOTrainer(...,
    placement=...)`` with the settings on `PPOConfig`).

    Equivalent to ``PPOTrainer(..., placement=placement)`` with ``placement_timeout_s``, ``weight_sync`` and
    ``max_staleness`` set on a copy of ``args``; ``placement=None`` means ``"colocated"``.
    """

    def __init__(self, args: PPOConfig, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None,
                 placement: str | PlacementPlan | dict | None = None, placement_timeout_s: float = 300.0,
                 weight_sync: str = "broadcast", strict_equivalence: bool = False, max_staleness: int = 0) -> None:
        warnings.warn("PlacedPPOTrainer is deprecated and will be removed in hf-scale-plugins 0.3.0: use "
                      "PPOTrainer(..., placement=...) with placement_timeout_s / weight_sync / max_staleness on "
                      "PPOConfig.", FutureWarning, stacklevel=2)
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a trl_trainers.PPOConfig, got {type(args).__name__}.")
        args = copy.copy(args)
        args.placement_timeout_s, args.weight_sync, args.max_staleness = placement_timeout_s, weight_sync, \
            max_staleness
        args.check_placement_options()
        super().__init__(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                         data_collator=data_collator, eval_dataset=eval_dataset, optimizers=optimizers,
                         callbacks=callbacks, peft_config=peft_config,
                         placement="colocated" if placement is None else placement,
                         strict_equivalence=strict_equivalence)
