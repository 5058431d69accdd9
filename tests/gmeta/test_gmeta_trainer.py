"""MetaTrainer on the HF Trainer loop: it trains every parameter, evaluation adapts on the support sets without
changing the stored parameters, arguments are validated, and on synthetic users meta-learning beats the global
model (the property the synthetic generator is built to have)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gmeta_trainer import (
    DLRMConfig,
    DLRMModel,
    MetaIOConfig,
    build_task_records,
    make_synthetic_interactions,
)

IO = MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"], support_size=10, query_size=10)


def _model(seed=0):
    torch.manual_seed(seed)
    return DLRMModel(DLRMConfig(vocab_sizes=[50, 8], num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[16],
                                seed=seed))


def test_meta_trainer_trains_every_parameter_and_evaluation_adapts(tmp_path):
    from gmeta_trainer import MetaTrainer, MetaTrainingArguments

    recs = build_task_records(make_synthetic_interactions(num_users=32, num_items=50, seed=0), IO)
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = MetaTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4,
                                 learning_rate=1e-2, inner_lr=0.5, learn_inner_lr=True, save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, per_device_eval_batch_size=16,
                                 use_cpu=True)
    trainer = MetaTrainer(model=model, args=args, train_dataset=recs, eval_dataset=recs)
    trainer.train()
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"{n} did not change"
    assert all(not torch.equal(p, torch.full_like(p, 0.5)) for p in trainer.model.inner_lrs.values())
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.evaluate()
    assert {"eval_auc", "eval_user_auc", "eval_logloss", "eval_loss"} <= set(metrics)
    assert 0.0 <= metrics["eval_auc"] <= 1.0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, trained[n]), f"evaluation changed {n}"
    trainer.model.config.eval_inner_steps = 0
    unadapted = trainer.evaluate()
    assert unadapted["eval_logloss"] != pytest.approx(metrics["eval_logloss"])


def test_arguments_and_datasets_are_validated(tmp_path):
    from gmeta_trainer import MetaTrainer, MetaTrainingArguments

    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        MetaTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=True)
    with pytest.raises(ValueError, match="inner_steps=0"):
        MetaTrainingArguments(output_dir=str(tmp_path), inner_steps=0)
    args = MetaTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    flat = make_synthetic_interactions(num_users=4, seed=0)
    with pytest.raises(ValueError, match="not task records; build them with"):
        MetaTrainer(model=_model(), args=args, train_dataset=flat)


@pytest.mark.slow
def test_meta_learning_beats_global_model_on_synthetic_cold_users():
    from gmeta_trainer.cold_start import ColdStartProtocol, compare_cold_start

    # one item catalogue, disjoint users: 128 train, 32 validation, 48 new
    inter = [make_synthetic_interactions(num_users=n, num_items=50, latent_dim=2, seed=s, first_user_id=1000 * s)
             for n, s in ((128, 0), (32, 1), (48, 2))]
    train, valid, test = (build_task_records(x, IO) for x in inter)
    p = ColdStartProtocol(global_epochs=6, meta_epochs=6, meta_lr=3e-3, warm_start=False, finetune_lrs=(0.1, 0.5),
                          finetune_steps=(1, 5), tasks_per_batch=16)
    res = compare_cold_start(_model, train, valid, test, p, seed=0)
    assert res["auc_meta"] > res["auc_global"] + 0.02, res
    assert res["auc_meta"] > res["auc_finetune"], res
    assert np.isfinite(res["user_auc_meta"])
