"""Load generator for the AntDT shard service: >= 1,000 simulated workers against the real service process.

The service runs the way users start it (``python -m antdt_callbacks serve``, through `launch_service`); the workers
are asyncio tasks in a few processes (`load_worker.py` says what each sends and at which pace). Each run measures,
over the steady window (after ``--warmup-s``), the latency of every request as the client sees it (median, p99,
IQR), the request throughput, refusals and failures, and the service's own counters (``GET /v1/stats``). At the end
it audits the committed SQLite state against the acks the clients were told were accepted, by sample id:
``lost`` (accepted but not in the state), ``duplicated`` (accepted twice), ``phantom`` (in the state, never
accepted).

``--commit-modes request,group`` runs both commit modes of the service, interleaved over ``--repeats``, so the two
are compared under the same conditions; ``--kill-run`` adds one run (with the last mode) whose service is SIGKILLed
at ``--kill-at-s`` and restarted on the same state file and port after ``--down-s``: its audit is the durability
check under load, and ``restart_s`` is the time from the kill to the new process accepting requests.
``--profile-s`` samples the service with py-spy (threads holding the GIL) during the steady window of each first
run per mode and reports where its CPU time goes.

Run: ``.venv/bin/python bench/antdt/load_service.py`` (defaults: 1,000 workers, 60 s per run, both modes, one
SIGKILL run; about 6 minutes) or ``--help``. It writes ``bench/results/antdt_scale.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import pickle
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from load_worker import OPS, ProcessSpec, Recorder, audit, run_process  # noqa: E402

from antdt_callbacks import AgentConfig, JobConfig, ShardingClient, launch_service  # noqa: E402

try:
    from bench.machine import cpu_info  # noqa: E402
except ImportError:  # pragma: no cover - bench/ without machine.py
    cpu_info = None


@dataclass
class LoadConfig:
    """One load run.

    Parameters:
        > Parameters that control the simulated job
        workers (`int`, *optional*, defaults to 1000): simulated ranks (the job's ``world_size``).
        procs (`int`, *optional*, defaults to 4): processes the workers are spread over (asyncio in each).
        duration_s (`float`, *optional*, defaults to 60): seconds of steps after step 0 (ignored with `until_end`).
        until_end (`bool`, *optional*, defaults to `False`): run until the dataset is consumed instead.
        step_s (`float`, *optional*, defaults to 1.0): step time: one ack per worker per step.
        pace (`str`, *optional*, defaults to `"async"`): ``async`` (own phase, +-`jitter`) or ``lockstep`` (one
            clock, acks spread over `ack_spread_s`).
        jitter (`float`, *optional*, defaults to 0.1): relative step-time jitter of the async pace.
        ack_spread_s (`float`, *optional*, defaults to 0.05): the Agent's send beat; spreads lockstep acks.
        batch (`int`, *optional*, defaults to 8): samples per worker per step.
        shard_size (`int`, *optional*, defaults to 16): samples per shard.
        dataset_size (`int`, *optional*, defaults to 0): samples; 0 sizes it so no worker runs dry in `duration_s`.
        lease_ttl_s (`float`, *optional*, defaults to 10): lease TTL; the heartbeat period is a third of it.
        prefetch_batches (`int`, *optional*, defaults to 2) / prefetch_shards (`int`, *optional*, defaults to 8):
            the Agent's lease-ahead depth.
        stall_prob (`float`, *optional*, defaults to 0.01): chance per step that a worker stalls for `stall_s`
            (its heartbeat renews meanwhile).
        stall_s (`float`, *optional*, defaults to 4): stall length; keep it below `lease_ttl_s`.
        > Parameters that control the service and the measurement
        commit_mode (`str`, *optional*): the service's ``--commit-mode``; ``None`` keeps its default.
        warmup_s (`float`, *optional*, defaults to 5): seconds after step 0 left out of the latency statistics.
        kill_at_s (`float`, *optional*): SIGKILL the service this many seconds after step 0, restart it after
            `down_s`.
        kill_at_acked (`int`, *optional*): SIGKILL once the service has acknowledged this many samples instead.
        down_s (`float`, *optional*, defaults to 1.0): seconds the service stays down after the kill.
        profile_s (`float`, *optional*, defaults to 0): py-spy the service for this many seconds after warm-up.
        request_timeout_s (`float`, *optional*, defaults to 10) / retry_timeout_s (`float`, *optional*, defaults
            to 60): client timeouts (one attempt / retries while the service is unreachable).
        timeout_s (`float`, *optional*): hard limit of the run; defaults to the duration plus two minutes.
        seed (`int`, *optional*, defaults to 0): seed of phases, jitter and stalls.
    """

    workers: int = 1000
    procs: int = 4
    duration_s: float = 60.0
    until_end: bool = False
    step_s: float = 1.0
    pace: str = "async"
    jitter: float = 0.1
    ack_spread_s: float = 0.05
    batch: int = 8
    shard_size: int = 16
    dataset_size: int = 0
    lease_ttl_s: float = 10.0
    prefetch_batches: int = 2
    prefetch_shards: int = 8
    stall_prob: float = 0.01
    stall_s: float = 4.0
    commit_mode: str | None = None
    warmup_s: float = 5.0
    kill_at_s: float | None = None
    kill_at_acked: int | None = None
    down_s: float = 1.0
    profile_s: float = 0.0
    request_timeout_s: float = 10.0
    retry_timeout_s: float = 60.0
    timeout_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "procs", "step_s", "batch", "shard_size", "lease_ttl_s", "prefetch_batches",
                     "prefetch_shards", "request_timeout_s", "retry_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LoadConfig.{name}={getattr(self, name)!r} must be > 0. Set a positive value.")
        for name in ("duration_s", "jitter", "ack_spread_s", "dataset_size", "stall_prob", "stall_s", "warmup_s",
                     "down_s", "profile_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoadConfig.{name}={getattr(self, name)!r} must be >= 0. Set 0 or more.")
        if self.pace not in ("async", "lockstep"):
            raise ValueError(f"LoadConfig.pace={self.pace!r} is unknown. Use 'async' or 'lockstep'.")
        if self.procs > self.workers:
            raise ValueError(f"LoadConfig.procs={self.procs} exceeds workers={self.workers}: every process needs a "
                             "worker. Lower procs.")
        if not self.until_end and self.duration_s <= self.warmup_s:
            raise ValueError(f"LoadConfig.duration_s={self.duration_s} leaves no steady window after warmup_s="
                             f"{self.warmup_s}. Raise duration_s or lower warmup_s.")
        if self.stall_prob > 0 and self.stall_s >= self.lease_ttl_s:
            raise ValueError(f"LoadConfig.stall_s={self.stall_s} >= lease_ttl_s={self.lease_ttl_s}: a stalled "
                             "worker's heartbeat would race its lease expiry. Lower stall_s or raise lease_ttl_s.")
        if self.kill_at_s is not None and self.kill_at_acked is not None:
            raise ValueError("LoadConfig: set kill_at_s or kill_at_acked, not both.")
        if self.dataset_size == 0:
            if self.until_end:
                raise ValueError("LoadConfig.dataset_size=0 with until_end=True: the run would never end. Set the "
                                 "dataset size.")
            steps = math.ceil(self.duration_s / self.step_s * (1 + self.jitter)) + self.prefetch_batches + 4
            self.dataset_size = self.workers * self.batch * steps

    def job(self) -> JobConfig:
        return JobConfig(dataset_size=self.dataset_size, shard_size=self.shard_size, world_size=self.workers,
                         global_batch_size=self.workers * self.batch, lease_ttl_s=self.lease_ttl_s, seed=self.seed)


# ------------------------------------------------------------------------------------------------- statistics
def latency_stats(lat_s: np.ndarray) -> dict:
    """Median, p99, IQR, mean of latencies in milliseconds (NaN when empty)."""
    if lat_s.size == 0:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "iqr_ms": float("nan"),
                "p25_ms": float("nan"), "p75_ms": float("nan"), "mean_ms": float("nan"), "max_ms": float("nan")}
    ms = lat_s * 1e3
    p25, p50, p75, p99 = np.percentile(ms, [25, 50, 75, 99])
    return {"n": int(ms.size), "p50_ms": float(p50), "p99_ms": float(p99), "iqr_ms": float(p75 - p25),
            "p25_ms": float(p25), "p75_ms": float(p75), "mean_ms": float(ms.mean()), "max_ms": float(ms.max())}


def _window_stats(rows: np.ndarray, t_lo: float, t_hi: float) -> dict:
    sel = rows[(rows[:, 0] >= t_lo) & (rows[:, 0] < t_hi)] if rows.size else rows
    out = {"window_s": t_hi - t_lo, "requests": int(len(sel)),
           "requests_per_s": float(len(sel) / max(t_hi - t_lo, 1e-9)), **latency_stats(sel[:, 1] if len(sel) else
                                                                                      np.empty(0))}
    out["timeline"] = _timeline(sel, t_lo)
    out["by_op"] = {op: {"requests": int((sel[:, 2] == i).sum()), **latency_stats(sel[sel[:, 2] == i, 1])}
                    for i, op in enumerate(OPS) if len(sel) and (sel[:, 2] == i).any()}
    return out


def _timeline(rows: np.ndarray, t_lo: float) -> list[list[float]]:
    """Per second of the window: [second, requests, p50 ms, p99 ms, max ms] (where the tail comes from)."""
    if not len(rows):
        return []
    sec = np.floor(rows[:, 0] - t_lo).astype(int)
    out = []
    for k in np.unique(sec):
        lat = rows[sec == k, 1] * 1e3
        p50, p99 = np.percentile(lat, [50, 99])
        out.append([int(k), int(lat.size), round(float(p50), 2), round(float(p99), 2), round(float(lat.max()), 2)])
    return out


# ------------------------------------------------------------------------------------------------- profile
_CATEGORIES = (  # (label, substrings of a frame's file), matched from the leaf up: the first hit owns the sample
    ("deepcopy", ("/copy.py",)),
    ("json", ("/json/",)),
    ("sqlite", ("sqlite3",)),
    ("controller", ("antdt_callbacks/controller.py",)),
    ("store", ("antdt_callbacks/store.py",)),
    ("state machine", ("antdt_callbacks/_state.py",)),
    ("server", ("antdt_callbacks/server.py",)),
    ("http parsing", ("/http/", "/email/", "socketserver.py")),
    ("socket", ("/socket.py", "selectors.py")),
    ("threads", ("/threading.py",)),
)


def summarize_profile(raw: str, top: int = 15) -> dict:
    """py-spy ``--format raw`` (collapsed stacks) -> share of samples by category and the top functions by self
    time."""
    cats: Counter = Counter()
    selfs: Counter = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f for f in stack.split(";") if f]
        leaf = frames[-1] if frames else "?"
        selfs[leaf.split(":")[0]] += n
        label = "other"
        for frame in reversed(frames):
            label = next((lab for lab, keys in _CATEGORIES if any(k in frame for k in keys)), None)
            if label:
                break
        cats[label or "other"] += n
    return {"samples": total, "by_category": {k: round(v / max(total, 1), 4) for k, v in cats.most_common()},
            "top_self": [[k, round(v / max(total, 1), 4)] for k, v in selfs.most_common(top)]}


def _start_profiler(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(spy):
        print("py-spy not found: no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate",
                             "200", "--gil", "--nonblocking", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# ------------------------------------------------------------------------------------------------- one run
def run_load(cfg: LoadConfig, workdir: str | os.PathLike) -> dict:
    """Start the service, run the workers, optionally SIGKILL and restart the service, audit the state file."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    job = cfg.job()
    db = workdir / "state.sqlite"
    kwargs = {"commit_mode": cfg.commit_mode} if cfg.commit_mode else {}
    svc = launch_service(db, job, **kwargs)
    probe = ShardingClient(svc.url, config=AgentConfig(url=svc.url, retry_timeout_s=cfg.retry_timeout_s))
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    t_start = time.time()
    t0 = t_start + 3.0 + cfg.workers / 2000  # processes import and connect before step 0
    run_s = cfg.duration_s if not cfg.until_end else 0.0
    limit = cfg.timeout_s or (cfg.duration_s + 120 if not cfg.until_end else 300)
    stop_at, deadline = t0 + run_s, t_start + limit
    ctx = mp.get_context("spawn")
    procs, outs = [], []
    events: list[str] = []
    profile: dict | None = None
    restart_s = None
    try:
        per = np.array_split(np.arange(cfg.workers), cfg.procs)
        for i, ranks in enumerate(per):
            out = str(workdir / f"proc{i}.pkl")
            outs.append(out)
            spec = ProcessSpec(host=host, port=int(port), ranks=[int(r) for r in ranks], t0=t0, stop_at=stop_at,
                               deadline=deadline - 10, out=out, step_s=cfg.step_s, pace=cfg.pace, jitter=cfg.jitter,
                               ack_spread_s=cfg.ack_spread_s, batch=cfg.batch, prefetch_batches=cfg.prefetch_batches,
                               prefetch_shards=cfg.prefetch_shards, lease_ttl_s=cfg.lease_ttl_s,
                               stall_prob=cfg.stall_prob, stall_s=cfg.stall_s, until_end=cfg.until_end,
                               request_timeout_s=cfg.request_timeout_s, retry_timeout_s=cfg.retry_timeout_s,
                               seed=cfg.seed * 7919 + i)
            p = ctx.Process(target=run_process, args=(spec,), daemon=True)
            p.start()
            procs.append(p)
        spy = None
        spy_out = workdir / "profile.txt"
        killed = cfg.kill_at_s is None and cfg.kill_at_acked is None
        while any(p.is_alive() for p in procs) and time.time() < deadline:
            now = time.time()
            if cfg.profile_s and spy is None and now >= t0 + cfg.warmup_s:
                spy = _start_profiler(svc.pid, min(cfg.profile_s, max(1.0, stop_at - now - 1)), spy_out)
                events.append(f"profiler attached at {now - t0:.1f} s")
            if not killed:
                due = (cfg.kill_at_s is not None and now >= t0 + cfg.kill_at_s) or (
                    cfg.kill_at_acked is not None and probe.status()["acked_samples"] >= cfg.kill_at_acked)
                if due:
                    acked_before = probe.status()["acked_samples"] if cfg.kill_at_acked is not None else None
                    # A status reply leaves right after a commit: kill at a random phase of the step instead, so
                    # that the kill may land while a transaction is being written and replies are waiting for it.
                    time.sleep(random.Random(cfg.seed).uniform(0, cfg.step_s))
                    t_kill = time.time()
                    svc.kill()
                    events.append(f"SIGKILL at {t_kill - t0:.2f} s" + (f" ({acked_before} samples acked)"
                                                                         if acked_before is not None else ""))
                    time.sleep(cfg.down_s)
                    t_up = time.time()
                    svc.start()
                    restart_s = time.time() - t_up
                    events.append(f"restarted at {time.time() - t0:.2f} s (start-up {restart_s:.2f} s)")
                    killed = True
            time.sleep(0.1 if cfg.kill_at_acked is not None and not killed else 0.25)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                events.append(f"load process {p.pid} killed at the run's deadline")
        if spy is not None:
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = b"timeout"
            if spy_out.exists():
                profile = summarize_profile(spy_out.read_text())
            else:
                events.append(f"py-spy wrote nothing: {err.decode(errors='replace')[-300:]}")
        stats = _get_stats(svc.url)
    finally:
        svc.stop()
    recs: list[Recorder] = [pickle.loads(Path(o).read_bytes()) for o in outs if os.path.exists(o)]
    rows = np.array([r for rec in recs for r in rec.rows], dtype=np.float64).reshape(-1, 4)
    acked = [a for rec in recs for a in rec.acked]
    t_hi = stop_at if not cfg.until_end else (rows[:, 0].max() if rows.size else t0)
    steady = _window_stats(rows, t0 + cfg.warmup_s, t_hi)
    errors = sum((rec.errors for rec in recs), Counter())
    failed = sum((rec.failed for rec in recs), Counter())
    aud = audit(str(db), job, acked)
    served = sum(stats.get("requests", {}).values())
    # The service's CPU per request (start-up included): unlike latency, it hardly depends on what else runs.
    cpu_ms = stats["cpu_s"] / served * 1e3 if served and "cpu_s" in stats else float("nan")
    return {
        "config": dataclasses.asdict(cfg), "events": events, "steady": steady,
        "all": _window_stats(rows, t_start, float(rows[:, 0].max()) + 1 if rows.size else t0),
        "errors": int(sum(errors.values())), "errors_by_kind": dict(errors), "failed_workers": dict(failed),
        "missing_processes": cfg.procs - len(recs), "finished_workers": sum(rec.finished for rec in recs),
        "retries": sum(rec.retries for rec in recs), "fenced_leases": sum(rec.fenced_leases for rec in recs),
        "restart_s": restart_s, "audit": aud, "service_stats": stats, "service_cpu_ms_per_request": cpu_ms,
        "profile": profile,
        "loadavg": {"start": list(load_start), "end": list(os.getloadavg())},
    }


def _get_stats(url: str) -> dict:
    import http.client

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v1/stats")
        return json.loads(conn.getresponse().read())
    except (OSError, ValueError) as e:
        return {"error": repr(e)}
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------- report
def _median_iqr(values: list[float]) -> dict:
    v = np.asarray([x for x in values if x == x], dtype=float)
    if v.size == 0:
        return {"median": float("nan"), "iqr": float("nan"), "runs": 0}
    q25, q50, q75 = np.percentile(v, [25, 50, 75])
    return {"median": float(q50), "iqr": float(q75 - q25), "runs": int(v.size)}


def _mode_summary(runs: list[dict]) -> dict:
    return {key: _median_iqr([r["steady"][key] for r in runs])
            for key in ("p50_ms", "p99_ms", "iqr_ms", "requests_per_s")} | {
        "service_cpu_ms_per_request": _median_iqr([r["service_cpu_ms_per_request"] for r in runs]),
        "errors": sum(r["errors"] for r in runs), "lost": sum(r["audit"]["lost"] for r in runs),
        "duplicated": sum(r["audit"]["duplicated"] for r in runs)}


def _table(result: dict) -> str:
    lines = [f"{'run':<26}{'workers':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'IQR ms':>9}{'cpu ms/req':>11}"
             f"{'errors':>8}{'lost':>6}{'dup':>5}{'restart s':>11}"]
    for r in result["runs"]:
        s, c = r["steady"], r["config"]
        name = f"{c['pace']}/{c['commit_mode'] or 'default'}{' +SIGKILL' if r['restart_s'] is not None else ''}"
        rs = f"{r['restart_s']:.2f}" if r["restart_s"] is not None else "-"
        lines.append(f"{name:<26}{c['workers']:>8}{s['requests_per_s']:>9.0f}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.1f}"
                     f"{s['iqr_ms']:>9.2f}{r['service_cpu_ms_per_request']:>11.3f}{r['errors']:>8}"
                     f"{r['audit']['lost']:>6}{r['audit']['duplicated']:>5}{rs:>11}")
    return "\n".join(lines)


def _brief(run: dict) -> dict:
    """A run without its per-request detail (for the baseline embedded from another result file)."""
    return {k: v for k, v in run.items() if k not in ("all",)} | {
        "steady": {k: v for k, v in run["steady"].items() if k != "timeline"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = LoadConfig()
    for f in dataclasses.fields(LoadConfig):
        if f.name in ("commit_mode", "kill_at_s", "kill_at_acked", "dataset_size", "until_end", "pace"):
            continue
        typ = type(getattr(defaults, f.name)) if getattr(defaults, f.name) is not None else float
        ap.add_argument("--" + f.name.replace("_", "-"), type=typ, default=getattr(defaults, f.name))
    ap.add_argument("--dataset-size", type=int, default=0, help="0: sized for the duration")
    ap.add_argument("--commit-modes", default="request,group",
                    help="comma-separated service commit modes, run interleaved ('default' = the service's default)")
    ap.add_argument("--paces", default="async,lockstep",
                    help="comma-separated paces; the first is the headline, run --repeats times per mode")
    ap.add_argument("--repeats", type=int, default=2, help="runs per commit mode at the first pace")
    ap.add_argument("--other-repeats", type=int, default=1, help="runs per commit mode at the other paces")
    ap.add_argument("--kill-run", type=int, default=1,
                    help="1: one more run (first pace, last mode) with a SIGKILL + restart of the service")
    ap.add_argument("--kill-at-s", type=float, default=30.0, help="when the kill run SIGKILLs the service")
    ap.add_argument("--baseline", default=None,
                    help="a result file of an earlier service (e.g. the code before a change) to embed as 'baseline'")
    ap.add_argument("--baseline-note", default="", help="what the baseline is and how it was run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "antdt_scale.json"))
    ap.add_argument("--conditions", default="2 cores shared with other engineers' jobs while measuring",
                    help="how loaded the machine was (stored in the JSON with the load averages)")
    args = ap.parse_args(argv)
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(LoadConfig) if hasattr(args, f.name)}
    modes = [None if m == "default" else m for m in args.commit_modes.split(",") if m]
    paces = [p for p in args.paces.split(",") if p]
    load_start = os.getloadavg()
    runs: list[dict] = []
    t_all = time.time()
    # Modes alternate inside each repeat, so slow drift of the shared machine hits both alike.
    plan = [(pace, rep, mode) for k, pace in enumerate(paces)
            for rep in range(args.repeats if k == 0 else args.other_repeats) for mode in modes]
    if args.kill_run:
        plan.append((paces[0], -1, modes[-1]))
    with tempfile.TemporaryDirectory(prefix="antdt_load_") as tmp:
        for i, (pace, rep, mode) in enumerate(plan):
            kill = rep < 0
            cfg = LoadConfig(**{**base, "pace": pace, "commit_mode": mode, "seed": base["seed"] + max(rep, 0),
                                "kill_at_s": args.kill_at_s if kill else None,
                                "profile_s": base["profile_s"] if rep == 0 and pace == paces[0] else 0.0})
            print(f"[{i + 1}/{len(plan)}] pace={pace} commit_mode={mode or 'default'} "
                  f"repeat={rep if rep >= 0 else 'kill'} workers={cfg.workers} duration={cfg.duration_s:.0f} s",
                  flush=True)
            res = run_load(cfg, Path(tmp) / f"run{i}")
            res["repeat"] = rep
            runs.append(res)
            st = res["steady"]
            print(f"    {st['requests_per_s']:.0f} req/s  p50 {st['p50_ms']:.2f} ms  p99 {st['p99_ms']:.1f} ms  "
                  f"errors {res['errors']}  lost {res['audit']['lost']}  dup {res['audit']['duplicated']}  "
                  f"{'; '.join(res['events'])}", flush=True)
    steady = [r for r in runs if r["repeat"] >= 0]
    by_pace = {pace: {str(m or "default"): _mode_summary([r for r in steady if r["config"]["commit_mode"] == m
                                                          and r["config"]["pace"] == pace]) for m in modes}
               for pace in paces}
    main_mode = str(modes[-1] or "default")
    head = by_pace[paces[0]][main_mode]
    kill = next((r for r in runs if r["repeat"] < 0), None)
    summary = {
        "workers": args.workers, "pace": paces[0], "step_s": args.step_s, "commit_mode": main_mode,
        "requests_per_s": head["requests_per_s"]["median"], "latency_ms_p50": head["p50_ms"]["median"],
        "latency_ms_p99": head["p99_ms"]["median"], "latency_ms_iqr": head["iqr_ms"]["median"],
        "errors": sum(r["errors"] for r in runs), "lost": sum(r["audit"]["lost"] for r in runs),
        "duplicated": sum(r["audit"]["duplicated"] for r in runs),
        "restart_s": kill["restart_s"] if kill else None,
        "by_commit_mode": by_pace[paces[0]], "by_pace": by_pace,
    }
    summary["p50_ms"], summary["p99_ms"] = summary["latency_ms_p50"], summary["latency_ms_p99"]
    if kill is not None:
        a = kill["audit"]
        summary["sigkill_run"] = {
            "commit_mode": kill["config"]["commit_mode"], "restart_s": kill["restart_s"], "events": kill["events"],
            "lost": a["lost"], "duplicated": a["duplicated"], "phantom": a["phantom"], "errors": kill["errors"],
            "client_retries": kill["retries"], "longest_request_ms": kill["all"]["max_ms"],
            "state_identical_after_restart": a["lost"] == a["duplicated"] == a["phantom"] == 0}
    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "cpu": cpu_info() if cpu_info else None, "conditions": args.conditions,
               "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg())}
    result: dict = {"summary": summary, "runs": runs, "machine": machine, "total_wall_s": time.time() - t_all}
    if args.baseline:
        b = json.loads(Path(args.baseline).read_text())
        result["baseline"] = {"note": args.baseline_note, "summary": {k: v for k, v in b["summary"].items()
                                                                      if k not in ("by_pace",)},
                              "machine": b.get("machine"), "runs": [_brief(r) for r in b["runs"]]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(_table(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
