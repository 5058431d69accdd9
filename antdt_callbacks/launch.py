"""Start the service as its own process (tests, benchmarks, notebooks): ``launch_service(...)``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config import ControllerConfig, JobConfig, MonitorConfig
from .errors import ServiceUnavailableError

__all__ = ["ServiceProcess", "launch_service"]


class ServiceProcess:
    """A ``python -m antdt_callbacks serve`` child. ``kill()`` SIGKILLs it; ``restart()`` starts it again on the
    same database and port, the way an operator (or a supervisor) would after a crash."""

    def __init__(self, db: str, job: JobConfig, monitor: MonitorConfig | None, controller: ControllerConfig | None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None, startup_timeout_s: float = 60,
                 log_path: str | None = None, commit_mode: str | None = None):
        self.db, self.job, self.host, self.port, self.token = db, job, host, port, token
        self.commit_mode = commit_mode  # None: the service's default (`ServeConfig.commit_mode`)
        self.monitor, self.controller = monitor or MonitorConfig(), controller or ControllerConfig()
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path or (db + ".log")
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.start()

    def _argv(self, port_file: str) -> list[str]:
        argv = [sys.executable, "-m", "antdt_callbacks", "serve", "--db", self.db, "--host", self.host,
                "--port", str(self.port), "--port-file", port_file]
        if self.commit_mode is not None:
            argv += ["--commit-mode", self.commit_mode]
        for cfg in (self.job, self.monitor, self.controller):
            for k, v in cfg.to_dict().items():
                argv += ["--" + k.replace("_", "-"), str(v)]
        return argv

    def start(self) -> ServiceProcess:
        port_file = tempfile.mktemp(prefix="antdt_port_", dir=str(Path(self.db).parent))
        env = dict(os.environ)
        if self.token:
            env["ANTDT_TOKEN"] = self.token
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._argv(port_file), stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise ServiceUnavailableError(f"service exited with code {self.proc.returncode} at start-up; see "
                                              f"{self.log_path}:\n{Path(self.log_path).read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise ServiceUnavailableError(f"service did not start within {self.startup_timeout_s} s.")
            time.sleep(0.05)
        address = Path(port_file).read_text().strip()
        os.unlink(port_file)
        self.port = int(address.rsplit(":", 1)[1])
        self.url = f"http://{address}"
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no chance to flush anything; durability comes from committing every decision before its reply."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def restart(self) -> ServiceProcess:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_service(db: str | os.PathLike, job: JobConfig, monitor: MonitorConfig | None = None,
                   controller: ControllerConfig | None = None, **kwargs) -> ServiceProcess:
    """Start ``python -m antdt_callbacks serve`` on loopback (a free port unless ``port=`` is given) and wait until
    it accepts requests. Returns a `ServiceProcess` (a context manager that stops it)."""
    return ServiceProcess(str(db), job, monitor, controller, **kwargs)
