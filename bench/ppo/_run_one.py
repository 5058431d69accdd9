"""One PPO benchmark run in a fresh process: ``--impl ours`` (trl_trainers) or ``--impl trl`` (TRL 1.12.0's
``trl.experimental.ppo.PPOTrainer``, run from the side venv ``bench/.venv-trl112``). Prints one JSON line.

Both sides build the same tiny models from config (GPT-2 policy/reference, GPT-2 sequence classifiers for value and
reward, the character tokenizer of ``trl_trainers.testing``) with the same seeds and PPO settings, and time every
iteration from ``on_step_end`` to ``on_step_end``. Phases: ours reports its own rollout/experience/training split; for
TRL the split is taken from hooks on its module-level ``batch_generation`` (generation) and on the first
``accelerator.accumulate`` of an iteration (start of training), since its ``train()`` is one loop.

Also runs as one rank of a multi-process launch (``accelerate launch --config_file examples/ppo/deepspeed_zero3.yaml
--num_processes 2 bench/ppo/_run_one.py ...``): every rank builds the same models and the same per-device PPOConfig as
in one process (what a user's script does when launched on more processes, so the global rollout batch is
``world_size x batch``), times its own iterations and reports its own peak RSS. With ``--result-dir`` each rank
writes ``<impl>.rank<RANK>.json`` there (the parent aggregates: max over ranks); without it, rank 0 prints the line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["ours", "trl"], required=True)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--response-length", type=int, default=24)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="model vocabulary (>= the 44 tokenizer tokens)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--out", default="/tmp/bench_ppo_out")
    p.add_argument("--ddp-backend", default=None, help="PPOConfig.ddp_backend (e.g. gloo for TRL on CPU ranks)")
    p.add_argument("--no-use-cpu", action="store_true", help="do not pass use_cpu=True to PPOConfig")
    p.add_argument("--result-dir", default=None, help="write <impl>.rank<RANK>.json here instead of printing")
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from transformers import TrainerCallback

    from trl_trainers.testing import char_tokenizer, prompt_dataset, tiny_causal_lm, tiny_value_model

    if a.impl == "ours":
        from trl_trainers import PPOConfig, PPOTrainer
    else:
        import trl.experimental.ppo.ppo_trainer as trl_ppo
        from trl.experimental.ppo import PPOConfig, PPOTrainer

    tok = char_tokenizer()
    size = dict(n_layer=a.layers, n_embd=a.hidden, n_positions=128)
    vocab = max(a.vocab, len(tok))  # an LM-sized vocabulary: the sampler's logits scale with it
    policy = tiny_causal_lm(vocab, 0, **size)
    ref = tiny_causal_lm(vocab, 0, **size)
    value = tiny_value_model(vocab, 1, **size)
    reward = tiny_value_model(vocab, 2, **size)
    # one rollout of `batch` prompts per rank and iteration (TRL: local_batch_size = per-device x accumulation)
    episodes = a.batch * world * (a.iters + 1)
    dataset = prompt_dataset(tok, episodes, seed=0)
    args = PPOConfig(
        output_dir=os.path.join(a.out, a.impl), per_device_train_batch_size=a.batch // a.mini_batches,
        gradient_accumulation_steps=a.mini_batches, num_mini_batches=a.mini_batches, num_ppo_epochs=a.epochs,
        response_length=a.response_length, local_rollout_forward_batch_size=a.batch,
        total_episodes=episodes, learning_rate=1e-5, temperature=0.7, bf16=False,
        gradient_checkpointing=False, report_to="none", disable_tqdm=True, num_sample_generations=0,
        save_strategy="no", logging_strategy="no", seed=0, use_cpu=not a.no_use_cpu,
        **({"ddp_backend": a.ddp_backend} if a.ddp_backend else {}),
    )
    marks: dict[str, list[float]] = {"step_end": [], "gen_start": [], "gen_end": [], "train_start": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks["step_end"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks["step_end"].append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                marks.setdefault("scores", []).append(logs.get("objective/scores"))

    rss_models = _rss_mb()
    trainer = PPOTrainer(args, tok, policy, ref, reward, dataset, value, callbacks=[Clock()])
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ not in ("PrinterCallback", "ProgressCallback")]
    if a.impl == "trl":
        original_generation = trl_ppo.batch_generation

        def timed_generation(*args, **kwargs):
            marks["gen_start"].append(time.perf_counter())
            out = original_generation(*args, **kwargs)
            marks["gen_end"].append(time.perf_counter())
            return out

        trl_ppo.batch_generation = timed_generation
        original_accumulate = trainer.accelerator.accumulate

        def timed_accumulate(*args, **kwargs):
            if len(marks["train_start"]) < len(marks["gen_end"]):
                marks["train_start"].append(time.perf_counter())
            return original_accumulate(*args, **kwargs)

        trainer.accelerator.accumulate = timed_accumulate
    rss_before = _rss_mb()
    trainer.train()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    ends = marks["step_end"]
    iteration = [ends[i + 1] - ends[i] for i in range(len(ends) - 1)]
    if a.impl == "ours":
        # ours keeps per-iteration phase times; recompute them per iteration from the running totals
        phases = trainer.phase_history
    else:
        phases = [
            {"generation": ge - gs, "experience": ts - ge, "training": ends[i + 1] - ts}
            for i, (gs, ge, ts) in enumerate(zip(marks["gen_start"], marks["gen_end"], marks["train_start"],
                                                  strict=True))
        ]
    # time of the iteration outside the three phases (TRL: from the previous step's end to batch_generation, i.e.
    # the dataloader and, under ZeRO-3, unwrap_model_for_generation's weight gather; ours: whatever its phase clock
    # does not cover)
    phases = [{**ph, "other": it - sum(ph.get(k, 0.0) for k in ("generation", "experience", "training"))}
              for ph, it in zip(phases, iteration, strict=False)]
    import torch.distributed as tdist

    record = {
        "impl": a.impl,
        "rank": rank,
        "world_size": world,
        "ddp_backend": args.ddp_backend,
        "process_group_backend": tdist.get_backend() if tdist.is_available() and tdist.is_initialized() else None,
        "distributed_type": str(trainer.accelerator.state.distributed_type)
        if getattr(trainer, "accelerator", None) is not None else None,
        "engine": getattr(getattr(trainer, "launch", None), "source", None),
        "iteration_s": iteration,
        "phases": phases,
        "peak_rss_mb": peak_rss,
        "rss_after_models_mb": rss_models,
        "rss_before_train_mb": rss_before,
        "torch": torch.__version__,
        "trl": __import__("trl").__version__ if a.impl == "trl" else None,
        "transformers": __import__("transformers").__version__,
        "accelerate": __import__("accelerate").__version__,
        "deepspeed": _version("deepspeed"),
    }
    if a.result_dir:
        Path(a.result_dir).mkdir(parents=True, exist_ok=True)
        Path(a.result_dir, f"{a.impl}.rank{rank}.json").write_text(json.dumps(record))
    elif rank == 0:
        print(json.dumps(record), flush=True)


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    main()
