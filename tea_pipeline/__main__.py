"""``python -m tea_pipeline align --data DIR --seeds N [--device D] [--output DIR]``: LightTEA from the shell.

Every `LightTEAConfig` field is also a flag (``--top-k 500``, ``--reference-compat``, ...); ``--config FILE.json``
loads a config first and flags override it. The output folder receives ``metrics.json`` (``final`` hits@1 / hits@10 /
mrr, per-round metrics, per-stage timings) and ``alignment.tsv`` (one predicted pair per test source entity).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import MISSING, fields
from pathlib import Path

from .config import LightTEAConfig

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _field_type(f) -> type:
    t = str(f.type)
    if "bool" in t:
        return bool
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tea_pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    align = sub.add_parser("align", help="align the entities of a TKG pair folder",
                           description="Align the entities of two temporal KGs with LightTEA (IJCAI 2023).")
    align.add_argument("--data", required=True, help="folder in the TEA-GNN layout (ent_ids_1, triples_1, ...) or "
                       "a folder of <table>.parquet files")
    align.add_argument("--seeds", required=True, type=int, help="number of seed pairs: the first N of sup_pairs "
                       "then ref_pairs (DICEWS: 1000 or 200, YAGO-WIKI50K: 5000 or 1000, YAGO-WIKI20K: 400)")
    align.add_argument("--output", default=None, help="folder for metrics.json and alignment.tsv")
    align.add_argument("--config", default=None, help="JSON file with LightTEAConfig fields (flags override it)")
    align.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    align.add_argument("--cache-dir", default=None, help="datasets cache folder for the Arrow copies")
    align.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = align.add_argument_group("LightTEAConfig")
    for f in fields(LightTEAConfig):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if _field_type(f) is bool:
            group.add_argument(flag, dest=f.name, nargs="?", const=True, default=None,
                               type=lambda v: _BOOL[v.lower()], help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_field_type(f), default=None, help=help_text)
    return parser


def _config_from_args(args: argparse.Namespace) -> LightTEAConfig:
    values = json.loads(Path(args.config).read_text()) if args.config else {}
    for f in fields(LightTEAConfig):
        v = getattr(args, f.name)
        if v is not None:
            values[f.name] = v
    return LightTEAConfig.from_dict(values)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def align(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from . import LightTEA, TKGDataError, load_tkg_pair  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = _config_from_args(args)
    except (ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    print(f"[tea_pipeline] loading {args.data} with {args.seeds} seeds", flush=True)
    try:
        pair = load_tkg_pair(args.data, args.seeds, cache_dir=args.cache_dir)
    except TKGDataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - wall
    summary = pair.summary()
    print(f"[tea_pipeline] loaded in {load_s:.1f}s: " + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    model = LightTEA(config)
    result = model.fit(pair, progress=not args.no_progress)
    wall_s = time.perf_counter() - wall
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    rows = [[str(r.round), f"{r.hits_at_1:.4f}", f"{r.hits_at_10:.4f}", f"{r.mrr:.4f}", str(r.num_train_pairs),
             str(r.pseudo_seeds_added),
             "-" if r.pseudo_seed_precision is None else f"{r.pseudo_seed_precision:.3f}", f"{r.seconds:.1f}"]
            for r in result.rounds]
    print()
    print(format_table(["round", "H@1", "H@10", "MRR", "train pairs", "pseudo added", "precision", "s"], rows))
    timings = {"load": load_s, **result.timings}
    print()
    print(format_table(["stage", "seconds", "share"],
                       [[k, f"{v:.2f}", f"{100 * v / wall_s:.0f}%"] for k, v in timings.items()]))
    print(f"\nfinal: H@1 {result.final['hits@1']:.4f}  H@10 {result.final['hits@10']:.4f}  "
          f"MRR {result.final['mrr']:.4f}  wall {wall_s:.1f}s  peak RSS {peak_rss_gb:.2f} GB  "
          f"device {result.device}")
    if args.output:
        out = result.save(args.output, pair)
        metrics = json.loads((out / "metrics.json").read_text())
        metrics.update({"wall_s": wall_s, "load_s": load_s, "peak_rss_gb": peak_rss_gb, "data_dir": str(args.data),
                        "threads": torch.get_num_threads()})
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {out / 'metrics.json'} and {out / 'alignment.tsv'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "align":
        return align(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
