"""Run a whole AntDT job on this machine with real processes: the service (``python -m antdt_callbacks serve``)
plus ``torchrun --max-restarts`` over `train_worker.py`, with optional faults. Shared by the fault tests, the
benchmark and the notebook.

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
