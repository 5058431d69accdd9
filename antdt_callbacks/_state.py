"""The sharding service's state machine: pure ``decide(state, request, now) -> Decision``.

Legend of a shard's life (our state names, DLRover/ElasticDL lineage; AntDT's own are not published):

- ``TODO``  : waiting to be leased; ``acked`` samples of it (from its start, in its own order) are already consumed,
              so a lease hands out only the unconsumed tail ``[acked, size)``.
- ``DOING`` : leased by ``owner`` (rank) in ``incarnation`` under fencing ``token`` until ``deadline``; acks move
              ``acked`` forward; heartbeats move ``deadline``.
- ``DONE``  : every sample acked.

`decide` never mutates its inputs: it validates the *whole* request first (so a rejected request changes nothing),
then returns the rows to write and the reply. `apply` folds them into the in-memory state; the server sends the
reply only once the rows are committed (fsync), whether one request commits at a time or a group (see `server`).
Lookups go through `ShardIndex` (`_index`), which `apply` keeps in step with the table, so a request costs what it
touches rather than the size of the table. Acks are idempotent by construction (absolute offsets); leases carry a
client request id whose reply is replayed, so a request retried after a crash between commit and reply is safe.
"""

from __future__ import annotations

import copy
import functools
import json
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._index import ShardIndex
from .config import ControllerConfig, JobConfig, MonitorConfig
from .controller import (
    _REFORMS_KEPT,
    Plan,
    controller_step,
    equal_split,
    evict_node,
    eviction_refusal,
    initial_control_state,
    monitor_observe,
)
from .errors import (
    BadRequestError,
    FencedError,
    NotFoundError,
    RefusedError,
    StaleIncarnationError,
    UnknownWorkerError,
)

__all__ = ["Decision", "JobState", "Shard", "Worker", "apply", "decide", "new_job_state", "shard_sample_ids"]

TODO, DOING, DONE = "TODO", "DOING", "DONE"
OPS = ("register", "lease", "ack", "renew", "release", "commit", "restore", "reform", "evict", "plan", "status",
       "metrics")
_REPLY_CACHE = 64


class Shard(NamedTuple):
    """One row of the shard table. A tuple of plain values rather than a dataclass: tuples holding only atomic values
    are not tracked by the cyclic garbage collector, so the table (tens of thousands of rows) does not lengthen
    its full collections, which stop the service."""

    epoch: int
    shard_id: int
    start: int
    end: int
    order: int
    state: str = TODO
    owner: int = -1
    incarnation: int = -1
    token: int = 0
    deadline: float = 0.0
    acked: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.epoch, self.shard_id)

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Worker:
    rank: int
    incarnation: int
    pid: int = 0
    max_micro_batch: int | None = None


@dataclass
class JobState:
    """Everything the service knows; rebuilt from SQLite at start-up."""

    job: JobConfig
    monitor_cfg: MonitorConfig
    controller_cfg: ControllerConfig
    epoch: int = 0
    lease_seq: int = 0
    shards: dict[tuple[int, int], Shard] = field(default_factory=dict)
    workers: dict[int, Worker] = field(default_factory=dict)
    control: dict = field(default_factory=dict)
    snapshots: dict[int, dict] = field(default_factory=dict)
    replies: dict[tuple[int, str], str] = field(default_factory=dict)  # JSON text of cached lease replies
    index: ShardIndex = field(default_factory=ShardIndex, repr=False, compare=False)

    def reindex(self) -> None:
        """Rebuild the lookup index after the shard table was set directly (load from the store)."""
        self.index = ShardIndex.build(self.shards.values())


@dataclass
class Decision:
    """Rows to persist and the reply. ``replace_shards`` means the shard table is replaced (restore)."""

    reply: dict[str, Any]
    shards: list[Shard] = field(default_factory=list)
    replace_shards: bool = False
    workers: list[Worker] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    snapshot_put: tuple[int, dict] | None = None
    snapshot_drop: list[int] = field(default_factory=list)
    reply_cache: tuple[int, str] | None = None
    cached_reply: dict[str, Any] | None = None  # what `reply_cache` stores when it is not the whole reply
    # Monitor entries this decision changed, per rank: ``{str(rank): {"last_step": ..., "pending": ..., ...}}``
    # (every entry of those ranks). `apply` writes them into the state's Monitor maps in place; ``meta["control"]``
    # then carries the rest of the control state, with the state's own Monitor.
    monitor: dict[str, dict[str, Any]] = field(default_factory=dict)
    reset_monitor: bool = False  # the Monitor rows are replaced by ``monitor`` (the job re-formed: new ranks)

    @functools.cached_property
    def cache_text(self) -> str:
        """JSON of what `reply_cache` stores: the state keeps it, and the file, as text (a string is not tracked by
        the garbage collector; a cache of reply dicts, one per recent lease, would lengthen its collections)."""
        return json.dumps(self.cached_reply if self.cached_reply is not None else self.reply)

    @property
    def mutates(self) -> bool:
        return bool(self.shards or self.replace_shards or self.workers or self.meta or self.snapshot_put
                    or self.snapshot_drop or self.reply_cache or self.monitor or self.reset_monitor)


