"""PPO under a FlexRLHF placement with `PPOTrainer(..., placement=...)`, on CPU gloo ranks, with a timeline picture.

Launchers (tiny local models, no hub access; every rank uses 1 thread):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/placement/ppo_placement.py --placement disaggregated \\
        --out /tmp/ppo_placement
    OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 examples/placement/ppo_placement.py \\
        --placement interleaved --out /tmp/ppo_placement

(`--multi_gpu` selects Accelerate's torchrun launcher; without a GPU the trainer runs on CPU/gloo because the config
sets ``use_cpu``.) ``--placement`` takes ``colocated``, ``interleaved``, ``disaggregated`` or a YAML plan file (see
``python -m hf_placement plan --help`` to pick one). Rank 0 writes ``timeline_<placement>.png`` (one row per rank,
one colour per phase), the Chrome trace ``timeline_<placement>.json`` and ``result_<placement>.json``.

`train_rank` is the same job as a function, for `hf_placement.run_distributed` (the notebook
``examples/notebooks/rlhf_placement.ipynb`` uses it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from hf_placement import release_process_groups


def build_trainer(placement: str, output_dir: str, iterations: int = 3, per_device: int = 4,
                  response_length: int = 8, num_mini_batches: int = 2, max_staleness: int = 0):
    """A tiny PPO job (character tokenizer, 2-layer GPT-2 policy/value, a reward for emitting ``z``)."""
    import torch.distributed as dist

    from trl_trainers import PPOConfig, PPOTrainer
    from trl_trainers.testing import (
        TargetTokenRewardModel,
        char_tokenizer,
        prompt_dataset,
        tiny_causal_lm,
        tiny_value_model,
    )

    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    tok = char_tokenizer()
    args = PPOConfig(
        output_dir=output_dir, per_device_train_batch_size=per_device, num_mini_batches=num_mini_batches,
        num_ppo_epochs=2, response_length=response_length, learning_rate=3e-3,
        total_episodes=per_device * world * iterations, bf16=False, report_to="none", disable_tqdm=True,
        temperature=1.0, num_sample_generations=0, save_strategy="no", gradient_checkpointing=False, seed=7,
        stop_token="eos", loss_normalization="mini_batch", local_rollout_forward_batch_size=per_device,
        use_cpu=True, placement=placement, placement_timeout_s=300.0, max_staleness=max_staleness,
    )
    trainer = PPOTrainer(args, tok, tiny_causal_lm(len(tok), 0), None,
                         TargetTokenRewardModel(tok.convert_tokens_to_ids("z")), prompt_dataset(tok, 64, exclude="z"),
                         tiny_value_model(len(tok), 1))
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ != "PrinterCallback"]
    return trainer


def train_rank(rank: int, world_size: int, placement: str, out_dir: str, iterations: int = 3) -> dict[str, Any]:
    """Train under ``placement``; every rank returns its summary, rank 0 writes the timeline PNG and trace."""
    import torch

    from hf_placement.runtime import plot_timeline, summarize_timelines, write_chrome_trace

    torch.set_num_threads(1)
    label = Path(placement).stem
    trainer = build_trainer(placement, f"{out_dir}/{label}", iterations=iterations)
    trainer.train()
    timelines = trainer.gather_timeline()
    scores = [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h]
    summary = summarize_timelines(timelines)
    out = {"placement": label, "rank": rank, "roles": trainer.plan.roles_of(rank),
           "trains": trainer.is_training_rank, "scores": scores,
           "busy_s": {r: v["busy_s"] for r, v in summary["ranks"].items()},
           "idle_s": {r: v["idle_s"] for r, v in summary["ranks"].items()},
           "checksum": float(sum(p.detach().double().sum() for p in trainer.model.parameters()))}
    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        out["png"] = str(plot_timeline(timelines, Path(out_dir) / f"timeline_{label}.png",
                                       title=f"PPO, {label} placement, {world_size} ranks"))
        out["trace"] = str(write_chrome_trace(Path(out_dir) / f"timeline_{label}.json", timelines))
        (Path(out_dir) / f"result_{label}.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="PPO under a placement (run under torchrun or accelerate launch).")
    parser.add_argument("--placement", default="disaggregated",
                        help="colocated | interleaved | disaggregated | path to a YAML/JSON plan")
    parser.add_argument("--out", default="ppo_placement", help="output folder (rank 0 writes the timeline there)")
    parser.add_argument("--iterations", type=int, default=3, help="PPO iterations")
    ns = parser.parse_args()
    import torch.distributed as dist

    from trl_trainers._distributed import init_distributed_from_env

    init_distributed_from_env(timeout_s=300.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = train_rank(rank, world, ns.placement, ns.out, ns.iterations)
    print(f"rank {rank}/{world} [{','.join(out['roles'])}] trains={out['trains']} scores={out['scores']} "
          f"checksum={out['checksum']:.6f}" + (f" timeline={out['png']}" if rank == 0 else ""), flush=True)
    if dist.is_initialized():
        dist.barrier()
        release_process_groups()


if __name__ == "__main__":
    main()
