"""Command line: ``python -m gmeta_trainer build-tasks ...`` turns interactions into Meta-IO task records on disk;
``python -m gmeta_trainer export ...`` consolidates a checkpoint with row-sharded tables.

Examples::

    # MovieLens-100K cold-start split (train / valid / test users), atomic or GroupLens layout
    python -m gmeta_trainer build-tasks --movielens ../shared/data/movielens/ml-100k --out tasks/ml100k

    # any interaction table (.parquet, .csv, .json/.jsonl, or a datasets save_to_disk folder)
    python -m gmeta_trainer build-tasks --interactions clicks.parquet --task-column user_id \\
        --sparse-columns item_id,category --dense-columns price --label-column click --out tasks/clicks

    # per-rank shards of a 2-rank run -> one checkpoint that loads (and resumes) on any world size
    python -m gmeta_trainer export out/checkpoint-500 out/checkpoint-500-consolidated
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .meta_io import MetaIOConfig, build_task_records


def _load_interactions(path: Path):
    import datasets

    if path.is_dir():
        return datasets.load_from_disk(str(path))
    kind = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix)
    if kind is None:
        raise SystemExit(f"--interactions {path}: unsupported file type {path.suffix!r}; use .parquet, .csv, "
                         ".json/.jsonl or a datasets save_to_disk folder.")
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def _split(value: str) -> list[str]:
    return [v for v in value.split(",") if v] if value else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gmeta_trainer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-tasks", help="group interactions into padded support/query task records (Arrow)")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--movielens", type=Path, help="MovieLens-100K folder; writes train/valid/test cold-start splits")
    src.add_argument("--interactions", type=Path, help="interaction table (.parquet/.csv/.jsonl or a dataset folder)")
    b.add_argument("--out", type=Path, required=True, help="output folder (memory-mappable Arrow records)")
    b.add_argument("--task-column", default="user_id")
    b.add_argument("--label-column", default="label")
    b.add_argument("--sparse-columns", default="", help="comma-separated integer-coded categorical columns")
    b.add_argument("--dense-columns", default="", help="comma-separated real-valued (scalar or list) columns")
    b.add_argument("--time-column", default="timestamp")
    b.add_argument("--split", choices=("time", "random"), default="time")
    b.add_argument("--support-size", type=int, default=None, help="minimum support size (default 10; 3 for ML)")
    b.add_argument("--query-size", type=int, default=10)
    b.add_argument("--max-support-size", type=int, default=None, help="padded support slots (default 20 for ML)")
    b.add_argument("--small-tasks", choices=("error", "drop"), default="error")
    b.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("export", help="consolidate a checkpoint with row-sharded tables (per-rank shard files) into "
                                      "one that loads on any world size",
                       description="Read every rank's gmeta_shards/ files of CHECKPOINT and write OUT: "
                                   "model.safetensors with the dense parameters and the full tables under their "
                                   "unsharded names (loads into the unsharded model), the optimizer state of all "
                                   "rows, and the Trainer's files, so `trainer.train(resume_from_checkpoint=OUT)` "
                                   "continues on any number of ranks. Runs in one process; no process group needed.")
    e.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                   help="checkpoint directory holding gmeta_shards/ (e.g. out/checkpoint-500)")
    e.add_argument("out", type=Path, metavar="OUT", help="output directory (must not exist unless --overwrite)")
    e.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)

    if args.command == "export":
        from .checkpoint import CheckpointError, read_index
        from .export import export_consolidated

        try:
            out = export_consolidated(args.checkpoint, args.out, overwrite=args.overwrite)
        except (CheckpointError, FileExistsError, ValueError) as exc:
            raise SystemExit(f"export failed: {exc}") from exc
        index = read_index(out)
        tables = ", ".join(f"{n} ({t['rows']} x {t['embedding_dim']})" for n, t in index["tables"].items())
        print(f"exported step {index['step']} of {index['source_world_size']} rank(s) -> {out}: {tables}")
        return 0

    if args.movielens is not None:
        from .data import movielens_cold_start

        data = movielens_cold_start(args.movielens)
        cfg = MetaIOConfig(task_column="user_id", label_column="label", sparse_columns=data.sparse_columns,
                           dense_columns=data.dense_columns, time_column="timestamp", split=args.split,
                           support_size=args.support_size or 3, query_size=args.query_size,
                           max_support_size=args.max_support_size or 20, small_tasks=args.small_tasks,
                           seed=args.seed)
        parts = {"train": data.train, "valid": data.valid, "test": data.test}
        print(f"vocab_sizes={data.vocab_sizes} num_dense={data.num_dense} sparse={data.sparse_columns}")
    else:
        cfg = MetaIOConfig(task_column=args.task_column, label_column=args.label_column,
                           sparse_columns=_split(args.sparse_columns), dense_columns=_split(args.dense_columns),
                           time_column=args.time_column if args.split == "time" else None, split=args.split,
                           support_size=args.support_size or 10, query_size=args.query_size,
                           max_support_size=args.max_support_size, small_tasks=args.small_tasks, seed=args.seed)
        parts = {"tasks": _load_interactions(args.interactions)}
    for name, interactions in parts.items():
        out = args.out / name if len(parts) > 1 else args.out
        records = build_task_records(interactions, cfg, output_dir=str(out))
        print(f"{name}: {len(records)} tasks -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