def make_epoch_shards(job: JobConfig, epoch: int) -> list[Shard]:
    """Contiguous sample-id ranges; with ``shuffle`` their lease order is a seeded permutation per epoch."""
    n = -(-job.dataset_size // job.shard_size)
    order = np.arange(n)
    if job.shuffle:
        order = np.random.default_rng([job.seed, epoch]).permutation(n)
    return [Shard(epoch, i, i * job.shard_size, min((i + 1) * job.shard_size, job.dataset_size), int(order[i]))
            for i in range(n)]


def shard_sample_ids(job: JobConfig, epoch: int, shard_id: int, start: int, end: int) -> np.ndarray:
    """Sample ids of a shard in consumption order (seeded in-shard shuffle), computed identically by every party."""
    ids = np.arange(start, end, dtype=np.int64)
    if job.shuffle:
        ids = start + np.random.default_rng([job.seed, epoch, shard_id, 1]).permutation(end - start)
    return ids


def new_job_state(job: JobConfig, monitor_cfg: MonitorConfig, controller_cfg: ControllerConfig) -> JobState:
    st = JobState(job, monitor_cfg, controller_cfg)
    st.shards = {s.key: s for s in make_epoch_shards(job, 0)}
    st.reindex()
    st.control = initial_control_state(job.world_size, job.initial_batch_sizes())
    st.snapshots[0] = _snapshot(st)
    return st


def _snapshot(st: JobState) -> dict:
    # In-flight shards are stored as TODO at their acked offset: the checkpointed model saw exactly the acked part.
    rows = [[s.epoch, s.shard_id, s.start, s.end, s.order, DONE if s.state == DONE else TODO, s.acked]
            for s in st.shards.values()]
    return {"epoch": st.epoch, "shards": rows, "plan": st.control["plan"]}


# ---------------------------------------------------------------------------------------------------- validation
def _int(req: dict, name: str, lo: int | None = None, hi: int | None = None, default: Any = ...) -> int:
    if name not in req:
        if default is ...:
            raise BadRequestError(f"field {name!r} is required.")
        return default
    v = req[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequestError(f"field {name!r} must be an integer, got {type(v).__name__}.")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequestError(f"field {name!r}={v} is out of range [{lo}, {hi}].")
    return v


def _num(req: dict, name: str, default: float = 0.0) -> float:
    v = req.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v > 1e9:
        raise BadRequestError(f"field {name!r} must be a finite non-negative number, got {v!r}.")
    return float(v)


def _items(req: dict, max_items: int = 256) -> list[dict]:
    items = req.get("items", [])
    if not isinstance(items, list) or len(items) > max_items or not all(isinstance(i, dict) for i in items):
        raise BadRequestError(f"field 'items' must be a list of at most {max_items} objects.")
    return items


def active_world(st: JobState) -> int:
    """Ranks of the current rendezvous round (the job's ``world_size`` until a ``reform`` says otherwise)."""
    return len(st.control["plan"]["batch_sizes"])


def generation(st: JobState) -> int:
    """The job's incarnation: +1 at every ``reform`` (rendezvous round), monotonic per job, never per agent."""
    return int(st.control.get("generation", 0))


def _check_rank(st: JobState, rank: int) -> None:
    world = active_world(st)
    if rank >= world:
        raise UnknownWorkerError(f"rank {rank} is outside the current round's world size {world} (the job's "
                                 f"world_size={st.job.world_size}, generation {generation(st)}).")


def _check_generation(st: JobState, rank: int, inc: int) -> None:
    gen = generation(st)
    if inc < gen:
        raise StaleIncarnationError(f"rank {rank} incarnation {inc} is older than the job's generation {gen}: this "
                                    "process belongs to an earlier rendezvous round (a spare or zombie with a stale "
                                    "incarnation) and must stop; the current round re-formed without it.")


def _worker(st: JobState, req: dict) -> tuple[int, int]:
    rank = _int(req, "rank", 0, 1 << 20)
    inc = _int(req, "incarnation", 0, 1 << 30)
    _check_rank(st, rank)
    _check_generation(st, rank, inc)
    w = st.workers.get(rank)
    if w is None:
        raise UnknownWorkerError(f"rank {rank} has not registered; call register first.")
    if inc < w.incarnation:
        raise StaleIncarnationError(f"rank {rank} incarnation {inc} is older than the registered incarnation "
                                    f"{w.incarnation}: this process was replaced by a restart and must stop.")
    if inc > w.incarnation:
        raise StaleIncarnationError(f"rank {rank} incarnation {inc} has not registered (registered: "
                                    f"{w.incarnation}); call register first.")
    return rank, inc


def _expired(st: JobState, now: float) -> dict[tuple[int, int], Shard]:
    """Leases past their deadline go back to TODO keeping their acked offset (only the tail is redone)."""
    return {k: st.shards[k]._replace(state=TODO, owner=-1, incarnation=-1, deadline=0.0)
            for k in st.index.expired(st.shards, now)}


def _todo_head(st: JobState, changed: dict[tuple[int, int], Shard], n: int) -> list[Shard]:
    """The first ``n`` TODO shards of the view (``st`` overlaid with ``changed``) in lease order."""
    head = [v for v in changed.values() if v.state == TODO]
    taken = 0
    for k in st.index.todo_keys():
        if taken >= n:
            break
        if k not in changed:
            head.append(st.shards[k])
            taken += 1
    return sorted(head, key=lambda s: (s.epoch, s.order))[:n]


def _doing_counts(st: JobState, changed: dict[tuple[int, int], Shard], rank: int) -> tuple[int, int]:
    """(DOING shards of the view, of which ``rank``'s)."""
    total = st.index.doing
    for k, v in changed.items():
        old = st.shards.get(k)
        total += (v.state == DOING) - (old is not None and old.state == DOING)
    mine = set(st.index.owned.get(rank, ())) | {k for k, v in changed.items() if v.owner == rank}
    return total, sum(1 for k in mine if (v := _view(st, changed, k)) is not None and v.state == DOING
                      and v.owner == rank)


def _view(st: JobState, changed: dict[tuple[int, int], Shard], key: tuple[int, int]) -> Shard | None:
    return changed.get(key, st.shards.get(key))


def _shard_reply(s: Shard) -> dict:
    return {"epoch": s.epoch, "shard_id": s.shard_id, "start": s.start, "end": s.end, "offset": s.acked,
            "token": s.token}


def _check_lease(st: JobState, changed: dict, item: dict, rank: int, inc: int) -> Shard:
    key = (_int(item, "epoch", 0), _int(item, "shard_id", 0))
    token = _int(item, "token", 0)
    s = _view(st, changed, key)
    if s is None:
        raise FencedError(f"shard {key} does not exist (any more): the state was restored to a checkpoint.")
    if s.token != token or s.owner != rank or s.incarnation != inc:
        raise FencedError(f"shard {key} token {token} is not held by rank {rank}/incarnation {inc} (current "
                          f"token {s.token}, owner {s.owner}): the lease expired or was revoked.")
    return s


# ---------------------------------------------------------------------------------------------------- decide
def decide(st: JobState, req: dict, now: float) -> Decision:
    """Validate ``req`` (``{"op": ..., ...}``) against ``st`` and return what to write and reply. Pure."""
    if not isinstance(req, dict):
        raise BadRequestError("the request body must be a JSON object.")
    op = req.get("op")
    if op not in OPS:
        raise BadRequestError(f"unknown op {op!r}; valid ops are {list(OPS)}.")
    if op == "ack" and req.get("lease") is not None:
        return _ack_then_lease(st, req, now)
    return _HANDLERS[op](st, req, now)


def _ack_then_lease(st: JobState, req: dict, now: float) -> Decision:
    """``ack`` with a piggybacked ``lease`` (``req["lease"] = {request_id, min_samples, max_shards}``): one round trip
    and one commit per step for a rank that also refills its prefetch buffer. The lease is decided on the state the
    ack leaves; a refused ack refuses the whole request (nothing changes). The lease part keeps its own request id,
    so a retried request replays the same leases (and the ack part is idempotent by its absolute offsets)."""
    sub = req["lease"]
    if not isinstance(sub, dict):
        raise BadRequestError("field 'lease' must be an object {request_id, min_samples, max_shards}.")
    first = _ack(st, {k: v for k, v in req.items() if k != "lease"}, now)
    # The lease reads the table as the ack leaves it: the ack's rows overlay the state (the ack changes nothing
    # else the lease reads: not the epoch, the lease sequence or the reply cache).
    second = _lease(st, {**sub, "op": "lease", "rank": req.get("rank"), "incarnation": req.get("incarnation")},
                    now, base={s.key: s for s in first.shards})
    merged = {s.key: s for s in first.shards}
    merged.update({s.key: s for s in second.shards})
    d = Decision(reply={**first.reply, "lease": second.reply}, shards=list(merged.values()),
                 replace_shards=second.replace_shards, meta={**first.meta, **second.meta},
                 reply_cache=second.reply_cache, cached_reply=second.reply if second.reply_cache else None,
                 monitor=first.monitor)
    if d.replace_shards:
        # The lease opened a new epoch: its shard list is the whole table, built on top of the ack's changes.
        d.shards = list(second.shards)
    return d


def _register(st: JobState, req: dict, now: float) -> Decision:
    rank = _int(req, "rank", 0, 1 << 20)
    inc = _int(req, "incarnation", 0, 1 << 30)
    pid = _int(req, "pid", 0, 1 << 31, default=0)
    cap = req.get("max_micro_batch")
    if cap is not None:
        cap = _int(req, "max_micro_batch", 1, 1 << 24)
    node = _node(req.get("node"), "node", required=False)
    _check_rank(st, rank)
    if node is not None:
        _refuse_blacklisted(st, [node])
        nodes = st.control.get("nodes") or []
        if len(nodes) == active_world(st) and nodes[rank] != node:
            raise BadRequestError(f"rank {rank} runs on node {nodes[rank]!r} in this round (generation "
                                  f"{generation(st)}), not on {node!r}.")
    _check_generation(st, rank, inc)
    old = st.workers.get(rank)
    if old is not None and inc < old.incarnation:
        raise StaleIncarnationError(f"rank {rank} incarnation {inc} is older than the registered incarnation "
                                    f"{old.incarnation}.")
    d = Decision(reply={})
    # A newer incarnation fences every lease of the older one: its unconsumed tails go back to TODO.
    if old is not None and inc > old.incarnation:
        d.shards = [st.shards[k]._replace(state=TODO, owner=-1, incarnation=-1, deadline=0.0)
                    for k in sorted(st.index.owned.get(rank, ()))]
    w = Worker(rank, inc, pid, cap)
    if w != old:
        d.workers = [w]
    plan = dict(st.control["plan"])
    if cap != (plan["micro_batch"][rank] if plan["micro_batch"] else None):
        micro = list(plan["micro_batch"])
        micro[rank] = cap
        plan["micro_batch"] = micro
        control = copy.deepcopy(st.control)
        control["plan"] = plan
        d.meta["control"] = control
    d.reply = {"job": st.job.to_dict(), "plan": plan, "epoch": st.epoch}
    return d


def _lease(st: JobState, req: dict, now: float, base: dict[tuple[int, int], Shard] | None = None) -> Decision:
    """``base``: rows of a decision not applied yet (an ack in the same request) that the lease must see."""
    rank, inc = _worker(st, req)
    req_id = req.get("request_id")
    if not isinstance(req_id, str) or not 0 < len(req_id) <= 64:
        raise BadRequestError("field 'request_id' must be a string of 1..64 characters (it makes retries safe).")
    min_samples = _int(req, "min_samples", 1, 1 << 30, default=1)
    max_shards = _int(req, "max_shards", 1, 64, default=1)
    cached = st.replies.get((rank, req_id))
    if cached is not None:
        return Decision(reply=json.loads(cached))
    changed = _expired(st, now)
    if base:
        changed.update(base)
    epoch = st.epoch
    d = Decision(reply={})
    todo = _todo_head(st, changed, max_shards)
    if not todo and epoch + 1 < st.job.num_epochs:
        # No epoch barrier: the next epoch opens as soon as the current one has nothing left to lease (shards still
        # in flight finish in parallel), so ranks never idle at a boundary. Fully DONE epochs are dropped from the
        # table; snapshots keep what a restore needs.
        epoch += 1
        keep = {k: _view(st, changed, k) for k in st.shards}
        live = {e for e in {k[0] for k in keep} if any(v.state != DONE for v in keep.values() if v.epoch == e)}
        fresh = make_epoch_shards(st.job, epoch)
        changed = {k: v for k, v in keep.items() if v.epoch in live} | {s.key: s for s in fresh}
        d.replace_shards = True
        d.meta["epoch"] = epoch
        todo = sorted(fresh, key=lambda s: s.order)
    if todo:
        # One request may lease several shards (up to `max_shards`, until `min_samples` unconsumed samples are
        # held): a rank refilling its prefetch buffer pays one round trip and one fsync instead of one per shard.
        seq = st.lease_seq
        got: list[Shard] = []
        samples = 0
        for t in todo[:max_shards]:
            head = _view(st, changed, t.key)
            seq += 1
            leased = head._replace(state=DOING, owner=rank, incarnation=inc, token=seq,
                                   deadline=now + st.job.lease_ttl_s)
            changed[leased.key] = leased
            got.append(leased)
            samples += leased.size - leased.acked
            if samples >= min_samples:
                break
        d.meta["lease_seq"] = seq
        d.reply = {"status": "shard", "shard": _shard_reply(got[0]), "shards": [_shard_reply(g) for g in got]}
    else:
        # Drained: nothing left to lease in the last epoch. Only a lease that expires or is released can bring
        # work back; `others` says whether anybody but the caller still holds leases.
        doing, mine = _doing_counts(st, changed, rank)
        d.reply = {"status": "wait", "others": doing - mine} if doing else {"status": "end"}
    d.shards = list(changed.values())
    d.reply_cache = (rank, req_id)
    return d


def _ack(st: JobState, req: dict, now: float) -> Decision:
    rank, inc = _worker(st, req)
    items = _items(req)
    changed = _expired(st, now)
    updates: dict[tuple[int, int], Shard] = {}
    for item in items:
        key = (_int(item, "epoch", 0), _int(item, "shard_id", 0))
        s = updates.get(key) or _view(st, changed, key)
        offset = _int(item, "offset", 0)
        token = _int(item, "token", 0)
        # Idempotent replay: the shard finished under this very token by this rank; nothing left to do.
        if s is not None and s.state == DONE and s.token == token and s.owner == rank and offset == s.size:
            continue
        s = _check_lease(st, {**changed, **updates}, item, rank, inc)
        if s.state != DOING:
            raise FencedError(f"shard {key} is {s.state}, not leased: the lease expired before this ack.")
        if not s.acked <= offset <= s.size:
            raise BadRequestError(f"ack offset {offset} of shard {key} must lie in [acked={s.acked}, size={s.size}].")
        done = offset == s.size
        updates[key] = s._replace(acked=offset, state=DONE if done else DOING,
                                  deadline=s.deadline if done else now + st.job.lease_ttl_s)
    # Heartbeat piggyback: an accepted ack proves the worker alive, so it renews every other lease this
    # (rank, incarnation) holds. Only live DOING leases of the caller are touched (expired ones went back to TODO
    # above), so fencing is unchanged: a stalled or stale worker sends no accepted ack and its leases still expire.
    for k in sorted(st.index.owned.get(rank, ())):
        cur = updates.get(k) or _view(st, changed, k)
        if cur.state == DOING and cur.owner == rank and cur.incarnation == inc and k not in updates:
            updates[k] = cur._replace(deadline=now + st.job.lease_ttl_s)
    d = Decision(reply={}, shards=list({**changed, **updates}.values()))
    reports = _metrics_list(req.get("metrics"))
    control = st.control
    if reports:
        control = _control_for_monitor(st.control, rank)
        key = str(rank)
        remaining = None
        for step, samples, compute_s in reports:
            # Several steps in one ack (the Agent coalesces): each closed window is a Controller round, exactly
            # as if the steps had arrived one request each.
            if (monitor_observe(control["monitor"], st.monitor_cfg, rank, step, samples, compute_s)
                    and _round_due(st.control["monitor"]["closed"], key, control["monitor"]["closed"][key],
                                   control["rounds"], active_world(st))):
                if remaining is None:
                    remaining = _remaining_samples(st, updates)
                control = controller_step(control, st.monitor_cfg, st.controller_cfg, remaining)
        d.monitor = {key: {name: view[key] for name, view in control["monitor"].items() if key in view}}
        d.meta["control"] = {**control, "monitor": st.control["monitor"]}
    d.reply = {"ok": True, "plan": control["plan"]}
    return d


MAX_METRICS_PER_ACK = 4096
"""Most step reports one ack may carry (an Agent coalescing acks sends one per step since its last ack)."""


def _metrics_list(metrics) -> list[tuple[int, int, float]]:
    """Validate an ack's ``metrics``: one ``{step, samples, compute_s}`` object or a list of them, oldest first."""
    if metrics is None:
        return []
    many = isinstance(metrics, list)
    if not many and not isinstance(metrics, dict):
        raise BadRequestError("field 'metrics' must be an object {step, samples, compute_s} or a list of them.")
    entries = metrics if many else [metrics]
    if len(entries) > MAX_METRICS_PER_ACK:
        raise BadRequestError(f"field 'metrics' has {len(entries)} entries; at most {MAX_METRICS_PER_ACK} per ack.")
    out = []
    for m in entries:
        if not isinstance(m, dict):
            raise BadRequestError("every entry of 'metrics' must be an object {step, samples, compute_s}.")
        out.append((_int(m, "step", 0), _int(m, "samples", 0, 1 << 24), _num(m, "compute_s")))
    return out


def _control_for_monitor(control: dict, rank: int) -> dict:
    """A view of ``control`` in which `monitor_observe` may update ``rank`` without touching the state: each Monitor
    map reads through an overlay that takes the writes, and this rank's mutable entries are copied into it first.
    Copying the Monitor (let alone deep-copying the control state, windows and history included) would cost the world
    size on every ack."""
    key = str(rank)
    overlay: dict[str, dict] = {name: ({key: list(m[key])} if isinstance(m.get(key), list) else {})
                                for name, m in control["monitor"].items()}
    mon = {name: ChainMap(overlay[name], m) for name, m in control["monitor"].items()}
    return {**control, "monitor": mon}


def _round_due(closed: dict[str, int], key: str, mine: int, rounds: int, world: int) -> bool:
    """Whether every rank has closed a window since Controller round ``rounds`` (then `controller_step` runs a
    round), given the state's closed-window counts and ``mine``, the caller's count after this ack. The same test
    as `controller_step`'s, on the state's plain map at C speed: a window closes every few steps of every rank, and
    going through the overlay view rank by rank each time would cost the world size in Python."""
    if mine <= rounds or len(closed) + (key not in closed) < world:
        return False
    if min(closed.values()) > rounds:
        return True
    # The minimum may be the caller's own count before this ack: then every other rank must be past `rounds`.
    return closed.get(key, 0) <= rounds and sum(1 for v in closed.values() if v <= rounds) == 1


def _remaining_samples(st: JobState, updates: dict) -> int:
    cur = st.index.size - st.index.acked - sum(u.acked - st.shards[k].acked for k, u in updates.items())
    return cur + (st.job.num_epochs - 1 - st.epoch) * st.job.dataset_size


def _renew(st: JobState, req: dict, now: float) -> Decision:
    rank, inc = _worker(st, req)
    changed = _expired(st, now)
    renewed, fenced = [], []
    for item in _items(req):
        try:
            s = _check_lease(st, changed, item, rank, inc)
        except FencedError:
            fenced.append([item.get("epoch"), item.get("shard_id"), item.get("token")])
            continue
        if s.state == DOING:
            changed[s.key] = s._replace(deadline=now + st.job.lease_ttl_s)
        renewed.append([s.epoch, s.shard_id, s.token])
    return Decision(reply={"renewed": renewed, "fenced": fenced}, shards=list(changed.values()))


def _release(st: JobState, req: dict, now: float) -> Decision:
    """Give leases back (a worker shutting down with prefetched shards): their tails return to TODO."""
    rank, inc = _worker(st, req)
    changed = _expired(st, now)
    for item in _items(req):
        try:
            s = _check_lease(st, changed, item, rank, inc)
        except FencedError:
            continue
        if s.state == DOING:
            changed[s.key] = s._replace(state=TODO, owner=-1, incarnation=-1, deadline=0.0)
    return Decision(reply={"ok": True}, shards=list(changed.values()))


def _commit(st: JobState, req: dict, now: float) -> Decision:
    """Snapshot the acked progress under ``checkpoint_id`` (the checkpoint's global step)."""
    _worker(st, req)
    cid = _int(req, "checkpoint_id", 1, 1 << 40)
    keep = sorted(k for k in st.snapshots if k not in (0, cid))
    drop = keep[: max(0, len(keep) + 1 - st.job.keep_snapshots)]
    d = Decision(reply={"ok": True, "checkpoint_id": cid}, snapshot_put=(cid, _snapshot(st)), snapshot_drop=drop)
    if req.get("leaving") is True:
        # the ranks leave after this checkpoint: the next re-form measures what the re-formation cost
        d.meta["control"] = {**st.control, "left_at": now}
    return d


def _snapshot_of(st: JobState, cid: int) -> dict:
    """The committed snapshot of checkpoint ``cid``, or a NotFoundError that says which ones exist."""
    snap = st.snapshots.get(cid)
    if snap is None:
        raise NotFoundError(f"no snapshot for checkpoint {cid}; available: {sorted(st.snapshots)}. The checkpoint "
                            "was written without its snapshot being committed; resume from an earlier checkpoint.")
    return snap


def _restore(st: JobState, req: dict, now: float) -> Decision:
    """Roll progress back to snapshot ``checkpoint_id``: every lease is revoked, acked offsets are the snapshot's."""
    _worker(st, req)
    cid = _int(req, "checkpoint_id", 0, 1 << 40)
    snap = _snapshot_of(st, cid)
    shards = [Shard(e, i, a, b, o, state, -1, -1, 0, 0.0, acked) for e, i, a, b, o, state, acked in snap["shards"]]
    control = copy.deepcopy(st.control)
    plan = dict(snap["plan"])
    # The restart budget and the measurements are not rolled back: a restart must not be re-issued forever.
    plan["version"] = control["plan"]["version"] + 1
    plan["actions"] = {}
    plan["micro_batch"] = control["plan"]["micro_batch"]
    if len(plan["batch_sizes"]) != active_world(st):  # a snapshot of a round with another world: keep this one's
        plan["batch_sizes"] = list(control["plan"]["batch_sizes"])
    control["plan"] = plan
    control["streak"] = [0] * active_world(st)
    control["classes"] = ["normal"] * active_world(st)
    return Decision(reply={"ok": True, "checkpoint_id": cid, "epoch": snap["epoch"], "plan": plan},
                    shards=shards, replace_shards=True, meta={"epoch": snap["epoch"], "control": control})


def _node(v: Any, name: str, required: bool = True) -> str | None:
    if v is None and not required:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= 128:
        raise BadRequestError(f"field {name!r} must be a node name of 1..128 characters, got {v!r}.")
    return v


def _refuse_blacklisted(st: JobState, nodes: list[str]) -> None:
    black = st.control.get("blacklist", {})
    bad = sorted(set(nodes) & set(black))
    if bad:
        why = "; ".join(f"{n}: {black[n].get('reason', 'evicted')}" for n in bad)
        raise RefusedError(f"node(s) {bad} are blacklisted and may not rejoin this job ({why}). Re-form the job "
                           "without them (their agents must leave the rendezvous).")


def _reform(st: JobState, req: dict, now: float) -> Decision:
    """Rank 0 of a new rendezvous round: the round's members (node of every rank), the checkpoint it resumes from.
    The job's generation goes up by one (every earlier process is fenced off), progress rolls back to that
    checkpoint's snapshot (every lease of the earlier round, an evicted worker's included, is revoked: its
    unconsumed tail is leased again), and the plan starts over as an equal split of the new world. A blacklisted
    member is refused, and nothing changes."""
    if _int(req, "rank", 0, 1 << 20) != 0:
        raise BadRequestError("only rank 0 of a round may re-form the job.")
    world = _int(req, "world_size", 1, st.job.world_size)
    nodes = req.get("nodes")
    if not isinstance(nodes, list) or len(nodes) != world:
        raise BadRequestError(f"field 'nodes' must list the node of each of the {world} ranks.")
    nodes = [_node(n, "nodes[]") for n in nodes]
    _refuse_blacklisted(st, nodes)
    cid = _int(req, "checkpoint_id", 0, 1 << 40)
    snap = _snapshot_of(st, cid)
    old = st.control
    gen = max([generation(st)] + [w.incarnation for w in st.workers.values()]) + 1
    control = initial_control_state(world, equal_split(st.job.global_batch_size, world))
    rounds = int(old["rounds"])
    # Rounds stay monotonic (the history is keyed by them): every rank starts as having closed `rounds` windows.
    control["monitor"]["closed"] = {str(r): rounds for r in range(world)}
    reforms = [float(x) for x in old.get("reform_s", [])]
    if old.get("left_at") is not None and now >= float(old["left_at"]):
        reforms = (reforms + [round(now - float(old["left_at"]), 3)])[-_REFORMS_KEPT:]
    control.update(rounds=rounds, restarts=old["restarts"], history=old["history"], nodes=nodes,
                   blacklist=dict(old.get("blacklist", {})), evictions=int(old.get("evictions", 0)), generation=gen,
                   reform_s=reforms)
    control["plan"]["version"] = int(old["plan"]["version"]) + 1
    shards = [Shard(e, i, a, b, o, state, -1, -1, 0, 0.0, acked) for e, i, a, b, o, state, acked in snap["shards"]]
    d = Decision(reply={"generation": gen, "plan": control["plan"], "epoch": snap["epoch"], "checkpoint_id": cid,
                        "nodes": nodes, "job": st.job.to_dict()},
                 shards=shards, replace_shards=True, meta={"epoch": snap["epoch"], "control": control})
    d.monitor = {str(r): {"closed": rounds} for r in range(world)}
    d.reset_monitor = True
    return d


def _evict(st: JobState, req: dict, now: float) -> Decision:
    """An operator's eviction of ``node`` (the Controller decides its own the same way): refused with the reason when
    the rules forbid it (fewer than ``min_nodes`` left, not a member, one pending)."""
    node = _node(req.get("node"), "node")
    reason = req.get("reason", "evicted by request")
    if not isinstance(reason, str) or len(reason) > 1000:
        raise BadRequestError("field 'reason' must be a string of at most 1000 characters.")
    refusal = eviction_refusal(st.control, st.controller_cfg, node)
    if refusal is not None:
        raise RefusedError(f"eviction refused: {refusal}")
    control = evict_node(st.control, node, reason)
    return Decision(reply={"ok": True, "plan": control["plan"], "blacklist": control["blacklist"]},
                    meta={"control": control})


def _plan(st: JobState, req: dict, now: float) -> Decision:
    return Decision(reply={"plan": st.control["plan"]})


def _status(st: JobState, req: dict, now: float) -> Decision:
    counts = {TODO: 0, DOING: 0, DONE: 0}
    consumed = 0
    for s in st.shards.values():
        counts[s.state] += 1
        consumed += s.acked
    return Decision(reply={"epoch": st.epoch, "counts": counts, "acked_samples": consumed,
                           "workers": {str(w.rank): w.incarnation for w in st.workers.values()},
                           "plan": st.control["plan"], "classes": st.control["classes"],
                           "snapshots": sorted(st.snapshots), "restarts": st.control["restarts"],
                           "generation": generation(st), "nodes": st.control.get("nodes", []),
                           "blacklist": st.control.get("blacklist", {}),
                           "evictions": st.control.get("evictions", 0),
                           "reform_s": st.control.get("reform_s", []), "job": st.job.to_dict()})


def _metrics(st: JobState, req: dict, now: float) -> Decision:
    # Copies: `apply` updates the Monitor's maps in place, and the reply is encoded after the service lock is left.
    windows = {k: list(v) for k, v in st.control["monitor"]["windows"].items()}
    return Decision(reply={"windows": windows, "history": list(st.control["history"])})


_HANDLERS = {"register": _register, "lease": _lease, "ack": _ack, "renew": _renew, "release": _release,
             "commit": _commit, "restore": _restore, "reform": _reform, "evict": _evict, "plan": _plan,
             "status": _status, "metrics": _metrics}


def apply(st: JobState, d: Decision) -> None:
    """Fold a committed decision into the in-memory state."""
    if d.replace_shards:
        st.shards = {s.key: s for s in d.shards}
        st.reindex()
    else:
        for s in d.shards:
            st.index.update(st.shards.get(s.key), s)
            st.shards[s.key] = s
        st.index.prune(st.shards)
    for w in d.workers:
        st.workers[w.rank] = w
    if "epoch" in d.meta:
        st.epoch = int(d.meta["epoch"])
    if "lease_seq" in d.meta:
        st.lease_seq = int(d.meta["lease_seq"])
    if "control" in d.meta:
        st.control = d.meta["control"]
    if d.reset_monitor:
        st.control["monitor"] = {name: {} for name in st.control["monitor"]}
    for key, entries in d.monitor.items():
        for name, value in entries.items():
            st.control["monitor"].setdefault(name, {})[key] = value
    if d.snapshot_put is not None:
        st.snapshots[d.snapshot_put[0]] = d.snapshot_put[1]
    for k in d.snapshot_drop:
        st.snapshots.pop(k, None)
    if d.reply_cache is not None:
        st.replies[d.reply_cache] = d.cache_text
        while len(st.replies) > _REPLY_CACHE * st.job.world_size:
            st.replies.pop(next(iter(st.replies)))


def plan_of(st: JobState) -> Plan:
    return Plan.from_dict(st.control["plan"])
