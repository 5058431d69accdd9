"""Meta-IO: task records reproduce the source interactions exactly (time and random splits, padding, masks), survive
a save/memory-map round trip, and bad input gets clear errors."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from gmeta_trainer import MetaIOConfig, TaskPrefetcher, build_task_records, collate_tasks, make_synthetic_interactions


def _interactions(counts=(15, 12, 20), seed=0):
    rng = np.random.default_rng(seed)
    rows = {"user": [], "item": [], "cat": [], "feat": [], "label": [], "ts": []}
    for u, n in enumerate(counts):
        rows["user"] += [u * 10] * n
        rows["item"] += rng.integers(0, 50, n).tolist()
        rows["cat"] += rng.integers(0, 4, n).tolist()
        rows["feat"] += rng.normal(size=(n, 2)).tolist()
        rows["label"] += rng.integers(0, 2, n).astype(float).tolist()
        rows["ts"] += rng.permutation(n).astype(float).tolist()  # timestamps out of row order
    perm = rng.permutation(len(rows["user"]))  # interactions of different users interleaved
    return datasets.Dataset.from_dict({k: [v[i] for i in perm] for k, v in rows.items()})


def _cfg(**kw):
    base = dict(task_column="user", label_column="label", sparse_columns=["item", "cat"], dense_columns=["feat"],
                time_column="ts", support_size=5, query_size=4, max_support_size=9)
    base.update(kw)
    return MetaIOConfig(**base)


def test_time_split_reproduces_interactions_with_padding_and_masks(tmp_path):
    inter = _interactions()
    recs = build_task_records(inter, _cfg(), output_dir=str(tmp_path / "tasks"))
    assert recs.cache_files, "records are memory-mapped from the saved Arrow files"
    recs = recs.with_format("numpy")
    src = inter.to_pandas()
    assert list(recs["task_id"]) == [0, 10, 20]
    for r in range(len(recs)):
        row = recs[r]
        g = src[src.user == row["task_id"]].sort_values("ts")
        q, s = g.iloc[-4:], g.iloc[:-4].iloc[-9:]
        m = len(s)
        assert row["num_support"] == m == min(len(g) - 4, 9)
        np.testing.assert_array_equal(row["qry_sparse"], q[["item", "cat"]].to_numpy())
        np.testing.assert_allclose(row["qry_dense"], np.stack(q.feat.to_numpy()), rtol=1e-6)
        np.testing.assert_array_equal(row["qry_y"], q.label.to_numpy())
        np.testing.assert_array_equal(row["sup_sparse"][:m], s[["item", "cat"]].to_numpy())
        np.testing.assert_array_equal(row["sup_y"][:m], s.label.to_numpy())
        np.testing.assert_array_equal(row["sup_w"], [1.0] * m + [0.0] * (9 - m))
        assert (row["sup_sparse"][m:] == 0).all()
        assert s.ts.max() < q.ts.min()  # support strictly before query in time


def test_random_split_is_a_seeded_partition():
    inter = _interactions()
    a = build_task_records(inter, _cfg(split="random", seed=3, max_support_size=20)).with_format("numpy")
    b = build_task_records(inter, _cfg(split="random", seed=3, max_support_size=20)).with_format("numpy")
    c = build_task_records(inter, _cfg(split="random", seed=4, max_support_size=20)).with_format("numpy")
    np.testing.assert_array_equal(a["qry_sparse"], b["qry_sparse"])
    assert not np.array_equal(a["qry_sparse"], c["qry_sparse"])
    src = inter.to_pandas()
    for r in range(len(a)):
        row = a[r]
        g = src[src.user == row["task_id"]]
        m = int(row["num_support"])
        assert m == len(g) - 4
        got = sorted(map(tuple, np.concatenate([row["sup_sparse"][:m], row["qry_sparse"]]).tolist()))
        assert got == sorted(map(tuple, g[["item", "cat"]].to_numpy().tolist()))


def test_small_tasks_and_missing_columns_are_clear_errors():
    inter = _interactions(counts=(15, 6, 20))
    with pytest.raises(ValueError, match=r"1 of 3 tasks .* fewer than support_size \+ query_size = 5 \+ 4 = 9.*"
                                         r"10 \(6\).*small_tasks='drop'"):
        build_task_records(inter, _cfg())
    recs = build_task_records(inter, _cfg(small_tasks="drop"))
    assert list(recs["task_id"]) == [0, 20]
    with pytest.raises(KeyError, match=r"task column \['uid'\] not found.*available columns"):
        build_task_records(inter, _cfg(task_column="uid"))
    with pytest.raises(ValueError, match="max_support_size=3 is smaller than support_size=5"):
        _cfg(max_support_size=3)


def test_prefetcher_yields_whole_tasks_and_matches_collate():
    inter = make_synthetic_interactions(num_users=20, num_items=30, seed=1)
    recs = build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                  support_size=8, query_size=6))
    loader = TaskPrefetcher(recs, tasks_per_batch=6, shuffle=False, drop_last=True, prefetch=2)
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    ref = collate_tasks([recs.with_format("numpy")[i] for i in range(6)])
    for k, v in batches[0].items():
        torch.testing.assert_close(v, ref[k])
    assert batches[0]["sup_sparse"].shape == (6, 8, 2) and batches[0]["qry_dense"].shape == (6, 6, 4)
    # two ranks read disjoint shares of the same epoch
    seen = [set() for _ in range(2)]
    for rank in range(2):
        for b in TaskPrefetcher(recs, 3, shuffle=True, seed=5, rank=rank, world_size=2):
            seen[rank].update(b["task_id"].tolist())
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 9


def test_cli_builds_task_records_from_an_interaction_file(tmp_path, capsys):
    from gmeta_trainer.__main__ import main

    inter = make_synthetic_interactions(num_users=6, num_items=20, seed=0)
    inter.to_parquet(str(tmp_path / "clicks.parquet"))
    assert main(["build-tasks", "--interactions", str(tmp_path / "clicks.parquet"), "--sparse-columns",
                 "item_id,category", "--dense-columns", "dense", "--support-size", "8", "--query-size", "5",
                 "--out", str(tmp_path / "tasks")]) == 0
    assert "6 tasks" in capsys.readouterr().out
    from gmeta_trainer import load_task_records

    recs = load_task_records(str(tmp_path / "tasks")).with_format("numpy")
    assert recs[0]["sup_sparse"].shape == (8, 2) and recs[0]["qry_dense"].shape == (5, 4)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


def test_batch_reader_keeps_the_requested_task_order():
    from gmeta_trainer import TaskBatchReader

    recs = build_task_records(make_synthetic_interactions(num_users=12, num_items=30, seed=2),
                              MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                           support_size=8, query_size=6))
    order = [5, 2, 9, 2]
    got = TaskBatchReader(recs).read(order)
    ref = collate_tasks([recs.with_format("numpy")[i] for i in order])
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def _prefetch_threads() -> list[str]:
    import gc
    import threading

    gc.collect()
    return [t.name for t in threading.enumerate() if t.name == "gmeta-task-prefetch" and t.is_alive()]


def test_prefetcher_errors_name_the_cause_and_early_stops_leave_no_thread(monkeypatch):
    from gmeta_trainer import ReadAheadError, TaskBatchReader

    recs = build_task_records(make_synthetic_interactions(num_users=20, num_items=30, seed=1),
                              MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                           support_size=8, query_size=6))
    it = iter(TaskPrefetcher(recs, tasks_per_batch=2, shuffle=False, prefetch=2))
    next(it)
    assert _prefetch_threads() == ["gmeta-task-prefetch"]
    del it  # a loop that stops early
    assert _prefetch_threads() == []

    read, calls = TaskBatchReader.read, {"n": 0}

    def flaky(self, idx):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyError("sup_sparse")
        return read(self, idx)

    monkeypatch.setattr(TaskBatchReader, "read", flaky)
    with pytest.raises(ReadAheadError, match=r"gmeta-task-prefetch thread failed reading item 3 .*KeyError") as exc:
        list(TaskPrefetcher(recs, tasks_per_batch=2, shuffle=False, prefetch=2))
    assert isinstance(exc.value.__cause__, KeyError)
    assert _prefetch_threads() == []


def test_a_process_that_leaves_a_prefetcher_mid_epoch_exits(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from gmeta_trainer import MetaIOConfig, TaskPrefetcher, build_task_records, make_synthetic_interactions\n"
        "recs = build_task_records(make_synthetic_interactions(num_users=40, num_items=30, seed=1),\n"
        "    MetaIOConfig(sparse_columns=['item_id'], dense_columns=['dense'], support_size=8, query_size=6))\n"
        "IT = iter(TaskPrefetcher(recs, tasks_per_batch=1, prefetch=1, epochs=50))\n"
        "next(IT); next(IT)\n"  # the reader thread is blocked on a full queue when the interpreter exits
        "print('leaving')\n")
    # the subprocess timeout only turns a hang into a failure; nothing about its duration is asserted
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "leaving" in done.stdout
