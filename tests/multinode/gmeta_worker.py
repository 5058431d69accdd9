"""torchrun worker of the two-node G-Meta test (tests/multinode): MetaTrainer on a DLRM whose embedding tables are
row-sharded over every rank of the job (both nodes), so each lookup is an all-to-all across the inter-node link.

The job, on every rank: (1) train ``STEPS`` optimizer steps straight, writing the sharded checkpoint at ``SAVE_AT``
(one shard file per rank); (2) a new trainer resumes from that checkpoint and trains to ``STEPS``. Rank 0 saves
both runs' dense parameters and gathered tables to ``--out``; every rank prints a JSON report (node, rows held).
`build_trainer` is also the test's single-process reference (the same configuration, unsharded, on one rank).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _multinode_common import COLLECTIVE_TIMEOUT_S, emit, node_of_rank  # noqa: E402

from hf_placement import release_process_groups

STEPS, SAVE_AT, GLOBAL_TASKS = 6, 3, 4  # 16 tasks, 4 per step: the checkpoint at step 3 is mid-epoch


def records():
    from gmeta_trainer import MetaIOConfig, build_task_records, make_synthetic_interactions

    inter = make_synthetic_interactions(num_users=16, num_items=40, min_interactions=14, max_interactions=20, seed=3)
    return build_task_records(inter, MetaIOConfig(sparse_columns=["item_id", "category"], dense_columns=["dense"],
                                                  support_size=6, query_size=6))


def build_trainer(out: str, world: int, shard: bool):
    """MetaTrainer of the test's configuration: ``GLOBAL_TASKS`` tasks per optimizer step over ``world`` ranks."""
    from gmeta_trainer import DLRMConfig, DLRMModel, MetaTrainer, MetaTrainingArguments, shard_embeddings

    torch.manual_seed(0)
    model = DLRMModel(DLRMConfig(vocab_sizes=[40, 8], num_dense=4, embedding_dim=8, bottom_mlp=[8], top_mlp=[16],
                                 seed=0))
    if shard:
        shard_embeddings(model)
    # gradient clipping on: the global norm includes the sharded rows' squared norms summed over ranks (and nodes)
    args = MetaTrainingArguments(output_dir=out, per_device_train_batch_size=GLOBAL_TASKS // world, max_steps=STEPS,
                                 learning_rate=1e-2, train_sampling_strategy="sequential", save_strategy="steps",
                                 save_steps=SAVE_AT, logging_strategy="no", disable_tqdm=True, inner_lr=0.5,
                                 inner_steps=2, max_grad_norm=0.05, seed=0, use_cpu=True, report_to="none")
    return MetaTrainer(model=model, args=args, train_dataset=records())


def state_of(trainer) -> dict[str, torch.Tensor]:
    """Dense parameters and the whole table (gathered when sharded: a collective) after training."""
    learner = trainer.accelerator.unwrap_model(trainer.model)
    emb = learner.model.embeddings
    out = {n: p.detach().clone() for n, p in learner.named_parameters() if "embeddings" not in n}
    out["table"] = (emb.gather_full_weight() if getattr(emb, "is_sharded", False) else emb.weight.detach()).clone()
    return out


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True, help="output directory of the trainers (shared by the nodes)")
    parser.add_argument("--out", required=True, help="where rank 0 saves the two runs' parameters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # shard_embeddings needs the group before the Trainer exists; Accelerate adopts it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root)

    straight = build_trainer(str(root / "straight"), world, shard=True)
    straight.train()
    result = {"straight": state_of(straight)}
    emb = straight.accelerator.unwrap_model(straight.model).model.embeddings
    report = {"rank": rank, "node": node_of_rank(), "world_size": world, "rows": [emb.row_start, emb.row_end],
              "num_rows": emb.num_rows}

    resumed = build_trainer(str(root / "resumed"), world, shard=True)
    resumed.train(resume_from_checkpoint=str(root / "straight" / f"checkpoint-{SAVE_AT}"))
    result["resumed"] = state_of(resumed)
    report["resumed_step"] = resumed.state.global_step
    if rank == 0:
        torch.save(result, args.out)
    emit(report)
    dist.barrier()  # no rank closes its sockets while a peer is still in the last collective
    release_process_groups()


if __name__ == "__main__":
    main()
