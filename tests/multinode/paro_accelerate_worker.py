"""accelerate-launch worker (tests/multinode): `ParoAccelerator` with the PaRO settings from ``PARO_CONFIG_FILE``
trains the tiny GPT-2 a few steps on this rank's slice of the fixed batches. Prints one JSON report line per rank
(launcher variables, the engine's groups and the nodes they span); rank 0 saves the consolidated weights to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_common import emit, topology_report  # noqa: E402

from accelerate_plugins import ParoAccelerator  # noqa: E402
from paro_zero_backend.testing import make_adamw, make_batches, tiny_gpt2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = ParoAccelerator(cpu=True)  # PaRO settings: ParoPlugin.from_env() (PARO_CONFIG_FILE)
    model = tiny_gpt2()
    engine, optimizer = accelerator.prepare(model, make_adamw(model.parameters()))
    report = topology_report(engine.topology)
    report["strategy"] = engine.strategy.name
    data = make_batches(args.steps, 1, accelerator.num_processes)
    losses = []
    for step in range(args.steps):
        ids = data[step, 0, accelerator.process_index]
        loss = engine(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    report["losses"] = losses
    state = accelerator.get_state_dict(engine)  # collective: full fp32 weights on every rank
    if accelerator.is_main_process:
        torch.save(state, args.out)
    emit(report)
    # everyone past the last collective before any rank tears its sockets down: a peer closing mid-collective makes
    # gloo abort the process at exit ("terminate called without an active exception"), failing the agent
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
