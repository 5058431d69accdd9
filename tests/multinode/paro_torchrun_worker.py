"""torchrun worker (tests/multinode): the topology built from the launcher's LOCAL_WORLD_SIZE, and a few PaRO engine
steps on it. Prints one JSON report line per rank; rank 0 saves the consolidated weights to ``--out``."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_common import COLLECTIVE_TIMEOUT_S, emit, topology_report  # noqa: E402

from hf_placement import build_topology, release_process_groups  # noqa: E402
from paro_zero_backend import ParoConfig, ParoEngine  # noqa: E402
from paro_zero_backend.testing import make_adamw, make_batches, paro_train, tiny_gpt2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="IIG")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = build_topology(timeout_s=COLLECTIVE_TIMEOUT_S)  # no group size: the launcher's LOCAL_WORLD_SIZE decides
    report = topology_report(topo)
    model = tiny_gpt2()
    # the engine resolves its group size itself (ParoConfig without group_size), the same way the integrations do
    engine = ParoEngine(model, make_adamw(model.parameters()),
                        ParoConfig(strategy=args.strategy, timeout_s=COLLECTIVE_TIMEOUT_S))
    report["engine_group_size"] = engine.group_size
    report["engine_on_topology"] = engine.topology is topo
    report["losses"] = paro_train(engine, make_batches(args.steps, 1, world), rank)
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(state, args.out)
    emit(report)
    dist.barrier()  # no rank closes its sockets while a peer is still in the last collective
    release_process_groups()


if __name__ == "__main__":
    main()
