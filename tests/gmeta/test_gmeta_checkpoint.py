"""Checkpoints with row-sharded tables, against uninterrupted runs: on 2 gloo ranks, MetaTrainer saves per-rank shards
(rows and their optimizer state), and resuming from step 3 ends bit-identical to training 6 steps straight; the
consolidated export resumes on 2 ranks identically and on 1 rank to fp32 tolerance, and loads into the plain model
with the 2-rank model's outputs. Meta-IO read-ahead (the default) ends identical to the Trainer's own reading on 2
ranks. Bad checkpoints (missing, truncated or altered files, an interrupted save, another world size, other shapes)
get errors that name the problem and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

STEPS, SAVE_AT, TASKS_PER_RANK = 6, 3, 2
INNER_LR, INNER_STEPS = 0.5, 2


def _inner():
    from gmeta_trainer import InnerLoopConfig

    return InnerLoopConfig(inner_lr=INNER_LR, inner_steps=INNER_STEPS)


def _records():
    from gmeta_trainer import MetaIOConfig, build_task_records, make_synthetic_interactions

    inter = make_synthetic_interactions(num_users=16, num_items=40, min_interactions=14, max_interactions=20, seed=3)
    return build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                  support_size=6, query_size=6))


def _model(vocab=(40, 8)):
    from gmeta_trainer import DLRMConfig, DLRMModel

    torch.manual_seed(0)
    return DLRMModel(DLRMConfig(vocab_sizes=list(vocab), num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[16],
                                seed=0))


def _trainer(out: str, batch: int, shard: bool, **kw):
    from gmeta_trainer import MetaTrainer, MetaTrainingArguments, shard_embeddings

    model = _model()
    if shard:
        shard_embeddings(model)
    # 16 tasks, 4 per step: 4 steps per epoch, so step 3 is mid-epoch and the resumed run skips into epoch 0, then
    # starts epoch 1 with the reshuffled (seeded) order
    args = MetaTrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=STEPS,
                                 learning_rate=1e-2, save_strategy="steps", save_steps=SAVE_AT, logging_strategy="no",
                                 disable_tqdm=True, inner_lr=INNER_LR, inner_steps=INNER_STEPS, seed=0, use_cpu=True,
                                 **kw)
    return MetaTrainer(model=model, args=args, train_dataset=_records())


def _state(trainer) -> dict[str, np.ndarray]:
    """Dense parameters and the whole table (gathered when sharded) after training."""
    learner = trainer.accelerator.unwrap_model(trainer.model)
    emb = learner.model.embeddings
    out = {n: p.detach().numpy().copy() for n, p in learner.named_parameters() if "embeddings" not in n}
    out["table"] = (emb.gather_full_weight() if getattr(emb, "is_sharded", False) else emb.weight.detach()).numpy()
    return out


def _probe_batch() -> dict[str, torch.Tensor]:
    from gmeta_trainer import collate_tasks

    recs = _records().with_format("numpy")
    return collate_tasks([recs[i] for i in range(4)])


def _probe(learner) -> np.ndarray:
    """Query logits after adaptation on a fixed batch (a collective when sharded: every rank passes the same one)."""
    learner.eval()
    with torch.no_grad():
        return learner(**_probe_batch())["logits"].numpy().copy()


def _two_rank_job(rank: int, world: int, out: str) -> dict:
    import torch.distributed as dist

    from gmeta_trainer import export_consolidated

    root = Path(out)
    straight = _trainer(str(root / "straight"), TASKS_PER_RANK, shard=True)
    straight.train()
    res = {"straight": _state(straight), "probe": _probe(straight.accelerator.unwrap_model(straight.model)),
           "meta_io_batches": straight.meta_io_stats.items}
    ckpt = root / "straight" / f"checkpoint-{SAVE_AT}"

    resumed = _trainer(str(root / "resumed"), TASKS_PER_RANK, shard=True)
    resumed.train(resume_from_checkpoint=str(ckpt))
    res["resumed"] = _state(resumed)

    plain = _trainer(str(root / "plain_io"), TASKS_PER_RANK, shard=True, meta_io_prefetch=False)
    plain.train()
    res["plain_io"] = _state(plain)

    if rank == 0:
        export_consolidated(ckpt, root / "export3")
    dist.barrier()
    from_export = _trainer(str(root / "from_export"), TASKS_PER_RANK, shard=True)
    from_export.train(resume_from_checkpoint=str(root / "export3"))
    res["from_export"] = _state(from_export)

    # the best-model reload goes through the shard files too
    straight.state.best_model_checkpoint = str(ckpt)
    straight._load_best_model()
    res["best"] = _state(straight)
    return res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gmeta_ckpt")
    res = run_distributed(_two_rank_job, 2, str(out), timeout=600)
    return out, res


def _assert_equal(a: dict, b: dict, what: str) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{what}: {name}")


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_with_sharded_tables_equals_uninterrupted_run(two_ranks):
    out, res = two_ranks
    start = _state_of_fresh_model()
    for rank, r in enumerate(res):
        for name in start:
            assert not np.array_equal(r["straight"][name], start[name]), f"{name} did not train"
        _assert_equal(r["straight"], r["resumed"], f"rank {rank} resumed at step {SAVE_AT}")
        _assert_equal(r["straight"], r["plain_io"], f"rank {rank} Meta-IO read-ahead vs the Trainer's reading")
        _assert_equal(r["straight"], r["from_export"], f"rank {rank} resumed from the consolidated export")
        assert r["meta_io_batches"] > 0, "the training loader did not read through Meta-IO"
    ckpt = out / "straight" / f"checkpoint-{SAVE_AT}"
    index = json.loads((ckpt / "gmeta_shards" / "index.json").read_text())
    assert index["world_size"] == 2 and index["step"] == SAVE_AT
    assert [p["rows"]["embeddings"] for p in index["parts"]] == [[0, 24], [24, 48]]
    assert set(index["optimizer_state"]) == {"exp_avg", "exp_avg_sq", "step"}
    from safetensors.torch import load_file

    dense = load_file(str(ckpt / "model.safetensors"))
    assert not any("embeddings" in k for k in dense), "the checkpoint's model file must not gather the tables"
    shard1 = load_file(str(ckpt / "gmeta_shards" / "rank-00001-of-00002.safetensors"))
    assert shard1["embeddings.weight"].shape == shard1["embeddings.optim.exp_avg"].shape == (24, 8)
    assert "state" in torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert not list(ckpt.rglob(".*.tmp")), "temporary files left behind"


def _state_of_fresh_model() -> dict[str, np.ndarray]:
    from gmeta_trainer import MetaLearner

    learner = MetaLearner(_model())
    out = {n: p.detach().numpy().copy() for n, p in learner.named_parameters() if "embeddings" not in n}
    out["table"] = learner.model.embeddings.weight.detach().numpy().copy()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_consolidated_export_loads_on_one_rank(two_ranks, tmp_path):
    from safetensors.torch import load_file

    from gmeta_trainer import CheckpointMismatchError, MetaLearner, export_consolidated, load_checkpoint_weights
    from gmeta_trainer.__main__ import main

    out, res = two_ranks
    final = out / "straight" / f"checkpoint-{STEPS}"
    export = export_consolidated(final, tmp_path / "export")
    # the export's model file is the plain (unsharded) model: it loads with load_state_dict as is
    state = load_file(str(export / "model.safetensors"))
    np.testing.assert_array_equal(state["model.embeddings.weight"].numpy(), res[0]["straight"]["table"])
    plain = _model()
    plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    np.testing.assert_allclose(_probe(MetaLearner(plain, _inner())), res[0]["probe"], rtol=1e-6, atol=1e-7)
    # the per-rank checkpoint's weights also load on one rank (every part is read)
    learner = MetaLearner(_model(), _inner())
    load_checkpoint_weights(learner, final)
    np.testing.assert_allclose(_probe(learner), res[0]["probe"], rtol=1e-6, atol=1e-7)

    # resuming on 1 rank: per-rank shards are refused with the fix; the export (rows and their optimizer state)
    # continues, on the same 4 tasks per step, to the 2-rank result
    with pytest.raises(CheckpointMismatchError, match=r"saved by 2 ranks.*python -m gmeta_trainer export"):
        _trainer(str(tmp_path / "one"), 2 * TASKS_PER_RANK, shard=False).train(
            resume_from_checkpoint=str(out / "straight" / f"checkpoint-{SAVE_AT}"))
    one = _trainer(str(tmp_path / "one_from_export"), 2 * TASKS_PER_RANK, shard=False)
    one.train(resume_from_checkpoint=str(out / "export3"))
    got = _state(one)
    for name, value in res[0]["straight"].items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)

    # the CLI writes the same export
    assert main(["export", str(final), str(tmp_path / "cli_export")]) == 0
    again = load_file(str(tmp_path / "cli_export" / "model.safetensors"))
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    with pytest.raises(SystemExit) as exc:
        main(["export", "--help"])
    assert exc.value.code == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_best_model_reload_reads_the_shards(two_ranks):
    from safetensors.torch import load_file

    out, res = two_ranks
    export3 = load_file(str(out / "export3" / "model.safetensors"))
    for r in res:
        np.testing.assert_array_equal(r["best"]["table"], export3["model.embeddings.weight"].numpy())
        np.testing.assert_array_equal(r["best"]["model.top.0.weight"], export3["model.top.0.weight"].numpy())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_checkpoints_get_errors_that_name_the_problem_and_the_fix(two_ranks, tmp_path):
    from gmeta_trainer import (
        CheckpointMismatchError,
        CorruptCheckpointError,
        IncompleteCheckpointError,
        MetaLearner,
        export_consolidated,
        load_checkpoint_weights,
    )

    out, _ = two_ranks
    good = out / "straight" / f"checkpoint-{SAVE_AT}"
    shard1 = Path("gmeta_shards") / "rank-00001-of-00002.safetensors"

    ck = _copy(good, tmp_path / "missing" / "checkpoint-3")
    (ck / shard1).unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"rank-00001-of-00002.safetensors \(the shard of rank 1\) "
                                                        r"is missing.*copy every rank's"):
        load_checkpoint_weights(MetaLearner(_model()), ck)

    ck = _copy(good, tmp_path / "truncated" / "checkpoint-3")
    data = (ck / shard1).read_bytes()
    (ck / shard1).write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        export_consolidated(ck, tmp_path / "never")
    assert not (tmp_path / "never").exists()

    ck = _copy(good, tmp_path / "altered" / "checkpoint-3")
    data = bytearray((ck / shard1).read_bytes())
    data[-3] ^= 0xFF  # same size, one row value changed
    (ck / shard1).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="sha256"):
        load_checkpoint_weights(MetaLearner(_model()), ck)

    ck = _copy(good, tmp_path / "badjson" / "checkpoint-3")
    (ck / "gmeta_shards" / "index.json").write_text('{"format": ')
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load_checkpoint_weights(MetaLearner(_model()), ck)

    # a save interrupted before the index: resume names the complete checkpoint next to it
    run = tmp_path / "interrupted"
    _copy(good, run / "checkpoint-3")
    ck = _copy(good, run / "checkpoint-6")
    (ck / "gmeta_shards" / "index.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"interrupted.*\['checkpoint-3'\]"):
        _trainer(str(run), TASKS_PER_RANK, shard=False).train(resume_from_checkpoint=str(ck))
    ck = _copy(good, tmp_path / "nostate" / "checkpoint-3")
    (ck / "trainer_state.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="trainer_state.json"):
        _trainer(str(tmp_path / "nostate"), TASKS_PER_RANK, shard=False).train(resume_from_checkpoint=str(ck))

    with pytest.raises(CheckpointMismatchError, match=r"vocab_sizes=\[40, 8\].*model has vocab_sizes=\[41, 8\]"):
        load_checkpoint_weights(MetaLearner(_model(vocab=(41, 8))), good)
    with pytest.raises(FileExistsError, match="overwrite"):
        export_consolidated(good, tmp_path / "altered")


def test_atomic_write_leaves_the_previous_file_when_the_writer_crashes(tmp_path):
    from gmeta_trainer.checkpoint import atomic_write

    target = tmp_path / "state.bin"
    atomic_write(target, lambda tmp: Path(tmp).write_bytes(b"old, complete"))

    def crash(tmp: str) -> None:
        Path(tmp).write_bytes(b"new, half")
        raise KeyboardInterrupt  # the process is stopped mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, crash)
    assert target.read_bytes() == b"old, complete"
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"], "the temporary file was not removed"
