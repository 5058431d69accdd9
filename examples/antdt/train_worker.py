"""One rank of a Trainer job fed by the AntDT sharding service (launch with torchrun, or plain python for 1 rank).

The model is a tiny regression plus a ``seen`` parameter with one entry per sample id, built so that every SGD step
adds exactly 1 to ``seen[id]`` for each sample the *global* step consumed, through the weighted gradient
all-reduce. The committed (saved) model therefore records how often each sample contributed to it: the fault tests
check ``seen == num_epochs`` everywhere. Faults and slowdowns are injected from the command line (``--slow`` is
tied to a rank and an incarnation, so a restart cures it; a slow *node*, which stays slow whatever runs on it, is a
co-tenant on the node's core started by `elastic_cluster`, slowing the CPU work of ``--step-work``/``--sample-work``):

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/antdt/train_worker.py \
        --url http://127.0.0.1:PORT --out /tmp/run --dataset-size 203 --save-steps 4 \
        --fault kill:rank=1:step=6:incarnation=0 --slow rank=1:factor=3
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from antdt_callbacks import AgentConfig, AntDTAgent, AntDTTrainerMixin, init_distributed
from hf_placement import release_process_groups_at_exit

STATE = {"step": 0}
_UNIT = torch.randn(96, 96, generator=torch.Generator().manual_seed(1)) / 10


def burn(units: int) -> None:
    """Real CPU work (``units`` 96x96 matmuls): unlike the injected sleep it is slowed by a co-tenant on the node's
    core, so a node's slowness reaches every process on it, a restarted worker included."""
    a = _UNIT
    for _ in range(int(units)):
        a = torch.tanh(a @ _UNIT)


def parse_spec(spec: str | None) -> dict[str, float]:
    """``"rank=1:factor=3"`` -> {"rank": 1.0, "factor": 3.0}."""
    if not spec:
        return {}
    return {k: float(v) for k, v in (kv.split("=") for kv in spec.split(":") if "=" in kv)}


class ToyData(torch.utils.data.Dataset):
    def __init__(self, n: int, dim: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, generator=g) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "sample_id": torch.tensor(i)}


class CountingRegressor(nn.Module):
    """Linear regression + a per-sample counter trained to +1 per global consumption (see the module docstring)."""

    def __init__(self, n: int, dim: int, lr: float, sample_cost_s: float, slow: dict[str, float],
                 step_work: int = 0, sample_work: int = 0):
        super().__init__()
        self.step_work, self.sample_work = step_work, sample_work
        self.lin = nn.Linear(dim, 1)
        self.seen = nn.Parameter(torch.zeros(n))
        self.lr = lr
        self.sample_cost_s = sample_cost_s
        self.slow = slow
        self.rank = int(os.environ.get("RANK", 0))
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.global_samples = 1

    def _factor(self) -> float:
        s = self.slow
        if not s or int(s.get("rank", -1)) != self.rank or int(s.get("incarnation", self.incarnation)) != \
                self.incarnation:
            return 1.0
        if STATE["step"] < s.get("from_step", 0) or (s.get("to_step", -1) >= 0 and STATE["step"] >= s["to_step"]):
            return 1.0
        return float(s.get("factor", 1.0))

    def forward(self, x, y, sample_id):
        if self.sample_cost_s > 0:
            time.sleep(self.sample_cost_s * len(x) * self._factor())  # injected per-sample compute (no CPU used)
        if self.step_work or self.sample_work:
            # CPU work: a part per step whatever the batch (a rank with a dummy batch pays it too) and a part per sample
            burn(self.step_work + self.sample_work * len(x))
        pred = self.lin(x).squeeze(-1)
        # The counter term: local mean over this rank's batch, times sum_j b_j / lr, so that the weighted all-reduce
        # (w_i = b_i / sum_j b_j) gives each consumed sample a gradient of exactly -1/lr, i.e. an SGD step of +1.
        count = -(self.global_samples / self.lr) * self.seen[sample_id].mean()
        return {"loss": nn.functional.mse_loss(pred, y) + count}


