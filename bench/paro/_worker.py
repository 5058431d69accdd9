"""One rank of the PaRO cluster benchmark: trains the same GPT-2 under every requested configuration in turn.

Launched once per rank (by ``bench_paro_cluster.py`` inside the emulated cluster, or by torchrun for a local check)
with the usual RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_* variables. All configurations run in one process
group, one after the other, so process start-up and imports are paid once per bandwidth setting.

Configurations: ``paro:<XYZ>`` (the PaRO engine, PaRO-CC on), ``ds:<1|2|3>`` (DeepSpeed ZeRO stage on gloo),
``fsdp2:full`` (``fully_shard`` on a 1-D mesh) and ``fsdp2:hybrid`` (2-D mesh ``(groups, m)``: HSDP), and
``compute`` (forward/backward/AdamW of the full model on one rank, no communication: the compute floor).

Per configuration, rank 0 prints one line ``PARO_BENCH {json}`` with the per-step wall times (the max over ranks
of each global step), the model-state bytes each rank holds (params + grads + optimizer, max over ranks), and the
bytes that crossed the inter-node link (the veth counters of this rank's namespace) and the node-local loopback per
timed step.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hf_placement import release_process_groups

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- model/data
def build_model(args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                     n_positions=args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def batch(args: argparse.Namespace, step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * micro + rank)
    return torch.randint(1, args.vocab, (args.micro_batch, args.seq_len), generator=g)


ADAMW = {"lr": 1e-4, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8}


# ------------------------------------------------------------------------------------------------ measurements
def link_bytes(iface: str | None) -> int:
    """tx + rx bytes of one interface of this rank's network namespace (0 when unknown)."""
    if not iface:
        return 0
    base = Path("/sys/class/net") / iface / "statistics"
    try:
        return int((base / "tx_bytes").read_text()) + int((base / "rx_bytes").read_text())
    except OSError:
        return 0


