"""Run a whole AntDT job on this machine with real processes: the service (``python -m antdt_callbacks serve``)
plus ``torchrun --max-restarts`` over `train_worker.py`, with optional faults. Shared by the fault tests, the
benchmark and the notebook.

``run_elastic_job`` runs AntDT-ND on emulated nodes instead (`elastic_cluster`): one ``torchrun --nnodes MIN:MAX``
agent per node, slow nodes slowed by co-tenant processes on their cores or by a CPU quota (a cgroup per node),
evictions through the elastic rendezvous.

``run_job`` returns the final ``seen`` counter of the committed model (how often each sample id contributed), the
per-rank reports of the last incarnation, the service status and the torchrun exit code.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from antdt_callbacks import ControllerConfig, JobConfig, MonitorConfig, launch_service

HERE = Path(__file__).resolve().parent
WORKER = HERE / "train_worker.py"


@dataclass
class JobResult:
    returncode: int
    seen: list[float] | None
    reports: dict[int, dict]
    status: dict
    log: str
    events: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    service_stats: dict = field(default_factory=dict)


def torchrun_cmd(world: int, max_restarts: int) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), "--standalone", f"--nproc-per-node={world}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5", str(WORKER)]


def run_job(out: str | os.PathLike, world: int, job: JobConfig, monitor: MonitorConfig | None = None,
            controller: ControllerConfig | None = None, worker_args: list[str] | None = None, max_restarts: int = 1,
            kill_service_after_samples: int | None = None, service_down_s: float = 1.5, timeout_s: float = 600,
            mode: str = "antdt") -> JobResult:
    """Start the service and the job; optionally SIGKILL the service once it has acknowledged
    ``kill_service_after_samples`` samples, restart it ``service_down_s`` later on the same port and database."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    events: list[str] = []
    svc = launch_service(out / "service.sqlite", job, monitor, controller)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    if world > 1:
        cmd = torchrun_cmd(world, max_restarts)
    else:
        cmd = [sys.executable, str(WORKER)]
    cmd += ["--url", svc.url, "--out", str(out / "run"), "--dataset-size", str(job.dataset_size),
            "--mode", mode, *(worker_args or [])]
    t0 = time.time()
    log_path = out / "job.log"
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parents[1]))
            killer = None
            if kill_service_after_samples is not None:
                killer = threading.Thread(target=_kill_service_when, args=(svc, kill_service_after_samples,
                                                                           service_down_s, events, proc, timeout_s))
                killer.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
                events.append(f"job killed after {timeout_s} s timeout")
            if killer is not None:
                killer.join(timeout=30)
        wall = time.time() - t0
        from antdt_callbacks import ShardingClient

        client = ShardingClient(svc.url, rank=0)
        status = client.status()
        reports: dict[int, dict] = {}
        for p in sorted(glob.glob(str(out / "run" / "report_rank*_inc*.json"))):
            rep = json.loads(Path(p).read_text())
            if rep["rank"] not in reports or rep["incarnation"] >= reports[rep["rank"]]["incarnation"]:
                reports[rep["rank"]] = rep
        seen = None
        files = glob.glob(str(out / "run" / "final" / "*.safetensors"))
        if files:
            from safetensors.torch import load_file

            seen = load_file(files[0])["seen"].tolist()
        stats = {}
        try:
            import urllib.request

            with urllib.request.urlopen(f"{svc.url}/v1/stats", timeout=10) as r:
                stats = json.loads(r.read())
        except OSError:
            pass
        return JobResult(rc, seen, reports, status, log_path.read_text(errors="replace"), events, wall, stats)
    finally:
        svc.stop()


@dataclass
class ElasticResult:
    agents: dict  # node name -> elastic_cluster.AgentRun
    seen: list[float] | None
    reports: list[dict]
    status: dict
    events: list[str]
    wall_s: float
    finished: bool
    history: list[dict] = field(default_factory=list)  # the Controller's rounds (rates, classes, eviction notes)
    gang_s: float = 0.0  # gang start: seconds until every agent had imported torchrun on its node
    node_stats: dict = field(default_factory=dict)  # CPU-quota nodes: cpu.stat (throttled periods and time)
    t0_perf: float = 0.0  # time.perf_counter() when the agents started (the origin of AgentRun.started_s/ended_s)

    def log(self) -> str:
        return "\n".join(f"===== agent {n} (rc {a.returncode}) =====\n{a.log[-6000:]}" for n, a in self.agents.items())