class WorkerTrainer(AntDTTrainerMixin, Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.model.global_samples = max(1, inputs["antdt_meta"].global_samples)
        return super().training_step(model, inputs, num_items_in_batch)


class PlainTrainer(Trainer):
    """The plain-DDP baseline for the benchmark: stock Trainer, DistributedSampler, equal batches."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.model.global_samples = len(inputs["x"]) * self.args.world_size
        t0 = time.perf_counter()
        out = super().training_step(model, inputs, num_items_in_batch)
        STATE.setdefault("compute", []).append(time.perf_counter() - t0)
        return out


class StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step (for throughput over steady-state steps)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())  # all threads of this process


class FaultInjector(TrainerCallback):
    """``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself; a helper sends SIGCONT after ``seconds``) or ``term``
    (SIGTERM itself, as torchrun's agent does to its workers when the job re-forms) at a step."""

    def __init__(self, spec: str | None):
        self.kind, _, rest = (spec or "").partition(":")
        self.params = parse_spec(rest)

    def on_step_begin(self, args, state, control, **kwargs):
        STATE["step"] = state.global_step
        if not self.kind:
            return
        p = self.params
        if int(p.get("rank", -1)) != int(os.environ.get("RANK", 0)) or state.global_step != int(p.get("step", -1)):
            return
        if int(p.get("incarnation", 0)) != int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)):
            return
        print(f"[fault] rank {os.environ.get('RANK')} {self.kind} at step {state.global_step}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "stop":
            subprocess.Popen(["sh", "-c", f"sleep {p.get('seconds', 5)}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=os.environ.get("ANTDT_SERVICE_URL"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dataset-size", type=int, required=True)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--save-steps", type=int, default=0, help="checkpoint period (0 = none)")
    ap.add_argument("--sample-cost-s", type=float, default=0.0)
    ap.add_argument("--step-work", type=int, default=0, help="CPU work units per step (any batch size)")
    ap.add_argument("--sample-work", type=int, default=0, help="CPU work units per sample")
    ap.add_argument("--slow", default=None, help="rank=R:factor=F[:from_step=A:to_step=B:incarnation=I]")
    ap.add_argument("--fault", default=None, help="kill|stop|term:rank=R:step=S[:incarnation=I:seconds=T]")
    ap.add_argument("--ack-period-s", type=float, default=None, help="AgentConfig.ack_period_s (default: its own)")
    ap.add_argument("--pg-timeout-s", type=float, default=300.0, help="process group / collective timeout")
    ap.add_argument("--mode", choices=["antdt", "plain"], default="antdt")
    ap.add_argument("--batch-size", type=int, default=8, help="plain mode: per-device batch")
    ap.add_argument("--micro-cap", default=None, help="rank=R:size=S: memory cap (micro-batch size) of rank R")
    ap.add_argument("--start-file", default=None, help="start barrier for co-running jobs: write <file>.ready.<pid> "
                    "once built, then train only when <file> exists")
    a = ap.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    torch.set_num_threads(1)
    init_distributed("gloo", timeout_s=a.pg_timeout_s)
    release_process_groups_at_exit()  # Trainer scripts end with their gloo group alive: see hf_placement.lifecycle
    torch.manual_seed(0)
    out = Path(a.out)
    data = ToyData(a.dataset_size, a.dim)
    model = CountingRegressor(a.dataset_size, a.dim, a.lr, a.sample_cost_s, parse_spec(a.slow), a.step_work,
                              a.sample_work)
    targs = TrainingArguments(
        output_dir=str(out), max_steps=a.max_steps, learning_rate=a.lr, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=a.batch_size, report_to="none",
        save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, logging_steps=10**6,
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None,
        ddp_broadcast_buffers=False,
    )
    clock = StepClock()
    callbacks = [FaultInjector(a.fault), clock]
    if a.mode == "plain":
        trainer = PlainTrainer(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    else:
        cap = parse_spec(a.micro_cap)
        mine = int(cap["size"]) if cap and int(cap["rank"]) == int(os.environ.get("RANK", 0)) else None
        agent = AntDTAgent(AgentConfig(url=a.url, max_micro_batch=mine,
                                         **({} if a.ack_period_s is None else {"ack_period_s": a.ack_period_s})))
        trainer = WorkerTrainer(model=model, args=targs, train_dataset=data, callbacks=[agent, *callbacks])
    last = get_last_checkpoint(str(out)) if out.exists() else None
    if a.start_file:
        Path(f"{a.start_file}.ready.{os.getpid()}").touch()
        deadline = time.monotonic() + 600
        while not os.path.exists(a.start_file):
            if time.monotonic() > deadline:
                raise TimeoutError(f"start file {a.start_file} did not appear within 600 s")
            time.sleep(0.02)
    t0 = time.time()
    trainer.train(resume_from_checkpoint=last)
    wall = time.time() - t0
    rank = int(os.environ.get("RANK", 0))
    inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    from antdt_callbacks import node_id

    report = {"rank": rank, "incarnation": inc, "node": node_id(), "world_size": int(os.environ.get("WORLD_SIZE", 1)),
              "global_step": trainer.state.global_step, "wall_s": wall,
              "resumed_from": last, "step_times": clock.times, "step_cpu": clock.cpu}
    if a.mode == "antdt":
        ag = trainer.antdt_agent
        ds = trainer._antdt_dataset
        report.update(history=ag.history, overhead_s=ag.overhead_s, wait_s=ds.wait_s, collective_s=ds.collective_s,
                      rpc_calls=ds.client.calls, rpc_s=ds.client.call_s, rpc_latencies=list(ds.client.latencies))
    else:
        report.update(compute=STATE.get("compute", []))
    (out / f"report_rank{rank}_inc{inc}.json").write_text(json.dumps(report))
    trainer.save_model(str(out / "final"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
