"""Emulated nodes for AntDT-ND on one machine: one ``torchrun`` agent per node on loopback, an elastic c10d
rendezvous (``--nnodes MIN:MAX``), and node speed as a property of the node, not of the process.

- **A node** is its CPU set (``os.sched_setaffinity`` on the agent, inherited by every worker it starts) and its name
  (``ANTDT_NODE_ID``). A worker restarted on that node runs on the same cores.
- **A slow node** has co-tenants: busy processes pinned to the node's cores (`CoTenants`), so every process there,
  a restarted worker included, gets ``1 / (hogs + 1)`` of the core (Linux CFS shares a core evenly between runnable
  tasks of equal weight). `calibrate` measures the slowdown this gives on CPU work; stopping the co-tenants half way
  makes a transient straggler.
- **The rendezvous store** runs in its own small process (`RendezvousStore`), not in an agent (``is_host=0`` on every
  node): with c10d the agent hosting the store cannot leave without breaking the rendezvous of the others, and the
  node an eviction removes may be any of them.

Nothing here decides anything: the Controller (in the service) decides evictions, the Agent (a ``TrainerCallback``)
checkpoints and stops its node's agent, and torchrun re-forms the job. `ElasticJob` only starts processes the way a
cluster's node manager would, and collects what they leave.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "train_worker.py"

_HOG = "import os, sys\nos.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\nwhile True:\n    pass\n"
_STORE = ("import sys, time\nfrom torch.distributed import TCPStore\n"
          "s = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, wait_for_workers=False)\n"
          "print('ready', flush=True)\ntime.sleep(float(sys.argv[3]))\n")
_PROBE = ("import os, sys, time, torch\nos.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
          "torch.set_num_threads(1)\nw = torch.randn(96, 96) / 10\nn, t0 = 0, time.perf_counter()\n"
          "while time.perf_counter() - t0 < float(sys.argv[2]):\n    a = w\n    for _ in range(20):\n"
          "        a = torch.tanh(a @ w)\n    n += 20\nprint(n / (time.perf_counter() - t0))\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class CoTenants:
    """``hogs`` busy processes pinned to ``cpus``: the node's co-tenant load. `stop` ends it (a transient straggler)."""

    def __init__(self, cpus: list[int], hogs: int):
        self.cpus, self.procs = list(cpus), []
        spec = ",".join(str(c) for c in self.cpus)
        for _ in range(hogs):
            self.procs.append(subprocess.Popen([sys.executable, "-c", _HOG, spec], start_new_session=True))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        self.procs = []

    def __enter__(self) -> CoTenants:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _probe_rate(cpus: list[int], seconds: float) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, ",".join(map(str, cpus)), str(seconds)], capture_output=True,
                         text=True, timeout=60 + seconds, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return float(out.stdout.strip().splitlines()[-1])


def calibrate(cpus: list[int], hogs: int, seconds: float = 1.5) -> dict:
    """Work units per second (`train_worker.burn`'s unit) on ``cpus`` alone and with ``hogs`` co-tenants, and the
    slowdown between them."""
    alone = _probe_rate(cpus, seconds)
    with CoTenants(cpus, hogs):
        time.sleep(0.2)
        loaded = _probe_rate(cpus, seconds)
    return {"cpus": cpus, "hogs": hogs, "units_per_s_alone": alone, "units_per_s_loaded": loaded,
            "slowdown": alone / loaded}


class RendezvousStore:
    """The c10d rendezvous store in a process of its own (every agent joins with ``is_host=0``)."""

    def __init__(self, lifetime_s: float = 3600.0):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", _STORE, "127.0.0.1", str(self.port), str(lifetime_s)],
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"the rendezvous store did not start (got {line!r}).")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@dataclass
class Node:
    """One emulated node: its name, its cores and its co-tenant load (``hogs``), optionally only for a while."""

    name: str
    cpus: list[int]
    hogs: int = 0
    hogs_for_s: float | None = None  # stop the co-tenants after this many seconds (None: for the whole run)
    start_after_s: float = 0.0  # a spare (or a rejoining node) starts its agent this late
    tenants: CoTenants | None = field(default=None, repr=False)


@dataclass
class AgentRun:
    node: str
    returncode: int | None
    log: str
    started_s: float
    ended_s: float | None