def run_elastic_job(out: str | os.PathLike, nodes: list, job: JobConfig, monitor: MonitorConfig | None = None,
                    controller: ControllerConfig | None = None, worker_args: list[str] | None = None,
                    min_nodes: int = 1, max_nodes: int | None = None, max_restarts: int = 3, timeout_s: float = 300,
                    kill_service_on_eviction: bool = False, service_down_s: float = 1.5,
                    after_eviction: list | None = None, gang_start: bool = False,
                    rdzv_backend: str = "c10d") -> ElasticResult:
    """AntDT-ND on emulated nodes (`elastic_cluster.Node`): the service, then one ``torchrun --nnodes MIN:MAX``
    agent per node. With ``kill_service_on_eviction`` the service is SIGKILLed as soon as it has blacklisted a node
    (the job is then checkpointing and re-forming) and restarted ``service_down_s`` later on the same port and
    database. ``after_eviction`` nodes start their agents once the job has re-formed without the evicted node: a
    spare joining, or (the same name) the evicted node trying to rejoin. ``gang_start``: the agents join the
    rendezvous together (`elastic_cluster.ElasticJob`). ``rdzv_backend="antdt"``: the agents check the job's blacklist
    before they join (`antdt_callbacks.rendezvous`)."""
    from elastic_cluster import ElasticJob, read_reports

    from antdt_callbacks import ShardingClient

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    events: list[str] = []
    svc = launch_service(out / "service.sqlite", job, monitor, controller)
    args = ["--url", svc.url, "--out", str(out / "run"), "--dataset-size", str(job.dataset_size),
            "--pg-timeout-s", "60", *(worker_args or [])]
    cluster = ElasticJob(out, nodes, args, min_nodes, max_nodes or len(nodes), max_restarts, gang_start=gang_start,
                         rdzv_backend=rdzv_backend, service_url=svc.url)
    t0 = time.time()
    stop_killer = threading.Event()
    killer = None
    if kill_service_on_eviction:
        killer = threading.Thread(target=_kill_service_on_eviction, args=(svc, service_down_s, events, stop_killer))
        killer.start()
    joined = threading.Event()
    try:
        cluster.start()
        if after_eviction:
            threading.Thread(target=_join_after_eviction, args=(svc, cluster, after_eviction, events, stop_killer,
                                                                joined), daemon=True).start()
        finished = cluster.wait(timeout_s, until=None)
        if after_eviction and joined.is_set():
            finished = cluster.wait(max(1.0, timeout_s - (time.time() - t0)))
        if not finished:
            events.append(f"job not finished after {timeout_s} s")
        stop_killer.set()
        if killer is not None:
            killer.join(timeout=60)
        wall = time.time() - t0
        agents = cluster.results()
    finally:
        stop_killer.set()
        cluster.stop()
    try:
        client = ShardingClient(svc.url, rank=0)
        status, history = client.status(), client.metrics()["history"]
    finally:
        svc.stop()
    seen = None
    files = glob.glob(str(out / "run" / "final" / "*.safetensors"))
    if files:
        from safetensors.torch import load_file

        seen = load_file(files[0])["seen"].tolist()
    return ElasticResult(agents, seen, read_reports(out / "run"), status, events, wall, finished, history,
                         cluster.gang_s, cluster.cgroup_stats, cluster.t0)


def _join_after_eviction(svc, cluster, nodes: list, events: list[str], stop: threading.Event,
                         joined: threading.Event) -> None:
    from antdt_callbacks import ShardingClient
    from antdt_callbacks.config import AgentConfig

    client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=5))
    while not stop.is_set():
        try:
            st = client.status()
            black = set(st.get("blacklist", {}))
            if black and st.get("nodes") and not black & set(st["nodes"]):
                break
        except Exception:  # noqa: BLE001 - the service may be restarting
            pass
        time.sleep(0.05)
    else:
        return
    # The evicted node is out of the job; its core is handed to what starts next (on two cores a spare has to reuse
    # one), so its co-tenants go with it.
    for node in cluster.nodes:
        if node.name in black and node.tenants is not None:
            node.tenants.stop()
    for node in nodes:
        cluster.start_agent(node)
        events.append(f"agent of {node.name} started after the eviction of {sorted(black)}")
    joined.set()


def _kill_service_on_eviction(svc, down_s: float, events: list[str], stop: threading.Event) -> None:
    from antdt_callbacks import ShardingClient
    from antdt_callbacks.config import AgentConfig

    client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=5))
    while not stop.is_set():
        try:
            if client.status().get("blacklist"):
                break
        except Exception:  # noqa: BLE001 - keep polling until stopped
            pass
        time.sleep(0.05)
    else:
        events.append("service kill skipped: no eviction")
        return
    svc.kill()
    events.append("service SIGKILLed once a node was blacklisted (re-formation under way)")
    time.sleep(down_s)
    svc.start()
    events.append(f"service restarted on {svc.url}")


def _kill_service_when(svc, samples: int, down_s: float, events: list[str], proc, timeout_s: float) -> None:
    from antdt_callbacks import ShardingClient
    from antdt_callbacks.config import AgentConfig

    client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=5))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if client.status()["acked_samples"] >= samples:
                break
        except Exception:  # noqa: BLE001 - keep polling until the deadline
            pass
        time.sleep(0.2)
    else:
        events.append("service kill skipped: job ended first")
        return
    svc.kill()
    events.append(f"service SIGKILLed after >= {samples} acked samples")
    time.sleep(down_s)
    svc.start()
    events.append(f"service restarted on {svc.url}")