def state_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` (model, optimizer, engine objects).

    A generic walk so that every system is measured the same way: parameters (or their shards), gradients, master
    copies, flat partitions and optimizer moments all live in tensors referenced from these objects. Storages are
    deduplicated by address, so views and aliases count once."""
    seen_obj: set[int] = set()
    seen_storage: dict[int, int] = {}
    stack = [(r, 0) for r in roots]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen_obj or depth > 12:
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = obj
            if hasattr(obj, "to_local"):  # DTensor: count this rank's shard
                local = obj.to_local()
            try:
                st = local.untyped_storage()
                if st.data_ptr() and st.device.type != "meta":
                    seen_storage[st.data_ptr()] = max(seen_storage.get(st.data_ptr(), 0), st.nbytes())
            except (RuntimeError, NotImplementedError):
                pass
            for attr in ("grad", "ds_tensor", "ds_secondary_tensor", "_local_tensor"):
                sub = getattr(obj, attr, None)
                if isinstance(sub, torch.Tensor):
                    stack.append((sub, depth + 1))
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type(None), type)) or callable(obj) and not hasattr(
                obj, "__dict__"):
            continue
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
            stack.extend((k, depth + 1) for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in obj)
        else:
            mod = type(obj).__module__ or ""
            if mod.startswith(("torch.distributed.distributed_c10d", "torch._C", "threading", "logging")):
                continue
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                stack.extend((v, depth + 1) for v in d.values())
    return sum(seen_storage.values())


# ------------------------------------------------------------------------------------------------- the systems
class System(abc.ABC):
    """A configured model + optimizer: ``micro(ids, last)`` runs one micro-step, ``step()`` the optimizer.

    ``probe``, when set, is called after the last backward of a step and before the optimizer update: model-state
    memory is measured there, where gradients are live in every system."""

    probe = None
    settings: dict = {}

    def maybe_probe(self, last: bool) -> None:
        """Measure model-state memory at the end of the last micro-step's forward and after its backward (the
        larger counts): parameters kept gathered from forward to backward are seen, as are live gradients."""
        if last and self.probe is not None:
            self.probe()

    @abc.abstractmethod
    def micro(self, ids: torch.Tensor, last: bool, s: int) -> float:
        """Implemented by every engine below."""

    @abc.abstractmethod
    def step(self) -> None:
        """Implemented by every engine below."""

    @abc.abstractmethod
    def roots(self) -> tuple:
        """Implemented by every engine below."""

    def close(self) -> None:  # noqa: B027 - an optional hook: nothing to release by default
        pass


class ParoSystem(System):
    """The PaRO engine. Settings: ``bucket_size`` (elements), ``units`` ("block": one unit per transformer block +
    root, the default; "model": the whole model gathered as one unit), ``reshard_after_forward`` (bool)."""

    def __init__(self, model, strategy: str, args, topology, opts: dict):
        from paro_zero_backend import ParoConfig, ParoEngine

        cfg = ParoConfig(strategy=strategy, group_size=args.group_size, paro_cc=True,
                         bucket_size=int(opts.get("bucket_size", args.bucket_size)), timeout_s=600.0,
                         unit_module_classes=[] if opts.get("units") == "model" else None,
                         reshard_after_forward=bool(opts.get("reshard_after_forward", True)))
        self.settings = {k: getattr(cfg, k) for k in ("bucket_size", "unit_module_classes", "reshard_after_forward",
                                                      "paro_cc")}
        self.engine = ParoEngine(model, torch.optim.AdamW(model.parameters(), **ADAMW), cfg, topology=topology)

    def micro(self, ids, last, s):
        with contextlib.nullcontext() if last else self.engine.no_sync():
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.maybe_probe(last)
            self.engine.backward(loss / s)
        self.maybe_probe(last)
        return float(loss.detach())

    def step(self):
        self.engine.step()
        self.engine.zero_grad()

    def roots(self):
        return (self.engine,)

    def close(self):
        self.engine.remove_hooks()


# DeepSpeed settings a configuration string may set (``ds:3|overlap_comm=false|reduce_bucket_size=1000000``);
# ``hpz=1`` sets zero_hpz_partition_size to the ranks per node. Unset keys keep DeepSpeed's documented defaults.
DS_KEYS = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
           "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
           "stage3_max_reuse_distance", "zero_hpz_partition_size", "allgather_partitions")
DS_REPORTED = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
               "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
               "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")


class DeepSpeedSystem(System):
    def __init__(self, model, stage: int, args, opts: dict):
        import deepspeed

        zero = {"stage": stage}
        for key, value in opts.items():
            if key == "hpz":
                if value:
                    zero["zero_hpz_partition_size"] = args.group_size
            elif key in DS_KEYS:
                zero[key] = value
            else:
                raise ValueError(f"unknown DeepSpeed setting {key!r}; use one of {DS_KEYS} or hpz")
        cfg = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.accumulation,
            "train_batch_size": args.micro_batch * args.accumulation * dist.get_world_size(),
            "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "weight_decay": ADAMW["weight_decay"],
                                                      "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                                                      "torch_adam": True}},
            "zero_optimization": zero,
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=cfg)
        effective = self.engine._config.zero_config.model_dump()
        self.settings = {"config_zero_optimization": zero, **{k: effective.get(k) for k in DS_REPORTED}}

    def micro(self, ids, last, s):
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.maybe_probe(last)
        self.engine.backward(loss)  # DeepSpeed scales by 1/gradient_accumulation_steps itself
        self.maybe_probe(last)
        self.engine.step()  # a no-op except at the accumulation boundary
        return float(loss.detach())

    def step(self):
        pass

    def roots(self):
        return (self.engine.module, self.optimizer)

    def close(self):
        with contextlib.suppress(Exception):
            self.engine.destroy()


class FsdpSystem(System):
    """FSDP2. Settings: ``reshard_after_forward`` (true: ZeRO-3-like, the default; false: keep gathered parameters
    from forward to backward; an int k: reshard to k ranks after forward, the hpZ-like secondary copy), ``units``
    ("block": fully_shard per transformer block + root, the documented recipe; "model": root only) and ``prefetch``
    (explicit forward/backward prefetch of the next block)."""

    def __init__(self, model, hybrid: bool, args, opts: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        n, m = dist.get_world_size(), args.group_size
        if hybrid:
            mesh = init_device_mesh("cpu", (n // m, m), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("shard",))
        reshard = opts.get("reshard_after_forward", True)
        blocks = list(model.transformer.h) if opts.get("units", "block") == "block" else []
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        if opts.get("prefetch") and blocks:
            for a, b in zip(blocks, blocks[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        self.settings = {"reshard_after_forward": reshard, "units": "block" if blocks else "model",
                         "prefetch": bool(opts.get("prefetch")), "mesh": list(mesh.shape)}
        self.model, self.hybrid = model, hybrid
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def micro(self, ids, last, s):
        if self.hybrid:
            # HSDP = III: reduce-scatter inside the group every micro-step, all-reduce across groups once.
            self.model.set_requires_all_reduce(last)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.maybe_probe(last)
        (loss / s).backward()
        self.maybe_probe(last)
        return float(loss.detach())

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def roots(self):
        return (self.model, self.optimizer)


class ComputeOnly(System):
    """The compute floor: the full model trained locally (no communication, no synchronisation)."""

    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def micro(self, ids, last, s):
        loss = self.model(input_ids=ids, labels=ids).loss
        self.maybe_probe(last)
        (loss / s).backward()
        self.maybe_probe(last)
        return float(loss.detach())

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def roots(self):
        return (self.model, self.optimizer)


def parse_config(name: str) -> tuple[str, str, dict]:
    """``kind:what|key=value|...`` -> (kind, what, settings); values are JSON literals where they parse."""
    head, *pairs = name.split("|")
    kind, _, what = head.partition(":")
    opts = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return kind, what, opts


def make_system(name: str, args, topology) -> System:
    kind, what, opts = parse_config(name)
    model = build_model(args)
    if kind == "paro":
        return ParoSystem(model, what.upper(), args, topology, opts)
    if kind == "ds":
        return DeepSpeedSystem(model, int(what), args, opts)
    if kind == "fsdp2":
        return FsdpSystem(model, what == "hybrid", args, opts)
    if kind == "compute":
        return ComputeOnly(model)
    raise ValueError(f"unknown configuration {name!r}: use paro:<XYZ>, ds:<1|2|3>, fsdp2:<full|hybrid> or compute, "
                     "each optionally followed by |key=value settings")


def calibrate(topology, reps: int = 5) -> dict:
    """Time all-gather, reduce-scatter and all-reduce on the intra and the inter groups at two sizes (all groups of
    a kind at once, as in training) and fit ``t = latency + formula_bytes / bandwidth`` per link from the all-gather;
    the reduce-scatter and all-reduce factors are their times over that fit at the large size. These are the
    guideline's calibrated constants; they never look at a training run."""
    from paro_zero_backend.collectives import _all_gather_single, _reduce_scatter_single

    sizes = (1 << 14, 1 << 21)
    out = {}
    for link, group, k in (("intra", topology.intra_group, topology.group_size),
                           ("inter", topology.inter_group, topology.num_groups)):
        times: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
        for numel in sizes:
            full = torch.randn(numel)
            shard = torch.empty(numel // k)
            ops = {"all_gather": lambda f=full, h=shard, g=group: _all_gather_single(f, h, group=g),
                   "reduce_scatter": lambda f=full, h=shard, g=group: _reduce_scatter_single(
                       h, f, op=dist.ReduceOp.SUM, group=g),
                   "all_reduce": lambda f=full, g=group: dist.all_reduce(f, group=g)}
            for op, fn in ops.items():
                fn()
                ts = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                t = torch.tensor(sorted(ts)[len(ts) // 2], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[op].append(float(t))
        nbytes = [(k - 1) / k * x * 4 for x in sizes]
        ag = times["all_gather"]
        bw = (nbytes[1] - nbytes[0]) / max(ag[1] - ag[0], 1e-9)
        lat = max(ag[0] - nbytes[0] / bw, 0.0)
        model = lat + nbytes[1] / bw
        out[link] = {"bandwidth_mb_s": bw / 1e6, "latency_s": lat, "times_s": times, "sizes": list(sizes),
                     "reduce_scatter_factor": (times["reduce_scatter"][1] - lat) / (model - lat),
                     "all_reduce_factor": (times["all_reduce"][1] - lat) / (2 * nbytes[1] / bw)}
    return out


PROBE_STEP = 1  # the memory probe runs in the second step: the optimizer's state exists from the first update on


def run_config(name: str, args, topology, iface: str | None) -> dict:
    """Train ``name`` for ``warmup + steps`` global steps. Model-state memory is probed in step `PROBE_STEP`; with
    ``--budget-bytes`` a configuration whose footprint (max over ranks) exceeds the budget stops there and is
    reported as not fitting, untimed. ``--probe-only`` stops every configuration there."""
    rank = dist.get_rank()
    system = make_system(name, args, topology)
    s = args.accumulation
    times, opt_times, losses = [], [], []
    inter0 = intra0 = 0
    cpu0 = 0.0
    mem_box: list[int] = []
    probe_s: list[float] = []

    def probe() -> None:
        t = time.perf_counter()
        mem_box.append(state_bytes(*system.roots()))
        probe_s.append(time.perf_counter() - t)

    fits, timed = True, not args.probe_only
    for step in range(args.warmup + args.steps):
        system.probe = probe if step == PROBE_STEP else None
        if step == args.warmup:
            inter0, intra0, cpu0 = link_bytes(iface), link_bytes("lo" if iface else None), time.process_time()
        if name != "compute":
            dist.barrier()
        t0 = time.perf_counter()
        total = 0.0
        for k in range(s):
            total += system.micro(batch(args, step, k, rank), k == s - 1, s) / s
        t1 = time.perf_counter()
        system.step()
        dt = time.perf_counter() - t0 - (sum(probe_s) if step == PROBE_STEP else 0.0)
        losses.append(total)
        if step >= args.warmup:
            times.append(dt)
            opt_times.append(time.perf_counter() - t1)
        if step == PROBE_STEP:
            mem = torch.tensor(float(max(mem_box)), dtype=torch.float64)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            fits = name == "compute" or not args.budget_bytes or float(mem) <= args.budget_bytes
            if args.probe_only or not fits:
                timed = False
                break
    inter1, intra1, cpu1 = link_bytes(iface), link_bytes("lo" if iface else None), time.process_time()
    out = {"config": name, "settings": system.settings, "model_state_bytes_max": int(mem), "fits": fits,
           "timed": timed, "budget_bytes": args.budget_bytes or None}
    # per-step loss of the global batch (mean over ranks of the mean over micro-steps), warm-up steps included
    traj = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(traj, op=dist.ReduceOp.SUM)
    out["loss_trajectory"] = (traj / dist.get_world_size()).tolist()
    if name.startswith("paro:"):
        out["engine_memory_bytes"] = system.engine.memory_bytes()
        out["strategy"] = str(system.engine.strategy)
        out["num_buckets"] = len(system.engine.buckets)
        out["engine_bytes_per_step"] = system.engine.last_step_bytes
    if timed:
        k = args.steps
        vec = torch.tensor(times + opt_times + [cpu1 - cpu0], dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        sums = torch.tensor([float(inter1 - inter0), float(intra1 - intra0), cpu1 - cpu0], dtype=torch.float64)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        out.update({"step_times_s": vec[:k].tolist(), "optimizer_times_s": vec[k:2 * k].tolist(),
                    "cpu_s_max_rank": float(vec[2 * k]), "cpu_s_all_ranks": float(sums[2]),
                    "losses": losses[args.warmup:]})
        # Totals over the cluster. Every rank of a node reads its namespace's counters (divide by m); a byte crossing
        # the veth pair is tx on one end and rx on the other, a loopback byte is both tx and rx of lo (divide by 2).
        m = args.group_size
        out["inter_node_bytes_per_step"] = float(sums[0]) / m / 2 / k if iface else None
        out["intra_node_bytes_per_step"] = float(sums[1]) / m / 2 / k if iface else None
    system.close()
    gc.collect()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="", help="comma-separated configurations")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--bucket-size", type=int, default=50_000_000, help="PaRO engine bucket cap (one per block)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--budget-bytes", type=float, default=0.0,
                   help="per-rank model-state budget: a configuration above it stops after the probe, untimed")
    p.add_argument("--probe-only", action="store_true", help="measure model-state footprints only (2 steps each)")
    p.add_argument("--calibrate", action="store_true", help="time the collectives per link first (PARO_CALIB line)")
    args = p.parse_args(argv)
    args.group_size = args.group_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    from hf_placement import build_topology

    topology = build_topology(group_size=args.group_size, timeout_s=600.0)
    if args.probe_only:
        args.warmup, args.steps = 1, max(args.steps, 1)
    if any(c.startswith("ds:") for c in args.configs.split(",")):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if rank == 0:
        model = build_model(args)
        print("PARO_MODEL " + json.dumps({"params": sum(p.numel() for p in model.parameters())}), flush=True)
        del model
    if args.calibrate:
        cal = calibrate(topology)
        if rank == 0:
            print("PARO_CALIB " + json.dumps(cal), flush=True)
    for name in [c for c in args.configs.split(",") if c]:
        try:
            res = run_config(name, args, topology, iface)
        except Exception as exc:  # a configuration that cannot run here is reported, the others still run
            res = {"config": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"rank {rank}: {name} failed: {res['error']}", file=sys.stderr, flush=True)
        if rank == 0:
            print("PARO_BENCH " + json.dumps(res), flush=True)
        dist.barrier()
    release_process_groups()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
