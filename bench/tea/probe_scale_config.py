"""One LightTEA run on `make_scaled_pair(scale)` with config overrides: which setting costs accuracy at scale.

`bench_tea_scale.py` runs the default configuration only. This probe runs one size with overrides and prints one
JSON record: wall time (generation + fit), final and per-round metrics, and peak RSS (``ru_maxrss``).

    python bench/tea/probe_scale_config.py 4 candidate_dim=512 > bench/results/tea_scale_4x_candidate_dim512.json

Values are integers, or ``None``.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    import torch  # noqa: PLC0415

    from tea_pipeline import LightTEA, LightTEAConfig  # noqa: PLC0415
    from tea_pipeline.synthetic import make_scaled_pair  # noqa: PLC0415

    scale, overrides = float(argv[0]), {}
    for item in argv[1:]:
        key, _, value = item.partition("=")
        overrides[key] = None if value == "None" else int(value)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    pair = make_scaled_pair(scale, seed=0)
    result = LightTEA(LightTEAConfig(**overrides)).fit(pair)
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    record = {"scale": scale, "overrides": overrides, "wall_s": round(time.perf_counter() - t0, 1),
              "final": result.final, "peak_rss_gb": round(peak_rss_gb, 2), "rounds": [vars(r) for r in result.rounds]}
    print(json.dumps(record, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
