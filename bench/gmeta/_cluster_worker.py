"""One rank of the G-Meta cluster benchmark (`bench_gmeta_cluster.py`), started by `EmulatedCluster.run` in its
node's namespace with the environment torchrun would set.

Every strategy lives in this process at once (one model, optimizer and DDP wrapper each, built from the same seeds),
so the timed rounds interleave them: round ``k`` runs ``--steps`` meta-steps of every strategy, in an order rotated
by ``k``. Each strategy has its own step counter and reads the same task batches at the same step, so after the run
every strategy has taken the same steps on the same tasks and their meta-parameters can be compared.

Strategies (``--strategies``):

* ``hybrid``: G-Meta's hybrid parallelism. The table is row-sharded over the 4 ranks (`shard_embeddings`, lookups by
  ``all_to_all_single``), the dense layers are data parallel (DDP, shard excluded), dense shard gradient.
* ``hybrid_sparse``: the same with ``sparse_grad=True`` (the shard's gradient holds only the rows served).
* ``replicated_ddp_default``: every rank holds the whole table; DDP with its documented defaults all-reduces every
  gradient, the table's included (25 MB buckets, buffers broadcast every forward).
* ``replicated_ddp_tuned``: the same with one bucket for the whole model, ``gradient_as_bucket_view`` (no copy
  into and out of the buckets) and no buffer broadcast (the buffers are constants).
* ``replicated_sparse``: the whole table on every rank with a sparse gradient (``sparse_grad=True``), all-reduced
  with gloo's sparse all-reduce (it all-gathers the rows each rank touched); dense layers by tuned DDP.

Output: rank 0 prints one ``GMETA_CLUSTER {json}`` line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gmeta_trainer import DLRMConfig, DLRMModel, InnerLoopConfig, MetaLearner, shard_embeddings  # noqa: E402
from hf_placement import release_process_groups  # noqa: E402

ALL_STRATEGIES = ("hybrid", "hybrid_sparse", "replicated_ddp_default", "replicated_ddp_tuned", "replicated_sparse")
# Adagrad: the usual optimizer of recommendation tables (DLRM), and one that takes sparse gradients, so every
# strategy runs the same update. initial_accumulator_value as TensorFlow's default: the first step is then not a
# sign-like lr * g / |g|, which would turn fp32 summation-order noise on a near-zero gradient into a full step.
ADAGRAD = {"lr": 0.05, "initial_accumulator_value": 0.1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default=",".join(ALL_STRATEGIES))
    p.add_argument("--items", type=int, default=1_000_000, help="rows of the item table")
    p.add_argument("--categories", type=int, default=64, help="rows of the category table")
    p.add_argument("--dim", type=int, default=16, help="embedding width")
    p.add_argument("--tasks", type=int, default=16, help="tasks per rank per meta-step")
    p.add_argument("--support", type=int, default=10)
    p.add_argument("--query", type=int, default=10)
    p.add_argument("--skew", type=float, default=4.0, help="item popularity: id rank = items * u^skew, u uniform")
    p.add_argument("--inner-steps", type=int, default=1)
    p.add_argument("--first-order", action="store_true")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per strategy before the rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per strategy per round")
    p.add_argument("--collective-timeout", type=float, default=300.0)
    p.add_argument("--profile-phases", action="store_true", help="time forward/backward/sync/optimizer per step")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ data
def make_batch(args, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tasks of meta-step ``step`` (the same for every strategy): ``T`` tasks of ``Ks`` support and
    ``Kq`` query examples, item ids with a skewed popularity hashed over the table (hot rows spread over the shards,
    as a hashed id space does), a category, 4 dense features and a click label."""
    g = torch.Generator().manual_seed(7_919 * step + 104_729 * rank + 1)
    T, n = args.tasks, args.support + args.query
    u = torch.rand(T, n, generator=g, dtype=torch.float64)
    pop = (u.pow(args.skew) * args.items).long().clamp_max(args.items - 1)
    items = (pop * 2_654_435_761) % args.items
    cats = items % args.categories
    sparse = torch.stack([items, cats], -1)
    dense = torch.randn(T, n, 4, generator=g)
    y = (torch.rand(T, n, generator=g) < 0.3).float()
    w = torch.ones(T, n)
    ks = args.support
    return {"sup_sparse": sparse[:, :ks].contiguous(), "sup_dense": dense[:, :ks].contiguous(),
            "sup_y": y[:, :ks].contiguous(), "sup_w": w[:, :ks].contiguous(),
            "qry_sparse": sparse[:, ks:].contiguous(), "qry_dense": dense[:, ks:].contiguous(),
            "qry_y": y[:, ks:].contiguous(), "qry_w": w[:, ks:].contiguous()}


