"""Align a real TKG pair with LightTEA and look at the result (example for tea_pipeline).

Splits of the TEA benchmarks (folders under shared/data/tea; seeds are the first N of sup_pairs + ref_pairs):

    yw20k       YAGO-WIKI20K, 400 seeds (complete in shared/data)
    dicews-1k   ICEWS05-15, 1000 seeds      dicews-200  ICEWS05-15, 200 seeds
    wy50k-5k    YAGO-WIKI50K, 5000 seeds    wy50k-1k    YAGO-WIKI50K, 1000 seeds

DICEWS and YAGO-WIKI50K need their triples_1/triples_2 files added first (see shared/data/tea/SOURCE.md).

Usage: python examples/tea/align_tkg_pair.py [--split yw20k] [--data-root DIR] [--output DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from tea_pipeline import LightTEA, LightTEAConfig, TKGDataError, load_tkg_pair

SPLITS = {"yw20k": ("YAGO-WIKI20K", 400), "dicews-1k": ("ICEWS05-15", 1000), "dicews-200": ("ICEWS05-15", 200),
          "wy50k-5k": ("YAGO-WIKI50K", 5000), "wy50k-1k": ("YAGO-WIKI50K", 1000)}
DATA_ROOT = Path(os.environ.get("HF_SCALE_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=sorted(SPLITS), default="yw20k")
    parser.add_argument("--data-root", default=str(DATA_ROOT / "tea"))
    parser.add_argument("--output", default=None, help="folder for metrics.json and alignment.tsv")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--reference-compat", action="store_true", help="reproduce the reference code's quirks")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder, seeds = SPLITS[args.split]
    try:
        pair = load_tkg_pair(Path(args.data_root) / folder, seeds)
    except TKGDataError as err:
        print(f"cannot load {args.split}: {err}", file=sys.stderr)
        return 2
    print("data:", pair.summary())
    result = LightTEA(LightTEAConfig(reference_compat=args.reference_compat)).fit(pair, progress=True)
    for r in result.rounds:
        print(f"round {r.round}: H@1 {r.hits_at_1:.4f}  H@10 {r.hits_at_10:.4f}  MRR {r.mrr:.4f}  "
              f"+{r.pseudo_seeds_added} pseudo seeds (precision {r.pseudo_seed_precision or 0:.3f})")
    print("stage seconds:", result.timings)
    names = pair.entity_names
    print("\nmost confident predictions:")
    for i in result.scores.argsort()[::-1][:5]:
        src, pred = result.predicted[i]
        ok = "ok" if pred == result.truth[i, 1] else "WRONG"
        print(f"  {names[src]:<40} -> {names[pred]:<50} {result.scores[i]:.3f} {ok}")
    if args.output:
        print("wrote", result.save(args.output, pair))
    return 0


if __name__ == "__main__":
    sys.exit(main())
