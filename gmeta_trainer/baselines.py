"""Baselines for the cold-start comparison, on the same task records and the same model class as meta-training.

* **global**: the model trained on every interaction (support and query) of the training tasks as one flat
  stream, no per-task adaptation: what a production ranker without meta-learning does.
* **global + fine-tune**: the global model adapted on each new task's support set with the same inner-loop code
  as the meta model at evaluation (plain SGD on the dense layers), only the starting point differs.

Both reuse `MetaLearner` in eval mode for prediction, so the three arms share exactly one adaptation and scoring path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .inner_loop import InnerLoopConfig, masked_task_loss
from .meta_io import TaskPrefetcher
from .meta_learner import MetaLearner
from .metrics import cold_start_metrics

__all__ = ["evaluate_on_tasks", "train_global_model"]


def train_global_model(model: nn.Module, records, epochs: int = 5, batch_tasks: int = 32, lr: float = 1e-3,
                       weight_decay: float = 0.0, loss: str = "bce", seed: int = 0) -> nn.Module:
    """Train ``model`` on the support and query interactions of ``records`` without adaptation (in place)."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    device = _device_of(model)
    for epoch in range(epochs):
        for batch in TaskPrefetcher(records, batch_tasks, shuffle=True, seed=seed * 1000 + epoch, drop_last=False):
            batch = _to(batch, device)
            parts = {}
            for key in ("sparse", "dense", "y", "w"):
                a, b = batch.get(f"sup_{key}"), batch.get(f"qry_{key}")
                if a is not None:
                    parts[key] = torch.cat([a.flatten(0, 1), b.flatten(0, 1)])
            kwargs = {"sparse": parts["sparse"]}
            if "dense" in parts and parts["dense"].shape[-1] > 0:
                kwargs["dense"] = parts["dense"]
            logits = model(**kwargs)
            loss_value = masked_task_loss(logits, parts["y"], parts["w"], loss)
            opt.zero_grad()
            loss_value.backward()
            opt.step()
    return model


@torch.no_grad()
def evaluate_on_tasks(model: nn.Module | MetaLearner, records, inner_lr: float = 0.1, inner_steps: int = 1,
                      inner_params: str = "dense", batch_tasks: int = 64, loss: str = "bce") -> dict[str, float]:
    """Adapt on each task's support set (``inner_steps`` SGD steps, 0 = no adaptation), score its query set, and
    return `cold_start_metrics` (``auc``, ``user_auc``, ``logloss``). A `MetaLearner` keeps its own inner-loop
    settings (including learned rates) unless ``inner_steps`` is given explicitly for a plain model."""
    if isinstance(model, MetaLearner):
        learner = model
    else:
        cfg = InnerLoopConfig(inner_lr=inner_lr, inner_steps=max(inner_steps, 1), eval_inner_steps=inner_steps,
                              inner_params=inner_params, loss=loss)
        learner = MetaLearner(model, cfg)
    was_training = learner.training
    learner.eval()
    logits, ys, ws = [], [], []
    device = _device_of(learner)
    for batch in TaskPrefetcher(records, batch_tasks, shuffle=False, drop_last=False):
        out = learner(**_to(batch, device))
        logits.append(out["logits"].cpu().numpy())
        ys.append(batch["qry_y"].numpy())
        ws.append(batch["qry_w"].numpy())
    learner.train(was_training)
    return cold_start_metrics(np.concatenate(logits), np.concatenate(ys), np.concatenate(ws))


def _device_of(model: nn.Module) -> torch.device:
    """The device of the model's parameters: task batches are read on the CPU and moved there."""
    return next(model.parameters()).device


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
