"""torchrun worker of the two-node AntDT tests (tests/multinode): examples/antdt/train_worker.py as is, plus a pause.

``--pause-at STEP --marker PATH``: in the first attempt (``PATH`` does not exist yet when the worker starts), node
1's ranks stop at the beginning of optimizer step ``STEP`` (after the checkpoints before it are committed), the
first of them writes ``PATH`` and they sleep, so the test can kill node 1's agent and start a replacement. Node 0's
ranks block in the step's collective until node 1 dies. The re-formed job resumes from the last checkpoint; a worker
that finds ``PATH`` never pauses. Every other argument goes to ``train_worker.main``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "examples" / "antdt"))
import train_worker  # noqa: E402

PAUSE_S = 120.0  # killed by the test long before this ends


class PausingInjector(train_worker.FaultInjector):
    """`train_worker.FaultInjector` that also pauses node 1's ranks at ``pause_at`` (first attempt only)."""

    pause_at: int | None = None
    marker: Path | None = None
    first_attempt = False

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        if (not self.first_attempt or self.pause_at is None or os.environ["HFSP_NODE"] != "1"
                or state.global_step != self.pause_at):
            return
        print(f"[pause] rank {os.environ['RANK']} on node 1 pauses at step {state.global_step}", flush=True)
        tmp = self.marker.with_name(f"{self.marker.name}.{os.getpid()}")
        tmp.write_text(str(state.global_step))
        os.replace(tmp, self.marker)
        time.sleep(PAUSE_S)
        raise SystemExit("node 1 was not killed while paused")


def main() -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--pause-at", type=int, default=None)
    ap.add_argument("--marker", default=None)
    ours, rest = ap.parse_known_args()
    if ours.pause_at is not None:
        if ours.marker is None:
            ap.error("--pause-at needs --marker")
        PausingInjector.pause_at, PausingInjector.marker = ours.pause_at, Path(ours.marker)
        PausingInjector.first_attempt = not Path(ours.marker).exists()  # decided before anyone writes it
    train_worker.FaultInjector = PausingInjector  # main() builds its callbacks from the module's name
    return train_worker.main(rest)


if __name__ == "__main__":
    sys.exit(main())
