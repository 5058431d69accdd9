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


def _live_read_ahead_threads() -> list[str]:
    import gc
    import threading

    gc.collect()  # a dropped epoch iterator stops its thread when collected
    return [t.name for t in threading.enumerate() if t.name.startswith("gmeta-") and t.is_alive()]


def _train_small(tmp_path, name: str, **kw):
    from gmeta_trainer import MetaTrainer, MetaTrainingArguments

    recs = build_task_records(make_synthetic_interactions(num_users=20, num_items=50, seed=0), IO)
    args = MetaTrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4, learning_rate=1e-2,
                                 inner_lr=0.5, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
                                 per_device_eval_batch_size=8, use_cpu=True, **kw)
    return MetaTrainer(model=_model(), args=args, train_dataset=recs, eval_dataset=recs)


def test_meta_io_read_ahead_trains_exactly_like_the_trainers_own_reading(tmp_path):
    runs = {}
    for prefetch in (True, False):
        # two shuffled epochs, then evaluation: order, seeds and batches must all agree
        trainer = _train_small(tmp_path, f"prefetch_{prefetch}", num_train_epochs=2, meta_io_prefetch=prefetch)
        trainer.train()
        metrics = trainer.evaluate()
        runs[prefetch] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, metrics,
                          trainer.meta_io_stats.items)
    (on, m_on, served_on), (off, m_off, served_off) = runs[True], runs[False]
    assert served_on == 10 and served_off == 0  # 20 tasks / 4 per step x 2 epochs, all through Meta-IO
    for n in on:
        assert torch.equal(on[n], off[n]), f"{n} differs between Meta-IO read-ahead and the Trainer's reading"
    assert m_on["eval_logloss"] == m_off["eval_logloss"] and m_on["eval_auc"] == m_off["eval_auc"]
    assert _live_read_ahead_threads() == []


def test_a_failing_read_surfaces_in_the_training_step_and_stops_the_thread(tmp_path, monkeypatch):
    from gmeta_trainer import ReadAheadError, TaskBatchDataset

    calls = {"n": 0}
    read = TaskBatchDataset.__getitems__

    def flaky(self, indices):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk gone")
        return read(self, indices)

    monkeypatch.setattr(TaskBatchDataset, "__getitems__", flaky)
    trainer = _train_small(tmp_path, "flaky", max_steps=4)
    with pytest.raises(ReadAheadError, match=r"read-ahead thread failed reading item 2 .*OSError: disk gone") as exc:
        trainer.train()
    assert isinstance(exc.value.__cause__, OSError)
    assert _live_read_ahead_threads() == []
    # stopping at max_steps mid-epoch leaves no reader behind either
    monkeypatch.setattr(TaskBatchDataset, "__getitems__", read)
    _train_small(tmp_path, "short", max_steps=2).train()
    assert _live_read_ahead_threads() == []


def test_meta_io_arguments_are_validated(tmp_path):
    from gmeta_trainer import MetaTrainingArguments

    with pytest.raises(ValueError, match=r"meta_io_prefetch_batches=0 must be >= 1.*meta_io_prefetch=False"):
        MetaTrainingArguments(output_dir=str(tmp_path), meta_io_prefetch_batches=0)
    assert MetaTrainingArguments(output_dir=str(tmp_path), meta_io_prefetch="false").meta_io_prefetch is False
    with pytest.raises(ValueError, match="meta_io_prefetch='maybe' is not a boolean"):
        MetaTrainingArguments(output_dir=str(tmp_path), meta_io_prefetch="maybe")
