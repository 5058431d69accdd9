"""Distributed equivalence on gloo: the row-sharded embedding collection equals the unsharded table (lookups and
gradients), and MetaTrainer on 2 ranks (DDP dense layers, with and without sharded tables) ends with the same
parameters as on 1 rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

pytestmark = pytest.mark.distributed


def _ids_for(rank: int, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.stack([torch.randint(0, v, (n,), generator=g) for v in (7, 5, 3)], -1)
    if rank == 1:
        ids[:, 0] = 6  # rank 1 never asks for the first rows: an empty split in the all-to-all
    ids[0] = ids[1]  # duplicate rows are looked up once and their gradients summed
    return ids


def _sharded_lookup(rank: int, world: int) -> dict:
    from gmeta_trainer import EmbeddingCollection, RowShardedEmbeddingCollection

    full = EmbeddingCollection([7, 5, 3], 4, seed=0)
    sharded = RowShardedEmbeddingCollection([7, 5, 3], 4, full_weight=full.weight.detach())
    ids = _ids_for(rank)
    g_out = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(rank))
    out = sharded(ids)
    (out * g_out).sum().backward()
    # reference: one process sees every rank's lookups; the mean over ranks matches DDP semantics
    ref_loss = sum((full(_ids_for(r)) * torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(r))).sum()
                   for r in range(world)) / world
    ref_loss.backward()
    ref_out = full(ids)
    with pytest.raises(ValueError, match="out of range"):
        sharded(torch.tensor([[7, 0, 0]]))
    return {"out_err": (out - ref_out).abs().max().item(),
            "grad_err": (sharded.local_weight.grad - full.weight.grad[sharded.row_start:sharded.row_end])
            .abs().max().item(),
            "local_rows": sharded.local_weight.shape[0], "full_equal": torch.equal(sharded.gather_full_weight(),
                                                                                   full.weight.detach())}


def test_row_sharded_lookup_and_gradients_equal_unsharded():
    res = run_distributed(_sharded_lookup, 2, timeout=180)
    for r in res:
        assert r["out_err"] < 1e-7 and r["grad_err"] < 1e-7, r
        assert r["full_equal"]
    assert [r["local_rows"] for r in res] == [8, 7]  # 15 rows split ~1/world


def _records():
    from gmeta_trainer import MetaIOConfig, build_task_records, make_synthetic_interactions

    inter = make_synthetic_interactions(num_users=16, num_items=40, min_interactions=14, max_interactions=20, seed=3)
    return build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                  support_size=6, query_size=6))


def _train(world: int, shard: bool, out_dir: str) -> dict[str, np.ndarray]:
    from gmeta_trainer import DLRMConfig, DLRMModel, MetaTrainer, MetaTrainingArguments, shard_embeddings

    torch.manual_seed(0)
    model = DLRMModel(DLRMConfig(vocab_sizes=[40, 8], num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[16],
                                 seed=0))
    if shard:
        shard_embeddings(model)
    args = MetaTrainingArguments(output_dir=out_dir, per_device_train_batch_size=8 // world, max_steps=3,
                                 learning_rate=1e-2, train_sampling_strategy="sequential", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, inner_lr=0.5, inner_steps=2,
                                 max_grad_norm=0.05, seed=0, use_cpu=True)
    trainer = MetaTrainer(model=model, args=args, train_dataset=_records())
    trainer.train()
    out = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if "embeddings" not in n}
    emb = model.embeddings
    out["table"] = (emb.gather_full_weight() if shard else emb.weight.detach()).numpy().copy()
    if shard:
        # the checkpoint holds the unsharded model (gathered tables under the unsharded key)
        trainer.save_model(f"{out_dir}/saved")
        torch.distributed.barrier()
        from safetensors.torch import load_file

        saved = load_file(f"{out_dir}/saved/model.safetensors")
        assert "model.embeddings.local_weight" not in saved
        np.testing.assert_array_equal(saved["model.embeddings.weight"].numpy(), out["table"])
    return out


def _train_two_ranks(rank: int, world: int, out_dir: str) -> dict:
    return {"ddp": _train(world, False, f"{out_dir}/ddp"), "sharded": _train(world, True, f"{out_dir}/sharded")}


@pytest.mark.slow
def test_meta_trainer_two_ranks_equal_one_rank_with_and_without_sharded_tables(tmp_path):
    ref = _train(1, False, str(tmp_path / "one"))
    res = run_distributed(_train_two_ranks, 2, str(tmp_path / "two"), timeout=600)
    start = _fresh_params()
    for name in ref:
        assert not np.allclose(ref[name], start[name]), f"{name} did not train"
    for rank, r in enumerate(res):
        for variant in ("ddp", "sharded"):
            for name, value in ref.items():
                np.testing.assert_allclose(r[variant][name], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"rank {rank} {variant} {name}")


def _fresh_params() -> dict[str, np.ndarray]:
    from gmeta_trainer import DLRMConfig, DLRMModel

    torch.manual_seed(0)
    model = DLRMModel(DLRMConfig(vocab_sizes=[40, 8], num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[16],
                                 seed=0))
    out = {n: p.detach().numpy().copy() for n, p in model.named_parameters() if "embeddings" not in n}
    out["table"] = model.embeddings.weight.detach().numpy().copy()
    return out
