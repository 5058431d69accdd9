"""Configs of the AntDT components: the sharding job, the Monitor, the Controller, the service process and the
worker-side Agent.

Thresholds and windows are **our** parameters: the AntDT paper (arXiv 2404.09679) does not publish its values, so
every one of them is a field here. The defaults are values that worked for a small job on one CPU host (see
bench/antdt/README.md); treat them as starting points for your cluster.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgentConfig", "ControllerConfig", "JobConfig", "MonitorConfig", "ServeConfig"]


class _DictMixin:
    """``to_dict``/``from_dict`` with unknown keys rejected by name (a typo must not silently become a default)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown}; valid keys are {sorted(names)}.")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _positive(obj: object, name: str, allow_zero: bool = False) -> None:
    value = getattr(obj, name)
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{type(obj).__name__}.{name}={value!r} is invalid: it must be {bound}. Set a value {bound}.")


@dataclass
class JobConfig(_DictMixin):
    """What the sharding service serves: the sample-index space, its cut into shards, epochs and the worker roster.

    Parameters:
        > Parameters that control the data
        dataset_size (`int`): number of samples; sample ids are ``0 .. dataset_size - 1``.
        shard_size (`int`, *optional*, defaults to 16): samples per shard. Smaller shards balance finer, redo less
            after a failure and shorten the end-of-data tail a slow rank drains alone; larger ones cost fewer requests
            (leases are asynchronous, so small shards stay cheap: see bench/antdt).
        num_epochs (`int`, *optional*, defaults to 1): passes over the data.
        seed (`int`, *optional*, defaults to 0): seed of the per-epoch shard order and of the in-shard shuffle.
        shuffle (`bool`, *optional*, defaults to `True`): shuffle shard order and the samples inside each shard.
        > Parameters that control the workers
        world_size (`int`, *optional*, defaults to 1): ranks allowed to register (``0 .. world_size - 1``).
        global_batch_size (`int`, *optional*, defaults to 32): samples per optimizer step summed over ranks; the
            Controller redistributes it but keeps the sum.
        lease_ttl_s (`float`, *optional*, defaults to 10): a shard lease not renewed for this long expires and its
            unconsumed tail goes back to TODO.
        keep_snapshots (`int`, *optional*, defaults to 3): checkpoint snapshots kept besides the initial one.
    """

    dataset_size: int = field(default=0, metadata={"help": "Number of samples (ids 0..N-1)."})
    shard_size: int = field(default=16, metadata={"help": "Samples per shard."})
    num_epochs: int = field(default=1, metadata={"help": "Passes over the data."})
    seed: int = field(default=0, metadata={"help": "Seed of shard order and in-shard shuffle."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle shard order and samples inside shards."})
    world_size: int = field(default=1, metadata={"help": "Ranks allowed to register."})
    global_batch_size: int = field(default=32, metadata={"help": "Samples per optimizer step over all ranks."})
    lease_ttl_s: float = field(default=10.0, metadata={"help": "Seconds a lease lives without renewal."})
    keep_snapshots: int = field(default=3, metadata={"help": "Checkpoint snapshots kept (besides snapshot 0)."})

    def __post_init__(self) -> None:
        for name in ("dataset_size", "shard_size", "num_epochs", "world_size", "global_batch_size", "lease_ttl_s",
                     "keep_snapshots"):
            _positive(self, name)
        if self.global_batch_size < self.world_size:
            raise ValueError(f"JobConfig.global_batch_size={self.global_batch_size} is smaller than world_size="
                             f"{self.world_size}: every rank needs at least one sample per step. Raise it.")

    def initial_batch_sizes(self) -> list[int]:
        """Equal split of the global batch, remainder to the low ranks (what plain DDP would use)."""
        base, rem = divmod(self.global_batch_size, self.world_size)
        return [base + (1 if r < rem else 0) for r in range(self.world_size)]


@dataclass
class MonitorConfig(_DictMixin):
    """How per-rank compute time is turned into windows and straggler classes.

    Parameters:
        window_steps (`int`, *optional*, defaults to 5): steps per Monitor window (a rank's throughput is samples
            over local compute seconds in the window).
        straggler_threshold (`float`, *optional*, defaults to 0.2): a rank is slow in a window when its throughput is
            below ``(1 - straggler_threshold) * median``.
        consecutive_windows (`int`, *optional*, defaults to 2): slow windows in a row before it is a straggler.
        persistent_windows (`int`, *optional*, defaults to 6): a straggler slow for this many windows is persistent
            (transient before that).
        severe_ratio (`float`, *optional*, defaults to 0.5): throughput ratio to the median under which a persistent
            straggler is a kill-and-restart candidate (ND policy).
    """

    window_steps: int = field(default=5, metadata={"help": "Steps per Monitor window."})
    straggler_threshold: float = field(default=0.2, metadata={"help": "Relative gap to the median that is slow."})
    consecutive_windows: int = field(default=2, metadata={"help": "Slow windows in a row to call a straggler."})
    persistent_windows: int = field(default=6, metadata={"help": "Slow windows after which it is persistent."})
    severe_ratio: float = field(default=0.5, metadata={"help": "Ratio to median that is severe (ND restart)."})

    def __post_init__(self) -> None:
        for name in ("window_steps", "consecutive_windows", "persistent_windows"):
            _positive(self, name)
        for name in ("straggler_threshold", "severe_ratio"):
            v = getattr(self, name)
            if not 0 < v < 1:
                raise ValueError(f"MonitorConfig.{name}={v!r} is invalid: it must lie in (0, 1).")
        if self.persistent_windows < self.consecutive_windows:
            raise ValueError(f"MonitorConfig.persistent_windows={self.persistent_windows} is smaller than "
                             f"consecutive_windows={self.consecutive_windows}; a straggler cannot become persistent "
                             "before it is detected. Raise persistent_windows.")


@dataclass
class ControllerConfig(_DictMixin):
    """Which mitigation policy runs and its knobs.

    Parameters:
        policy (`str`, *optional*, defaults to `"dd"`): ``"dd"`` (dedicated heterogeneous cluster: batch sizes
            proportional to throughput, always), ``"nd"`` (non-dedicated: adjust only for detected stragglers and undo
            when they recover; kill-and-restart a persistent severe straggler when the cost rule says it pays), or
            ``"off"`` (static equal split, plain DDP).
        min_gain (`float`, *optional*, defaults to 0.1): apply a new split only when it shortens the predicted step
            time ``max_i b_i / tau_i`` by at least this fraction (hysteresis against noise).
        min_batch_size (`int`, *optional*, defaults to 1): smallest per-rank batch.
        cooldown_windows (`int`, *optional*, defaults to 1): windows to wait after a change before the next one.
        restart_cost_s (`float`, *optional*, defaults to 30): seconds a kill-and-restart costs (process restart,
            checkpoint load, redone steps); the ND rule restarts only when the time it saves exceeds this.
        max_restarts (`int`, *optional*, defaults to 0): kill-and-restart budget; keep it <= torchrun's
            ``--max-restarts``. 0 disables kill-and-restart.
        > Parameters that control node eviction (ND policy, elastic ``torchrun --nnodes MIN:MAX``)
        max_evictions (`int`, *optional*, defaults to 0): how many nodes the Controller may evict; 0 disables it. An
            evicted node is blacklisted: the job re-forms without it and it may not rejoin.
        evict_cost_s (`float`, *optional*, defaults to 30): seconds an eviction costs (checkpoint, re-rendezvous,
            worker restart, redone steps); the Controller evicts only when running without the node saves more.
        min_nodes (`int`, *optional*, defaults to 1): torchrun's ``MIN``; no eviction may leave fewer nodes.
        measure_reform_cost (`bool`, *optional*, defaults to `True`): once this job has re-formed (a restart, an
            eviction, a node joining), use the median of its measured re-formations (the leaving checkpoint's commit
            to the next round's re-form, on the service's clock) in place of ``evict_cost_s`` and
            ``restart_cost_s``.
    """

    policy: str = field(default="dd", metadata={"help": "dd | nd | off."})
    min_gain: float = field(default=0.1, metadata={"help": "Minimum predicted step-time gain to change the split."})
    min_batch_size: int = field(default=1, metadata={"help": "Smallest per-rank batch."})
    cooldown_windows: int = field(default=1, metadata={"help": "Windows to wait after a change."})
    restart_cost_s: float = field(default=30.0, metadata={"help": "Seconds one kill-and-restart costs."})
    max_restarts: int = field(default=0, metadata={"help": "Kill-and-restart budget (<= torchrun --max-restarts)."})
    max_evictions: int = field(default=0, metadata={"help": "Node eviction budget (0 = never evict)."})
    evict_cost_s: float = field(default=30.0, metadata={"help": "Seconds one node eviction costs."})
    min_nodes: int = field(default=1, metadata={"help": "torchrun's MIN nodes; no eviction goes below it."})
    measure_reform_cost: bool = field(default=True, metadata={
        "help": "Use this job's measured re-formations in place of evict_cost_s / restart_cost_s once there is one."})

    def __post_init__(self) -> None:
        self.policy = str(self.policy).lower()
        if self.policy not in ("dd", "nd", "off"):
            raise ValueError(f"ControllerConfig.policy={self.policy!r} is unknown. Use 'dd', 'nd' or 'off'.")
        _positive(self, "min_gain", allow_zero=True)
        _positive(self, "min_batch_size")
        _positive(self, "cooldown_windows", allow_zero=True)
        _positive(self, "restart_cost_s", allow_zero=True)
        _positive(self, "max_restarts", allow_zero=True)
        _positive(self, "max_evictions", allow_zero=True)
        _positive(self, "evict_cost_s", allow_zero=True)
        _positive(self, "min_nodes")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServeConfig(_DictMixin):
    """Where and how the service process listens.

    Parameters:
        db (`str`): SQLite file holding the whole state; a restarted service continues from it.
        host (`str`, *optional*, defaults to `"127.0.0.1"`): bind address. Anything but loopback requires `token`.
        port (`int`, *optional*, defaults to 0): TCP port; 0 picks a free one (see `port_file`).
        token (`str`, *optional*): shared secret every request must carry as ``Authorization: Bearer <token>``;
            defaults to the ``ANTDT_TOKEN`` environment variable.
        port_file (`str`, *optional*): file the bound ``host:port`` is written to once the service accepts requests.
        max_request_bytes (`int`, *optional*, defaults to 65536): larger bodies are rejected unread.
        commit_mode (`str`, *optional*, defaults to `"group"`): how decisions reach the state file. ``"group"``: a
            writer thread commits the decisions of concurrent requests together, one transaction and one fsync for
            many; ``"request"``: one transaction per request, under the service lock. Either way a reply is sent
            only after its decision is committed, so a restarted service never forgets what it answered; with
            many workers ``"group"`` sustains more requests per second (figures in bench/antdt/README.md).
    """

    db: str = field(default="antdt_state.sqlite", metadata={"help": "SQLite state file."})
    host: str = field(default="127.0.0.1", metadata={"help": "Bind address (non-loopback needs a token)."})
    port: int = field(default=0, metadata={"help": "TCP port (0 = a free one)."})
    token: str | None = field(default=None, metadata={"help": "Shared token (default: $ANTDT_TOKEN)."})
    port_file: str | None = field(default=None, metadata={"help": "Write host:port here once serving."})
    max_request_bytes: int = field(default=65536, metadata={"help": "Largest accepted request body."})
    commit_mode: str = field(default="group", metadata={"help": "group | request: transactions per group of "
                                                                "concurrent requests, or per request."})

    def __post_init__(self) -> None:
        if self.token is None:
            self.token = os.environ.get("ANTDT_TOKEN") or None
        self.commit_mode = str(self.commit_mode).lower()
        if self.commit_mode not in ("group", "request"):
            raise ValueError(f"ServeConfig.commit_mode={self.commit_mode!r} is unknown. Use 'group' (one transaction "
                             "for the requests that arrive together) or 'request' (one transaction per request).")
        if not 0 <= int(self.port) < 65536:
            raise ValueError(f"ServeConfig.port={self.port!r} is not a TCP port. Use 0..65535 (0 = any free port).")
        _positive(self, "max_request_bytes")
        if not _is_loopback(self.host) and not self.token:
            raise ValueError(f"ServeConfig.host={self.host!r} is not a loopback address, and no token is set: the "
                             "service would accept requests from the network unauthenticated. Set token (or "
                             "ANTDT_TOKEN), or bind 127.0.0.1.")


@dataclass
class AgentConfig(_DictMixin):
    """Worker-side settings: how the client, the iterable and the Agent talk to the service.

    Parameters:
        url (`str`, *optional*): service address ``http://host:port``; defaults to ``$ANTDT_SERVICE_URL``.
        token (`str`, *optional*): shared token; defaults to ``$ANTDT_TOKEN``.
        prefetch_batches (`int`, *optional*, defaults to 2): a rank leases ahead until it holds this many of its
            own current batches (so a rank given a small batch does not hoard data). Refills ask for one batch more
            and ride on the step's ack (one round trip per step); a prefetch thread is the fallback.
        prefetch_shards (`int`, *optional*, defaults to 8): at most this many shards leased ahead (more only when
            they are short tails that do not fill one batch).
        heartbeat_s (`float`, *optional*): lease renewal period; defaults to a third of the job's lease TTL. An
            accepted ack renews all of the worker's leases, so the heartbeat only sends when acks stop (stalls).
        request_timeout_s (`float`, *optional*, defaults to 10): socket timeout of one request.
        retry_timeout_s (`float`, *optional*, defaults to 60): how long a request is retried while the service is
            unreachable (a restarted service is picked up again) before `ServiceUnavailableError`.
        max_micro_batch (`int`, *optional*): memory cap of this rank; a larger planned batch is cut into
            micro-batches accumulated locally (one all-reduce per step). Defaults to ``$ANTDT_MAX_MICRO_BATCH``.
        wait_poll_s (`float`, *optional*, defaults to 0.05): pause between polls while the service says WAIT.
        stop_timeout_s (`float`, *optional*, defaults to 600): the longest all ranks poll together for data that is
            leased elsewhere before the iterable gives up with an error.
        ack_period_s (`float`, *optional*, defaults to 0.05): the Agent's ack sender wakes on its own clock at this
            period and sends the acks of every step since its last beat as one request. A step then only queues
            its ack: waking the sender from the step's end makes it compete for the GIL with the training thread's
            Python work and now and then stalls a step; on a beat of its own the sender keeps those stalls rare and
            short (figures in bench/antdt/README.md). Acks (and plan changes) arrive at most one period plus one
            round trip late; checkpoints flush at once. 0 wakes the sender from every step.
        checkpoint_on_sigterm (`bool`, *optional*, defaults to `True`): on SIGTERM, every rank checkpoints at one
            step and then exits, instead of dying mid-step. torchrun's agent sends SIGTERM to its workers when the
            job re-forms (a node joins or leaves the rendezvous) or when the agent itself is stopped (a scheduler's
            preemption), and waits 30 s before SIGKILL; without this the re-formed job resumes from the last
            periodic checkpoint and redoes the steps since. A second SIGTERM, or one after the checkpoint, exits at
            once.
    """

    url: str | None = field(default=None, metadata={"help": "Service URL (default: $ANTDT_SERVICE_URL)."})
    token: str | None = field(default=None, metadata={"help": "Shared token (default: $ANTDT_TOKEN)."})
    prefetch_batches: int = field(default=2, metadata={"help": "Own batches leased ahead."})
    prefetch_shards: int = field(default=8, metadata={"help": "Most shards leased ahead."})
    heartbeat_s: float | None = field(default=None, metadata={"help": "Lease renewal period (default TTL/3)."})
    request_timeout_s: float = field(default=10.0, metadata={"help": "Socket timeout per request."})
    retry_timeout_s: float = field(default=60.0, metadata={"help": "Retry budget while the service is down."})
    max_micro_batch: int | None = field(default=None, metadata={"help": "Memory cap (micro-batch size)."})
    wait_poll_s: float = field(default=0.05, metadata={"help": "Poll period while the service says WAIT."})
    stop_timeout_s: float = field(default=600.0, metadata={"help": "Longest joint wait for data."})
    ack_period_s: float = field(default=0.05, metadata={"help": "Ack sender beat (s); 0 = woken by every step."})
    checkpoint_on_sigterm: bool = field(default=True, metadata={
        "help": "On SIGTERM (torchrun re-forming or stopping the job), checkpoint every rank at one step, then exit."})

    def __post_init__(self) -> None:
        if self.url is None:
            self.url = os.environ.get("ANTDT_SERVICE_URL") or None
        if self.token is None:
            self.token = os.environ.get("ANTDT_TOKEN") or None
        if self.max_micro_batch is None and os.environ.get("ANTDT_MAX_MICRO_BATCH"):
            self.max_micro_batch = int(os.environ["ANTDT_MAX_MICRO_BATCH"])
        for name in ("prefetch_batches", "prefetch_shards", "request_timeout_s", "retry_timeout_s", "wait_poll_s",
                     "stop_timeout_s"):
            _positive(self, name)
        _positive(self, "ack_period_s", allow_zero=True)
        if self.heartbeat_s is not None:
            _positive(self, "heartbeat_s")
        if self.max_micro_batch is not None:
            _positive(self, "max_micro_batch")
