"""The cold-start comparison protocol: meta-trained vs global vs global + per-user fine-tuning, one seed.

All three arms use the same model class, the same training tasks (support + query interactions of warm users) and
the same scoring path (`evaluate_on_tasks`). Every choice is made on the **validation users** (the newest warm
users), never on the held-out new users:

* **global**: Adam on all training interactions; the epoch with the best validation AUC is kept.
* **global + fine-tune**: the kept global model, adapted per new user on the support set with plain SGD on the dense
  layers; learning rate and steps picked from a grid on validation AUC.
* **meta**: G-Meta/MAML (dense-only inner loop, Meta-SGD learned rates by default), warm-started from the kept global
  model (``warm_start=True``, so it has seen strictly more training than the global arm) and meta-trained for
  ``meta_epochs``; the epoch with the best validation AUC is kept.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .baselines import _device_of, _to, evaluate_on_tasks, train_global_model
from .inner_loop import InnerLoopConfig
from .meta_io import TaskPrefetcher
from .meta_learner import MetaLearner

__all__ = ["ColdStartProtocol", "compare_cold_start", "meta_train"]


@dataclass
class ColdStartProtocol:
    """Budgets and grids of `compare_cold_start` (defaults tuned on MovieLens-100K validation users)."""

    global_epochs: int = field(default=10, metadata={"help": "Epochs of the global model (best on validation kept)."})
    global_lr: float = field(default=1e-3, metadata={"help": "Adam learning rate of the global model."})
    finetune_lrs: tuple[float, ...] = field(default=(0.01, 0.1, 0.5), metadata={"help": "Fine-tuning SGD rates."})
    finetune_steps: tuple[int, ...] = field(default=(1, 5), metadata={"help": "Fine-tuning step counts."})
    meta_epochs: int = field(default=5, metadata={"help": "Meta-training epochs (best on validation kept)."})
    meta_lr: float = field(default=3e-4, metadata={"help": "Outer Adam learning rate."})
    inner_lr: float = field(default=0.3, metadata={"help": "Inner rate (initial value when learned)."})
    inner_steps: int = field(default=1, metadata={"help": "Inner steps (training and evaluation)."})
    learn_inner_lr: bool = field(default=True, metadata={"help": "Meta-SGD per-parameter rates."})
    first_order: bool = field(default=False, metadata={"help": "First-order MAML."})
    tasks_per_batch: int = field(default=16, metadata={"help": "Tasks per meta-batch."})
    warm_start: bool = field(default=True, metadata={"help": "Start meta-training from the global model."})


def meta_train(learner: MetaLearner, train, valid, epochs: int, lr: float, tasks_per_batch: int, seed: int,
               progress: Callable[[str], None] | None = None) -> tuple[MetaLearner, list[float]]:
    """Meta-train ``learner`` with Adam (outer loop) and keep the epoch with the best validation AUC."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(learner.parameters(), lr=lr)
    best, best_state, curve = -1.0, copy.deepcopy(learner.state_dict()), []
    device = _device_of(learner)
    for epoch in range(epochs):
        learner.train()
        for batch in TaskPrefetcher(train, tasks_per_batch, shuffle=True, seed=seed * 1000 + epoch):
            loss = learner(**_to(batch, device))["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        auc = evaluate_on_tasks(learner, valid)["auc"]
        curve.append(auc)
        if progress:
            progress(f"meta epoch {epoch}: valid auc {auc:.4f}")
        if auc > best:
            best, best_state = auc, copy.deepcopy(learner.state_dict())
    learner.load_state_dict(best_state)
    return learner, curve


def _train_global(model: nn.Module, train, valid, p: ColdStartProtocol, seed: int) -> tuple[nn.Module, list[float]]:
    best, best_state, curve = -1.0, copy.deepcopy(model.state_dict()), []
    for epoch in range(p.global_epochs):
        train_global_model(model, train, epochs=1, lr=p.global_lr, seed=seed * 1000 + epoch,
                           batch_tasks=p.tasks_per_batch)
        auc = evaluate_on_tasks(model, valid, inner_steps=0)["auc"]
        curve.append(auc)
        if auc > best:
            best, best_state = auc, copy.deepcopy(model.state_dict())
    model.load_state_dict(best_state)
    return model, curve


def compare_cold_start(make_model: Callable[[int], nn.Module], train, valid, test,
                       protocol: ColdStartProtocol | None = None, seed: int = 0,
                       progress: Callable[[str], None] | None = None) -> dict:
    """Run the three arms for one seed; returns test AUCs (pooled and per user), validation picks and timings.

    ``make_model(seed)`` builds a fresh model; ``train``/``valid``/``test`` are task records of disjoint users.
    """
    p = protocol or ColdStartProtocol()
    out: dict = {"seed": seed, "protocol": asdict(p)}
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    global_model, out["global_valid_curve"] = _train_global(make_model(seed), train, valid, p, seed)
    out["time_global_s"] = time.perf_counter() - t0
    g = evaluate_on_tasks(global_model, test, inner_steps=0)
    out["auc_global"], out["user_auc_global"] = g["auc"], g["user_auc"]

    grid = [(lr, st) for lr in p.finetune_lrs for st in p.finetune_steps]
    scores = {c: evaluate_on_tasks(global_model, valid, inner_lr=c[0], inner_steps=c[1])["auc"] for c in grid}
    lr, st = max(scores, key=scores.get)
    f = evaluate_on_tasks(global_model, test, inner_lr=lr, inner_steps=st)
    out["finetune_choice"] = {"inner_lr": lr, "inner_steps": st}
    out["auc_finetune"], out["user_auc_finetune"] = f["auc"], f["user_auc"]

    t1 = time.perf_counter()
    base = copy.deepcopy(global_model) if p.warm_start else make_model(seed)
    learner = MetaLearner(base, InnerLoopConfig(inner_lr=p.inner_lr, inner_steps=p.inner_steps,
                                                learn_inner_lr=p.learn_inner_lr, first_order=p.first_order))
    learner, out["meta_valid_curve"] = meta_train(learner, train, valid, p.meta_epochs, p.meta_lr,
                                                  p.tasks_per_batch, seed, progress)
    out["time_meta_s"] = time.perf_counter() - t1
    m = evaluate_on_tasks(learner, test)
    out["auc_meta"], out["user_auc_meta"] = m["auc"], m["user_auc"]
    if progress:
        progress(f"seed {seed}: auc global {out['auc_global']:.4f} finetune {out['auc_finetune']:.4f} "
                 f"meta {out['auc_meta']:.4f}")
    return out