# ------------------------------------------------------------------------------------------------ strategies
def build_model(args) -> DLRMModel:
    """The DLRM every strategy starts from (identical weights on every rank and in every strategy)."""
    torch.manual_seed(0)
    cfg = DLRMConfig(vocab_sizes=[args.items, args.categories], sparse_names=["item_id", "category"], num_dense=4,
                     embedding_dim=args.dim, bottom_mlp=[32], top_mlp=[64, 32], interaction="dot", seed=0)
    return DLRMModel(cfg)


class Strategy:
    """One strategy's model, DDP wrapper and optimizer, and what it does after backward."""

    def __init__(self, name: str, args):
        self.name = name
        self.step_index = 0
        self.probe: dict[str, int] = {}
        model = build_model(args)
        self.sharded = name.startswith("hybrid")
        self.sparse = name in ("hybrid_sparse", "replicated_sparse")
        if self.sharded:
            shard_embeddings(model, sparse_grad=self.sparse)
        elif self.sparse:
            model.embeddings.sparse_grad = True
        self.model = model
        self.learner = MetaLearner(model, InnerLoopConfig(inner_lr=0.1, inner_steps=args.inner_steps,
                                                          first_order=args.first_order))
        self.table = model.embeddings.local_weight if self.sharded else model.embeddings.weight
        self.allreduce_table = name == "replicated_sparse"
        if self.allreduce_table:  # all-reduced by hand (sparse), not by DDP
            self.learner._ddp_params_and_buffers_to_ignore = ["model.embeddings.weight"]
        if name == "replicated_ddp_default":
            self.ddp_settings = {}
        else:
            self.ddp_settings = {"broadcast_buffers": False, "gradient_as_bucket_view": True}
            if name == "replicated_ddp_tuned":
                total_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
                self.ddp_settings["bucket_cap_mb"] = total_mb + 1  # the whole model in one bucket
        # every rank builds identical weights from the seeds: skip DDP's start-up broadcast of the (large) table
        self.ddp = DDP(self.learner, init_sync=False, **self.ddp_settings)
        self.opt = torch.optim.Adagrad(self.learner.parameters(), **ADAGRAD)
        # a gradient that is a view into a DDP bucket must stay allocated (zeroed, not set to None)
        self.set_to_none = not self.ddp_settings.get("gradient_as_bucket_view", False)

    def step(self, batch, phases: dict | None = None, probe: bool = False) -> float:
        t0 = time.perf_counter()
        loss = self.ddp(**batch)["loss"]
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.allreduce_table:
            g = self.table.grad.coalesce()
            dist.all_reduce(g)  # gloo: all-gathers every rank's rows, sums them (a sparse tensor of the union)
            self.table.grad = g.coalesce().div_(dist.get_world_size())
        t3 = time.perf_counter()
        if probe:  # after backward and the sync, before the update: rows, gradient and optimizer state all exist
            self.probe = self.embedding_bytes()
            t3 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.set_to_none)
        if self.sharded or self.allreduce_table:  # outside DDP, never a bucket view: drop it (no zero-fill)
            self.table.grad = None
        t4 = time.perf_counter()
        if phases is not None:
            for k, v in (("forward_s", t1 - t0), ("backward_s", t2 - t1), ("sparse_allreduce_s", t3 - t2),
                         ("optimizer_s", t4 - t3)):
                phases.setdefault(k, []).append(v)
        self.step_index += 1
        return float(loss.detach())

    def embedding_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the table, from tensor storages: the rows, their gradient and the optimizer's
        state for them (distinct storages; a gradient that is a view into a DDP bucket counts its bucket)."""
        seen: dict[int, int] = {}

        def add(t):
            if t is None:
                return 0
            if t.is_sparse:
                return add(t._indices()) + add(t._values())
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                return 0
            seen[st.data_ptr()] = st.nbytes()
            return st.nbytes()

        rows = add(self.table.data)
        grad = add(self.table.grad)
        state = sum(add(v) for v in self.opt.state.get(self.table, {}).values() if torch.is_tensor(v) and v.dim())
        return {"rows": rows, "grad": grad, "optimizer_state": state, "total": rows + grad + state}

    @torch.no_grad()
    def meta_parameters(self) -> dict[str, torch.Tensor]:
        """Every meta-parameter, the whole table included (gathered from the shards: a collective)."""
        out = {n: p.detach().clone() for n, p in self.model.named_parameters() if "embeddings" not in n}
        emb = self.model.embeddings
        out["embeddings.weight"] = emb.gather_full_weight() if self.sharded else emb.weight.detach().clone()
        return out


# ------------------------------------------------------------------------------------------------ measurement
def tx_bytes(iface: str) -> int:
    try:
        return int((Path("/sys/class/net") / iface / "statistics" / "tx_bytes").read_text())
    except OSError:
        return 0


def link_counters(iface: str | None, local_rank: int) -> torch.Tensor:
    """Bytes sent so far over the inter-node link and over loopback, read by one rank per node (each node's
    counters are its namespace's): a byte crossing the veth pair is tx on exactly one end, a loopback byte is tx once
    on its node's ``lo``. Summed over the ranks, this is the cluster's total."""
    if local_rank != 0 or not iface:
        return torch.zeros(2, dtype=torch.float64)
    return torch.tensor([float(tx_bytes(iface)), float(tx_bytes("lo"))], dtype=torch.float64)


def quartiles(xs: list[float]) -> dict[str, float]:
    if len(xs) == 1:
        return {"median": xs[0], "q1": xs[0], "q3": xs[0], "iqr": 0.0}
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3, "iqr": q3 - q1}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALL_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {ALL_STRATEGIES}")
    total_steps = args.warmup + args.rounds * args.steps
    batches = [make_batch(args, s, rank) for s in range(total_steps)]
    unique_rows = []
    for b in batches:
        ids = torch.cat([b["sup_sparse"], b["qry_sparse"]], 1).reshape(-1, 2)
        unique_rows.append(int(torch.unique(ids[:, 0]).numel() + torch.unique(ids[:, 1]).numel()))

    t_build = time.perf_counter()
    strategies = {n: Strategy(n, args) for n in names}
    build_s = time.perf_counter() - t_build
    report: dict = {"world_size": world, "strategies": {}, "build_s": build_s}
    for n, st in strategies.items():
        report["strategies"][n] = {"ddp_settings": st.ddp_settings, "sharded": st.sharded, "sparse_grad": st.sparse,
                                   "losses": [], "round_s": [], "inter_bytes": [], "intra_bytes": [],
                                   "phases": {}}

    # warm-up: every strategy takes its first steps (vmap traces, allocator, DDP's first-iteration bookkeeping);
    # the embedding memory is probed after the last warm-up step, when gradient and optimizer state exist
    for n, st in strategies.items():
        for w in range(args.warmup):
            report["strategies"][n]["losses"].append(st.step(batches[st.step_index], probe=w == args.warmup - 1))
        keys = list(st.probe)
        mem = torch.tensor([float(st.probe[k]) for k in keys], dtype=torch.float64)
        mems = [torch.zeros_like(mem) for _ in range(world)]
        dist.all_gather(mems, mem)
        report["strategies"][n]["embedding_bytes_per_rank"] = [dict(zip(keys, map(int, m.tolist()))) for m in mems]

    # timed rounds, the strategies interleaved (order rotated every round)
    for k in range(args.rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        for n in order:
            st, r = strategies[n], report["strategies"][n]
            dist.barrier()
            c0 = link_counters(iface, local_rank)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                r["losses"].append(st.step(batches[st.step_index], r["phases"] if args.profile_phases else None))
            dist.barrier()
            dt = time.perf_counter() - t0
            c1 = link_counters(iface, local_rank)
            vec = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(vec, op=dist.ReduceOp.MAX)
            bytes_ = c1 - c0
            dist.all_reduce(bytes_)
            r["round_s"].append(float(vec[0]))
            r["inter_bytes"].append(float(bytes_[0]))
            r["intra_bytes"].append(float(bytes_[1]))

    # phase times: the slowest rank's median per phase
    for n in names:
        ph = report["strategies"][n]["phases"]
        for key in list(ph):
            v = torch.tensor([statistics.median(ph[key])], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            ph[key] = float(v[0])

    # meta-parameters after the same steps on the same tasks: every strategy against the first one
    params = {n: st.meta_parameters() for n, st in strategies.items()}
    ref = names[0]
    diffs = {}
    for n in names[1:]:
        d = {k: (params[n][k] - params[ref][k]).abs().max().item() for k in params[ref]}
        diffs[n] = {"max_abs_diff": max(d.values()), "per_parameter": d}
    # the meta-parameters also moved: the step changed them (a no-op run would compare equal trivially)
    if rank == 0:
        start = {n: p.detach() for n, p in build_model(args).named_parameters()}
        report["moved_from_init"] = {n: max((params[n][k] - start[k]).abs().max().item() for k in start)
                                     for n in names}
    report["param_diffs_vs"] = ref
    report["param_diffs"] = diffs
    report["steps_per_strategy"] = {n: st.step_index for n, st in strategies.items()}
    report["unique_rows_per_rank_step"] = statistics.mean(unique_rows)
    report["num_rows"] = args.items + args.categories
    report["table_bytes"] = (args.items + args.categories) * args.dim * 4
    report["global_tasks_per_step"] = args.tasks * world
    for r in report["strategies"].values():
        r["tasks_per_s"] = [report["global_tasks_per_step"] * args.steps / s for s in r["round_s"]]
        r["tasks_per_s_stats"] = quartiles(r["tasks_per_s"])
        r["inter_bytes_per_step"] = statistics.median(r["inter_bytes"]) / args.steps
        r["intra_bytes_per_step"] = statistics.median(r["intra_bytes"]) / args.steps
    if rank == 0:
        sys.stdout.write("GMETA_CLUSTER " + json.dumps(report) + "\n")
        sys.stdout.flush()
    dist.barrier()  # no rank closes its sockets while a peer is still in the last collective
    release_process_groups()


if __name__ == "__main__":
    main()