class ElasticJob:
    """One ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` agent per node over ``script``; the service URL and the
    worker arguments are passed through. Every agent is started in its own session and pinned to its node's cores."""

    def __init__(self, out: Path, nodes: list[Node], args: list[str], min_nodes: int, max_nodes: int,
                 max_restarts: int = 3, script: Path = WORKER, env: dict[str, str] | None = None,
                 join_timeout_s: float = 60.0):
        self.out, self.nodes, self.args = Path(out), nodes, list(args)
        self.min_nodes, self.max_nodes, self.max_restarts = min_nodes, max_nodes, max_restarts
        self.script, self.join_timeout_s = script, join_timeout_s
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    # rank 0 publishes MASTER_ADDR in every round (a re-formed round has a new rank 0)
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
        self.store: RendezvousStore | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.t0 = 0.0
        self._timers: list[threading.Timer] = []
        self._logs: dict[str, object] = {}
        self.run_id = f"antdt{os.getpid()}_{free_port()}"

    def argv(self) -> list[str]:
        torchrun = Path(sys.executable).with_name("torchrun")
        conf = (f"is_host=0,join_timeout={int(self.join_timeout_s)},last_call_timeout=1,keep_alive_interval=1,"
                "keep_alive_max_attempt=3")
        assert self.store is not None
        return [str(torchrun), "--nnodes", f"{self.min_nodes}:{self.max_nodes}", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.store.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", conf, "--local-addr", "127.0.0.1", "--max-restarts", str(self.max_restarts),
                "--monitor-interval", "0.5", str(self.script), *self.args]

    def start(self) -> ElasticJob:
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = RendezvousStore()
        self.t0 = time.perf_counter()
        for node in self.nodes:
            if node.hogs:
                node.tenants = CoTenants(node.cpus, node.hogs)
                if node.hogs_for_s is not None:
                    self._later(node.hogs_for_s, node.tenants.stop)
            if node.start_after_s > 0:
                self._later(node.start_after_s, lambda n=node: self.start_agent(n))
            else:
                self.start_agent(node)
        return self

    def _later(self, delay: float, fn) -> None:
        t = threading.Timer(delay, fn)
        t.daemon = True
        t.start()
        self._timers.append(t)

    def start_agent(self, node: Node) -> None:
        """Start (or start again: a node rejoining) the node's agent."""
        if node.name in self.procs and self.procs[node.name].poll() is None:
            raise RuntimeError(f"node {node.name}'s agent is still running")
        old = self._logs.pop(node.name, None)
        if old is not None:
            old.close()  # type: ignore[attr-defined]
        log = open(self.out / f"agent_{node.name}.log", "ab")  # closed in stop()
        self._logs[node.name] = log
        pin = ["taskset", "-c", ",".join(map(str, node.cpus))]  # inherited by the workers the agent starts
        self.procs[node.name] = subprocess.Popen(
            pin + self.argv(), stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True,
            env={**self.env, "ANTDT_NODE_ID": node.name})
        self.started[node.name] = time.perf_counter() - self.t0
        self.ended.pop(node.name, None)

    def poll(self) -> dict[str, int | None]:
        now = time.perf_counter() - self.t0
        procs = list(self.procs.items())  # another thread may start an agent meanwhile
        for name, p in procs:
            if p.poll() is not None and name not in self.ended:
                self.ended[name] = now
        return {name: p.returncode for name, p in procs}

    def wait(self, timeout_s: float, until=None) -> bool:
        """Wait until every agent started so far has exited and no agent is still due to start (or ``until()`` is
        true); False on timeout (the agents are left running: `stop` ends them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            codes = self.poll()
            pending = [t for t in self._timers if t.is_alive()]
            if until is not None and until():
                return True
            if codes and all(c is not None for c in codes.values()) and not any(
                    n.start_after_s > 0 and n.name not in self.procs for n in self.nodes) and not pending:
                return True
            time.sleep(0.1)
        return False

    def log(self, node: str) -> str:
        path = self.out / f"agent_{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def results(self) -> dict[str, AgentRun]:
        self.poll()
        return {n: AgentRun(n, p.returncode, self.log(n), self.started[n], self.ended.get(n))
                for n, p in list(self.procs.items())}

    def stop(self) -> None:
        for t in self._timers:
            t.cancel()
        # torchrun starts each worker in a session of its own: find them before their agent goes
        procs = list(self.procs.values())
        workers = [c for p in procs for c in _children(p.pid)]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=20)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            if node.tenants is not None:
                node.tenants.stop()
        if self.store is not None:
            self.store.stop()
        for f in self._logs.values():
            f.close()  # type: ignore[attr-defined]
        self._logs = {}

    def __enter__(self) -> ElasticJob:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc; empty once it is gone)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def read_reports(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("report_rank*_inc*.json"))]
