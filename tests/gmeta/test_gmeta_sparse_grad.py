"""``sparse_grad`` tables: a sparse COO gradient of the rows looked up, equal to the dense gradient, for the
replicated `EmbeddingCollection` and for the row-sharded one on 2 gloo ranks; and a meta-step with Adagrad on it
ends where the dense gradient's does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed


def _ids(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.stack([torch.randint(0, v, (6,), generator=g) for v in (9, 4)], -1)
    ids[0] = ids[1]  # a repeated row: its sparse entries add up
    return ids


def test_replicated_sparse_grad_equals_dense():
    from gmeta_trainer import EmbeddingCollection

    dense, sparse = EmbeddingCollection([9, 4], 3, seed=1), EmbeddingCollection([9, 4], 3, seed=1, sparse_grad=True)
    g_out = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(0))
    (dense(_ids(0)) * g_out).sum().backward()
    (sparse(_ids(0)) * g_out).sum().backward()
    assert sparse.weight.grad.is_sparse
    torch.testing.assert_close(sparse.weight.grad.to_dense(), dense.weight.grad)


def _sharded(rank: int, world: int) -> dict:
    from gmeta_trainer import EmbeddingCollection, RowShardedEmbeddingCollection

    full = EmbeddingCollection([9, 4], 3, seed=1).weight.detach()
    out = {}
    for sparse in (False, True):
        table = RowShardedEmbeddingCollection([9, 4], 3, full_weight=full, sparse_grad=sparse)
        opt = torch.optim.Adagrad(table.parameters(), lr=0.1, initial_accumulator_value=0.1)
        g_out = torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(rank))
        (table(_ids(rank)) * g_out).sum().backward()
        grad = table.local_weight.grad
        out[f"sparse_{sparse}_is_sparse"] = grad.is_sparse
        # numpy, not tensors: tensors go back through shared memory that dies with the rank
        out[f"grad_{sparse}"] = (grad.to_dense() if grad.is_sparse else grad).numpy().copy()
        opt.step()
        out[f"table_{sparse}"] = table.gather_full_weight().numpy().copy()
    return out


@pytest.mark.distributed
def test_row_sharded_sparse_grad_equals_dense_and_adagrad_agrees():
    for r in run_distributed(_sharded, 2, timeout=180):
        assert r["sparse_True_is_sparse"] and not r["sparse_False_is_sparse"]
        np.testing.assert_allclose(r["grad_True"], r["grad_False"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(r["table_True"], r["table_False"], rtol=1e-6, atol=1e-7)


def _lookup_under(rank: int, world: int, default_device: str) -> dict:
    """Lookup, backward and gather of a CPU table with ``default_device`` as torch's default for factory functions:
    under ``meta`` a buffer made without naming its device fails next to the CPU shard, as a CPU buffer would next to
    a CUDA shard under NCCL."""
    from gmeta_trainer import EmbeddingCollection, RowShardedEmbeddingCollection

    full = EmbeddingCollection([9, 4], 3, seed=1).weight.detach()
    ids, g_out = _ids(rank), torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(rank))
    out = {}
    for sparse in (False, True):
        table = RowShardedEmbeddingCollection([9, 4], 3, full_weight=full, sparse_grad=sparse)
        with torch.device(default_device):
            out["default"] = str(torch.empty(0).device)
            (table(ids) * g_out).sum().backward()
            grad = table.local_weight.grad
            out[f"grad_{sparse}"] = (grad.to_dense() if grad.is_sparse else grad).numpy().copy()
            out[f"table_{sparse}"] = table.gather_full_weight().numpy().copy()
    return out


@pytest.mark.distributed
def test_sharded_lookup_and_gather_keep_to_the_tables_device():
    cpu, meta = (run_distributed(_lookup_under, 2, d, timeout=180) for d in ("cpu", "meta"))
    for a, b in zip(cpu, meta):
        assert b["default"] == "meta"
        for key in ("grad_False", "grad_True", "table_False", "table_True"):
            np.testing.assert_array_equal(a[key], b[key])


def _train(rank: int, world: int, out_dir: str) -> dict:
    """MetaTrainer with row-sharded tables and Adagrad, gradient clipping active: dense vs sparse shard gradient."""
    from gmeta_trainer import (
        DLRMConfig,
        DLRMModel,
        MetaIOConfig,
        MetaTrainer,
        MetaTrainingArguments,
        build_task_records,
        make_synthetic_interactions,
        shard_embeddings,
    )

    inter = make_synthetic_interactions(num_users=16, num_items=40, min_interactions=14, max_interactions=20, seed=3)
    records = build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                     support_size=6, query_size=6))
    out = {}
    for sparse in (False, True):
        torch.manual_seed(0)
        model = DLRMModel(DLRMConfig(vocab_sizes=[40, 8], num_dense=4, embedding_dim=8, bottom_mlp=[8],
                                     top_mlp=[16], seed=0))
        shard_embeddings(model, sparse_grad=sparse)
        args = MetaTrainingArguments(output_dir=f"{out_dir}/{sparse}", per_device_train_batch_size=4 // world,
                                     max_steps=3, learning_rate=5e-2, optim="adagrad", train_sampling_strategy=
                                     "sequential", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                     inner_lr=0.5, max_grad_norm=0.05, seed=0, use_cpu=True)
        MetaTrainer(model=model, args=args, train_dataset=records).train()
        out[sparse] = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if "embeddings" not in n}
        out[sparse]["table"] = model.embeddings.gather_full_weight().numpy().copy()
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_meta_trainer_sparse_shard_grad_with_clipping_equals_dense(tmp_path):
    for r in run_distributed(_train, 2, str(tmp_path), timeout=300):
        for name, dense in r[False].items():
            np.testing.assert_allclose(r[True][name], dense, rtol=1e-5, atol=1e-6, err_msg=name)
