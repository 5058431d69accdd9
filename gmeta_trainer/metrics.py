"""Cold-start metrics: pooled ROC-AUC over all query interactions and the mean per-task (per-user) AUC."""

from __future__ import annotations

import numpy as np

__all__ = ["binary_auc", "cold_start_metrics", "compute_cold_start_metrics"]


def binary_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> float:
    """ROC-AUC (Mann-Whitney with tie correction) of ``scores`` for binary ``labels``; examples with weight 0 are
    ignored. Returns NaN when only one class is present."""
    s = np.asarray(scores, np.float64).ravel()
    y = np.asarray(labels).ravel() > 0.5
    if weights is not None:
        keep = np.asarray(weights).ravel() > 0
        s, y = s[keep], y[keep]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), np.float64)
    sorted_s = s[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def cold_start_metrics(logits: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> dict[str, float]:
    """``logits/labels/weights [T, Kq]`` -> ``auc`` (pooled), ``user_auc`` (mean over tasks with both classes),
    ``logloss`` (weighted)."""
    logits, labels, weights = (np.asarray(a, np.float64) for a in (logits, labels, weights))
    per_task = [binary_auc(logits[t], labels[t], weights[t]) for t in range(len(logits))]
    per_task = [a for a in per_task if not np.isnan(a)]
    p = 1 / (1 + np.exp(-np.clip(logits, -30, 30)))
    ll = -(labels * np.log(p + 1e-12) + (1 - labels) * np.log(1 - p + 1e-12))
    return {"auc": binary_auc(logits, labels, weights),
            "user_auc": float(np.mean(per_task)) if per_task else float("nan"),
            "logloss": float((ll * weights).sum() / max(weights.sum(), 1e-12))}


def compute_cold_start_metrics(eval_pred) -> dict[str, float]:
    """`Trainer` ``compute_metrics`` for `MetaTrainer`: predictions ``[T, Kq]`` logits, label_ids ``[T, Kq, 2]``
    (label, weight)."""
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(preds, tuple):
        preds = preds[0]
    return cold_start_metrics(preds, labels[..., 0], labels[..., 1])
