"""`MetaTrainingArguments`: `TrainingArguments` plus the inner-loop settings of MAML-family meta-training."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .inner_loop import InnerLoopConfig

__all__ = ["MetaTrainingArguments"]


def _str_to_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; use true or false.")


@dataclass
class MetaTrainingArguments(TrainingArguments):
    """Arguments of `MetaTrainer`. ``per_device_train_batch_size`` counts **tasks** (a meta-batch), and
    ``learning_rate`` is the outer (meta) learning rate.

    Paper: G-Meta, Xiao et al., CIKM 2023 (arXiv 2401.04338); inner loop after MAML (Finn et al., 2017), Meta-SGD
    (Li et al., 2017) and MeLU (Lee et al., KDD 2019).

    > Parameters that control the inner loop

    Parameters:
        inner_lr (`float`, *optional*, defaults to 0.1): inner SGD step size (initial value if `learn_inner_lr`).
        learn_inner_lr (`bool`, *optional*, defaults to `False`): Meta-SGD, one learnable rate per parameter element,
            updated by the outer optimizer.
        inner_steps (`int`, *optional*, defaults to 1): inner steps on each task's support set in training.
        eval_inner_steps (`int`, *optional*): inner steps at evaluation (defaults to `inner_steps`).
        first_order (`bool`, *optional*, defaults to `False`): first-order MAML, cheaper, no second derivatives.
        inner_params (`str`, *optional*, defaults to `"dense"`): which parameters adapt per task: `"dense"` (all but
            embedding tables, as MeLU/G-Meta), `"all"`, or a regular expression on parameter names.
        task_vmap (`bool`, *optional*, defaults to `True`): vectorise tasks with `torch.vmap`.
        meta_loss (`str`, *optional*, defaults to `"bce"`): `"bce"` for click labels, `"mse"` for ratings.

    > Parameters that control Meta-IO reading

    Parameters:
        meta_io_prefetch (`bool`, *optional*, defaults to `True`): read the train and eval task batches through
            Meta-IO (`TaskBatchReader`: Arrow slices instead of per-row decoding, when the dataset is a
            `datasets.Dataset` and the collator is the default) on a background thread that runs ahead of the
            step. Batches, their order and every RNG draw are those of the Trainer's own DataLoader, so results are
            identical with it off. Applies when ``dataloader_num_workers=0`` (worker processes read ahead already).
        meta_io_prefetch_batches (`int`, *optional*, defaults to 4): batches read ahead.

    Practical advice: dense-only adaptation with 1-3 inner steps and `inner_lr` 0.1-1.0 is the MeLU regime. Second
    order also differentiates through the inner gradients, so its backward pass does more work and keeps the inner
    loop's graph alive; set `first_order=True` when that cost matters more than the exact meta-gradient.
    """

    inner_lr: float = field(default=0.1, metadata={"help": "Inner-loop SGD step size (initial value if learnable)."})
    learn_inner_lr: bool = field(default=False, metadata={"help": "Meta-SGD: learn one rate per parameter element."})
    inner_steps: int = field(default=1, metadata={"help": "Inner SGD steps on each task's support set."})
    eval_inner_steps: int | None = field(default=None, metadata={"help": "Inner steps at evaluation (default: "
                                                                          "inner_steps)."})
    first_order: bool = field(default=False, metadata={"help": "First-order MAML (no second derivatives)."})
    inner_params: str = field(default="dense", metadata={"help": "Parameters adapted per task: 'dense', 'all', or "
                                                                 "a regex on parameter names."})
    task_vmap: bool = field(default=True, metadata={"help": "Vectorise the tasks of a batch with torch.vmap."})
    meta_loss: str = field(default="bce", metadata={"help": "'bce' (binary labels) or 'mse' (ratings)."})
    meta_io_prefetch: bool = field(default=True, metadata={"help": "Read task batches through Meta-IO on a "
                                                                   "background thread (identical batches)."})
    meta_io_prefetch_batches: int = field(default=4, metadata={"help": "Task batches read ahead when "
                                                                       "meta_io_prefetch is on."})
    # Redefined defaults: task records carry sup_*/qry_* columns the model consumes through **inputs.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep task-record columns (must stay "
                                                                         "False for MetaTrainer)."})
    report_to: str | list[str] | None = field(default="none", metadata={"help": "Integrations to report to."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.eval_inner_steps, str):
            self.eval_inner_steps = int(self.eval_inner_steps)
        if isinstance(self.meta_io_prefetch, str):
            self.meta_io_prefetch = _str_to_bool("meta_io_prefetch", self.meta_io_prefetch)
        if isinstance(self.meta_io_prefetch_batches, str):
            self.meta_io_prefetch_batches = int(self.meta_io_prefetch_batches)
        if self.meta_io_prefetch and self.meta_io_prefetch_batches < 1:
            raise ValueError(f"meta_io_prefetch_batches={self.meta_io_prefetch_batches} must be >= 1 (batches read "
                             "ahead); set meta_io_prefetch=False to read in the training thread instead.")
        if self.remove_unused_columns:
            raise ValueError("remove_unused_columns=True would drop the sup_*/qry_* columns of the task records "
                             "(MetaLearner.forward takes them by name). Set remove_unused_columns=False.")
        # validate through the engine's config so both entry points give the same errors
        self.inner_loop_config()

    def inner_loop_config(self) -> InnerLoopConfig:
        """The engine-side `InnerLoopConfig` built from these arguments."""
        return InnerLoopConfig(inner_lr=self.inner_lr, learn_inner_lr=self.learn_inner_lr,
                               inner_steps=self.inner_steps, eval_inner_steps=self.eval_inner_steps,
                               first_order=self.first_order, inner_params=self.inner_params,
                               task_vmap=self.task_vmap, loss=self.meta_loss)
