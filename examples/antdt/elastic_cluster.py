"""Emulated nodes for AntDT-ND on one machine: one ``torchrun`` agent per node on loopback, an elastic c10d
rendezvous (``--nnodes MIN:MAX``), and node speed as a property of the node, not of the process.

- **A node** is its CPU set (``os.sched_setaffinity`` on the agent, inherited by every worker it starts) and its name
  (``ANTDT_NODE_ID``). A worker restarted on that node runs on the same cores.
- **A slow node** has co-tenants: busy processes pinned to the node's cores (`CoTenants`), so every process there,
  a restarted worker included, gets ``1 / (hogs + 1)`` of the core (Linux CFS shares a core evenly between runnable
  tasks of equal weight). `calibrate` measures the slowdown this gives on CPU work; stopping the co-tenants half way
  makes a transient straggler.
- **A slow node by CPU quota** (for more nodes than cores): the node's agent starts inside a cgroup of its own
  (`NodeCgroup`, cgroup v1 ``cpu`` controller, CFS bandwidth: ``cpu.cfs_quota_us`` of ``cpu.cfs_period_us``), so the
  agent and every worker it ever starts or restarts get at most that fraction of a core. Fast nodes get a quota
  ``q``, the slow node ``q / 3``; raising its quota back to ``q`` half way makes a transient straggler.
  `calibrate_quota` measures the CPU work rate inside each node's cgroup, all nodes at once.
- **A gang start** (``ElasticJob(gang_start=True)``): each agent imports torchrun inside its node first and waits until
  every agent is ready, as a cluster scheduler starts a job's pods together; otherwise a slow node's agent reaches the
  rendezvous seconds after the others, and with ``--nnodes MIN:MAX`` the job forms without it and re-forms when it
  arrives.
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


# The agent's wrapper for a gang start: pay torchrun's imports on the node, say so, wait for the go, then run it.
_GANG = ("import os, sys, time\nfrom torch.distributed.run import main\n"
         "open(sys.argv[1] + '.ready.' + sys.argv[2], 'w').close()\n"
         "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.02)\n"
         "sys.argv = ['torchrun', *sys.argv[3:]]\nsys.exit(main())\n")

CGROUP_CPU = Path(os.environ.get("ANTDT_CGROUP_CPU", "/sys/fs/cgroup/cpu"))
"""Where the cgroup v1 ``cpu`` controller is mounted (``$ANTDT_CGROUP_CPU`` overrides it)."""


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


def cgroup_unavailable(root: Path = CGROUP_CPU) -> str | None:
    """Why a `NodeCgroup` cannot be made under ``root`` (None: it can)."""
    fix = (f"CPU-quota nodes need the cgroup v1 cpu controller mounted and writable: run as root, mount it if it is "
           f"not (`mkdir -p {root} && mount -t cgroup -o cpu cgroup {root}`), set $ANTDT_CGROUP_CPU if it is mounted "
           "elsewhere, or use the co-tenant slow node (bench_nd.py --slow-by cotenants --nodes 2).")
    if not (root / "cpu.cfs_quota_us").exists():
        return f"{root} is not a cgroup v1 cpu controller (no cpu.cfs_quota_us). {fix}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable by uid {os.getuid()}. {fix}"
    return None


class NodeCgroup:
    """One emulated node's CPU: a cgroup (v1 ``cpu`` controller) whose CFS bandwidth quota is ``cores`` of one CPU
    per ``period_us``. A process started with `wrap` runs inside it from its first instruction, and so does every
    process it forks (a torchrun agent's workers, restarted ones included): the slowness belongs to the node.
    `set_quota` changes the node's speed while it runs; `remove` kills what is left inside and removes the group."""

    def __init__(self, name: str, cores: float, period_us: int = 100_000, root: Path = CGROUP_CPU):
        why = cgroup_unavailable(root)
        if why is not None:
            raise RuntimeError(why)
        self.path, self.period_us = Path(root) / name, int(period_us)
        self.path.mkdir()  # a unique name per run: an existing group is an error, not something to reuse
        (self.path / "cpu.cfs_period_us").write_text(str(self.period_us))
        self.cores = 0.0
        self.set_quota(cores)

    def set_quota(self, cores: float) -> None:
        """Give the node ``cores`` CPUs' worth of time (0.45 = 45 ms per 100 ms period); the kernel's floor is 1 ms."""
        quota = int(round(cores * self.period_us))
        if quota < 1000:
            raise ValueError(f"cores={cores} gives a quota of {quota} us per {self.period_us} us period, below the "
                             "kernel's 1000 us floor; raise cores or the period.")
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        self.cores = float(cores)

    def quota_cores(self) -> float:
        """The quota in force, read back from the kernel."""
        return int((self.path / "cpu.cfs_quota_us").read_text()) / int((self.path / "cpu.cfs_period_us").read_text())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def stat(self) -> dict[str, int]:
        """``cpu.stat``: periods, throttled periods, throttled time (ns)."""
        text = (self.path / "cpu.stat").read_text() if (self.path / "cpu.stat").exists() else ""
        return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the group: a shell writes its own pid into ``cgroup.procs``, then execs ``argv``."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]

    def remove(self, timeout_s: float = 20.0) -> None:
        """SIGKILL every process left in the group, wait until it is empty, remove it."""
        deadline = time.monotonic() + timeout_s
        while self.path.exists():
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:  # EBUSY until the killed processes are reaped
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cgroup {self.path} still holds {self.pids()} after {timeout_s} s") from None
                time.sleep(0.05)

    def __enter__(self) -> NodeCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _probe_in(cgroup: NodeCgroup, cpus: list[int], seconds: float) -> subprocess.Popen:
    return subprocess.Popen(cgroup.wrap([sys.executable, "-c", _PROBE, ",".join(map(str, cpus)), str(seconds)]),
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def calibrate_quota(quotas: list[float], period_us: int = 100_000, seconds: float = 3.0,
                    cpus: list[int] | None = None) -> dict:
    """Work units per second (`train_worker.burn`'s unit) inside one cgroup per node with the given quotas, every
    node probing at once (as in the job), and without any quota (alone); the slowdown is the median rate of the
    fastest-quota nodes over the rate of the slowest-quota node."""
    cpus = cpus or host_cpus()
    alone = _probe_rate(cpus, min(seconds, 1.5))
    tag = f"antdt_cal{os.getpid()}_{free_port()}"
    groups = [NodeCgroup(f"{tag}_{i}", q, period_us) for i, q in enumerate(quotas)]
    try:
        procs = [_probe_in(g, cpus, seconds) for g in groups]
        rates = [float(p.communicate(timeout=60 + seconds)[0].strip().splitlines()[-1]) for p in procs]
        throttled = [g.stat().get("nr_throttled", 0) for g in groups]
    finally:
        for g in groups:
            g.remove()
    hi, lo = max(quotas), min(quotas)
    fast = sorted(r for r, q in zip(rates, quotas) if q == hi)
    slow = [r for r, q in zip(rates, quotas) if q == lo]
    return {"quotas_cores": list(quotas), "period_us": period_us, "units_per_s": rates,
            "units_per_s_alone": alone, "throttled_periods": throttled,
            "slowdown": fast[len(fast) // 2] / min(slow), "fast_vs_alone": fast[len(fast) // 2] / alone}


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
    """One emulated node: its name, its cores and what slows it: co-tenants (``hogs``) on its cores, or a CPU quota
    (``cpu_quota`` cores, in a `NodeCgroup`), either optionally only for a while."""

    name: str
    cpus: list[int]
    hogs: int = 0
    hogs_for_s: float | None = None  # stop the co-tenants after this many seconds (None: for the whole run)
    start_after_s: float = 0.0  # a spare (or a rejoining node) starts its agent this late
    cpu_quota: float | None = None  # CPU-quota node: its agent runs in a cgroup of its own with this many cores
    quota_for_s: float | None = None  # then, after this many seconds, the quota becomes ``quota_after``
    quota_after: float | None = None
    period_us: int = 100_000
    tenants: CoTenants | None = field(default=None, repr=False)


@dataclass
class AgentRun:
    node: str
    returncode: int | None
    log: str
    started_s: float
    ended_s: float | None


class ElasticJob:
    """One ``torchrun --nnodes MIN:MAX --rdzv-backend c10d`` (or ``antdt``) agent per node over ``script``; the service
    URL and the worker arguments are passed through. Every agent is started in its own session and pinned to its
    node's cores."""

    def __init__(self, out: Path, nodes: list[Node], args: list[str], min_nodes: int, max_nodes: int,
                 max_restarts: int = 3, script: Path = WORKER, env: dict[str, str] | None = None,
                 join_timeout_s: float = 60.0, gang_start: bool = False, rdzv_backend: str = "c10d",
                 service_url: str | None = None):
        self.out, self.nodes, self.args = Path(out), nodes, list(args)
        self.min_nodes, self.max_nodes, self.max_restarts = min_nodes, max_nodes, max_restarts
        self.script, self.join_timeout_s = script, join_timeout_s
        # "antdt": c10d with the job's blacklist checked before an agent joins (antdt_callbacks.rendezvous)
        self.rdzv_backend, self.service_url = rdzv_backend, service_url
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
        self._start_timers: list[threading.Timer] = []
        self._logs: dict[str, object] = {}
        self.run_id = f"antdt{os.getpid()}_{free_port()}"
        self.cgroups: dict[str, NodeCgroup] = {}
        self.cgroup_stats: dict[str, dict] = {}  # each node's cpu.stat when the job stopped
        self.gang_start, self.gang_s = gang_start, 0.0
        self._go = self.out / f"gang_go_{self.run_id}"

    def argv(self) -> list[str]:
        torchrun = Path(sys.executable).with_name("torchrun")
        conf = (f"is_host=0,join_timeout={int(self.join_timeout_s)},last_call_timeout=1,keep_alive_interval=1,"
                "keep_alive_max_attempt=3")
        if self.rdzv_backend == "antdt" and self.service_url:
            conf += f",antdt_url={self.service_url}"
        assert self.store is not None
        return [str(torchrun), "--nnodes", f"{self.min_nodes}:{self.max_nodes}", "--nproc-per-node", "1",
                "--rdzv-backend", self.rdzv_backend, "--rdzv-endpoint", self.store.endpoint, "--rdzv-id", self.run_id,
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
            if node.cpu_quota is not None and node.quota_for_s is not None and node.quota_after is not None:
                self._later(node.quota_for_s, lambda n=node: self._cgroup(n).set_quota(n.quota_after))
            if node.start_after_s > 0:
                self._later(node.start_after_s, lambda n=node: self.start_agent(n), start=True)
            else:
                self.start_agent(node)
        if self.gang_start:
            self._release_gang()
        return self

    def _release_gang(self, timeout_s: float = 120.0) -> None:
        """Wait until every agent started so far has imported torchrun (inside its node), then let them all go."""
        deadline = time.monotonic() + timeout_s
        names = list(self.procs)
        while not all(Path(f"{self._go}.ready.{n}").exists() for n in names):
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                self._go.touch()
                raise RuntimeError(f"gang start: agents exited {dead} or not ready within {timeout_s} s")
            time.sleep(0.02)
        self._go.touch()
        self.gang_s = time.perf_counter() - self.t0

    def _cgroup(self, node: Node) -> NodeCgroup:
        """The node's cgroup (made on first use, named after the run: unique per run; one per node name)."""
        assert node.cpu_quota is not None
        if node.name not in self.cgroups:
            self.cgroups[node.name] = NodeCgroup(f"{self.run_id}_{node.name}", node.cpu_quota, node.period_us)
        return self.cgroups[node.name]

    def _later(self, delay: float, fn, start: bool = False) -> None:
        t = threading.Timer(delay, fn)
        t.daemon = True
        t.start()
        self._timers.append(t)
        if start:
            self._start_timers.append(t)  # `wait` waits for these (an agent still due), not for a speed change

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
        argv = self.argv()
        if self.gang_start and not self._go.exists():
            argv = [sys.executable, "-c", _GANG, str(self._go), node.name, *argv[1:]]
        if node.cpu_quota is not None:
            cg = self._cgroup(node)
            if cg.cores != node.cpu_quota:  # the same node name started again with another speed
                cg.set_quota(node.cpu_quota)
            argv = cg.wrap(argv)  # the agent, and so every worker it starts, runs in the node's cgroup
        self.procs[node.name] = subprocess.Popen(
            pin + argv, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True,
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
            pending = [t for t in self._start_timers if t.is_alive()]
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
        for name, cg in self.cgroups.items():
            self.cgroup_stats[name] = {**cg.stat(), "quota_cores": cg.cores}
            cg.remove()  # also kills anything the agents left behind inside their nodes
        self.cgroups = {}
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
