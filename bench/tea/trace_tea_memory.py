"""Peak live heap bytes and RSS of a LightTEA run per (round, stage, call), on a synthetic pair (issue 20).

`bench_tea_scale.py` keeps one peak per stage over all rounds; this trace splits it by round and by the engine call
running (propagation, triple-view operands, sums, the search, Sinkhorn), which is what says which matrix a peak
holds. A thread samples glibc's live bytes (``mallinfo2``) and the RSS every 2 ms. Prints a table; nothing is
written to ``bench/results``.

    python bench/tea/trace_tea_memory.py --scale 4
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tea_scale import malloc_live_gb, rss_gb  # noqa: E402

CALLS = ("propagate_labels", "triple_operands", "triple_sums", "triple_sums_into", "_search_rows_with_facts",
         "sparse_sinkhorn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="Multiple of YAGO-WIKI50K's size.")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--search", default="exact", help="candidate_search of the run.")
    args = ap.parse_args()
    from tea_pipeline import LightTEA, LightTEAConfig, engine
    from tea_pipeline.synthetic import make_scaled_pair

    live = malloc_live_gb()
    if live is None:
        sys.exit("trace_tea_memory needs glibc's mallinfo2 (Linux, glibc >= 2.33).")
    state = {"call": "-", "stop": False}
    peaks: dict[tuple, list[float]] = {}
    model: LightTEA | None = None

    def sample() -> None:
        while not state["stop"]:
            key = (model._round if model else 0, (model.current_stage if model else None) or "-", state["call"])
            p = peaks.setdefault(key, [0.0, 0.0])
            p[0], p[1] = max(p[0], live()), max(p[1], rss_gb())
            time.sleep(0.002)

    def wrap(name: str) -> None:
        fn = getattr(engine, name)

        def traced(*a, **k):
            prev, state["call"] = state["call"], name
            try:
                return fn(*a, **k)
            finally:
                state["call"] = prev

        setattr(engine, name, traced)

    for name in CALLS:
        wrap(name)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    pair = make_scaled_pair(args.scale)
    model = LightTEA(LightTEAConfig(rounds=args.rounds, candidate_search=args.search))
    result = model.fit(pair)
    state["stop"] = True
    thread.join()
    print(f"{args.scale:g}x: wall {time.perf_counter() - t0:.1f} s, H@1 {result.final['hits@1']:.4f}")
    print("stage seconds:", {k: round(v, 1) for k, v in result.timings.items()})
    print(f"{'round':>5} {'stage':<20} {'call':<24} {'live GB':>8} {'RSS GB':>8}")
    for (rnd, stage, call), (lv, rs) in peaks.items():
        print(f"{rnd:>5} {stage:<20} {call:<24} {lv:8.2f} {rs:8.2f}")


if __name__ == "__main__":
    main()
