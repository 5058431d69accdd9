"""The shard service's decide -> apply loop without SQLite or HTTP, with a controllable clock (shared by the tests)."""

from __future__ import annotations

from antdt_callbacks import ControllerConfig, JobConfig, MonitorConfig
from antdt_callbacks._state import apply, decide, new_job_state


class ServiceSim:
    """decide -> apply, the way the server does it (minus SQLite), with a controllable clock."""

    def __init__(self, job: JobConfig, monitor: MonitorConfig, controller: ControllerConfig):
        self.st = new_job_state(job, monitor, controller)
        self.now = 1000.0
        self.n = 0

    def __call__(self, op: str, **req):
        self.n += 1
        d = decide(self.st, {"op": op, **req}, self.now)
        apply(self.st, d)
        return d.reply
