"""torchrun worker for the re-formation test (tests/multinode): data-parallel SGD on a linear model with a
checkpoint per step. In the first attempt every rank stops after ``--pause-after`` steps (rank 0 then writes
``--marker``): node 1's ranks sleep, node 0's ranks wait in a barrier, so the test can kill node 1's agent and start
a replacement. The re-formed job resumes from the checkpoint; rank 0 prints the applied-step log and saves the
weights to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_common import COLLECTIVE_TIMEOUT_S, emit, node_of_rank, sample  # noqa: E402

from hf_placement import release_process_groups


def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a node killed mid-save never leaves a torn checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pause-after", type=int, default=2)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--marker", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ckpt, marker = Path(args.ckpt), Path(args.marker)
    pause = not marker.exists()  # decided before anyone writes it: only the first attempt pauses
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(8, 1)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start, log = 0, []
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        start, log = state["step"] + 1, state["log"]
    for step in range(start, args.steps):
        sid = step * world + rank  # the sample this rank owns at this step
        x, y = sample(sid)
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        ids = [None] * world
        dist.all_gather_object(ids, sid)
        log.append({"step": step, "samples": ids, "world": world})
        if rank == 0:
            _save(ckpt, {"step": step, "model": model.state_dict(), "log": log})
        dist.barrier()  # the checkpoint of this step is on disk before anyone moves on
        if pause and step + 1 == args.pause_after:
            if rank == 0:
                marker.write_text("paused")
            if node_of_rank() == 1:
                time.sleep(COLLECTIVE_TIMEOUT_S)  # killed by the test long before this ends
                raise SystemExit("node 1 was not killed while paused")
            dist.barrier()  # blocks until node 1's ranks die, then fails: the agent restarts its workers
            raise SystemExit("the barrier across the paused job returned")
    if rank == 0:
        torch.save(model.state_dict(), args.out)
        emit({"rank": rank, "node": node_of_rank(), "resumed_from": start, "log": log,
              "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
    dist.barrier()  # no rank closes its sockets while a peer is still in the last collective
    release_process_groups()


if __name__ == "__main__":
    main()
