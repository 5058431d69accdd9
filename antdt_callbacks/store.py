"""SQLite persistence of the service state: WAL journal, ``synchronous=FULL``, one ``BEGIN IMMEDIATE ... COMMIT``
per request or per group of requests (`SQLiteStore.commit_many`), committed before any of their replies is sent. A
service killed at any instant restarts from the last committed transaction; a request whose reply was lost is
retried by the client and is idempotent (see `_state`).

The Monitor/Controller state is stored in parts (the small core in ``meta``, one ``monitor`` row per rank, one
``history`` row per Controller round) and only the parts a transaction changed are written: written whole, it grows
with the world size times the history length and would be serialised on every ack that carries metrics. Monitor rows
come with the decisions (`Decision.monitor`); the core and the history are compared by identity with what the tables
hold, because `decide` replaces them when it changes them and shares them otherwise.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from ._state import _REPLY_CACHE, Decision, JobState, Shard, Worker, new_job_state
from .config import ControllerConfig, JobConfig, MonitorConfig

__all__ = ["SQLiteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    epoch INTEGER NOT NULL, shard_id INTEGER NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    ord INTEGER NOT NULL, state TEXT NOT NULL, owner INTEGER NOT NULL, incarnation INTEGER NOT NULL,
    token INTEGER NOT NULL, deadline REAL NOT NULL, acked INTEGER NOT NULL, PRIMARY KEY (epoch, shard_id));
CREATE TABLE IF NOT EXISTS workers (rank INTEGER PRIMARY KEY, incarnation INTEGER NOT NULL, pid INTEGER NOT NULL,
    max_micro_batch INTEGER);
CREATE TABLE IF NOT EXISTS snapshots (id INTEGER PRIMARY KEY, payload TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS replies (rank INTEGER NOT NULL, request_id TEXT NOT NULL, seq INTEGER NOT NULL,
    reply TEXT NOT NULL, PRIMARY KEY (rank, request_id));
CREATE INDEX IF NOT EXISTS replies_seq ON replies (seq);
CREATE TABLE IF NOT EXISTS monitor (rank TEXT PRIMARY KEY, entry TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS history (round INTEGER PRIMARY KEY, entry TEXT NOT NULL);
"""
_SPLIT = ("monitor", "history")  # parts of the control state stored outside its ``meta`` row


class SQLiteStore:
    """Durable home of a `JobState`. Not thread-safe: the server serialises requests under one lock."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(_SCHEMA)
        self._reply_seq = 0
        self._reply_keep = 256  # replies kept: as many as the in-memory cache holds (set from the job on load)
        self._control: dict | None = None  # the control state the tables hold

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------------------------------- load / create
    def load_or_create(self, job: JobConfig, monitor_cfg: MonitorConfig, controller_cfg: ControllerConfig,
                       lease_grace_s: float, now: float) -> tuple[JobState, bool]:
        """Return the stored state (``created=False``) or create a new job (``True``).

        A stored job must match ``job``: serving a different dataset from the same file would corrupt both. Leases of
        a stored job get ``lease_grace_s`` more seconds, so workers that kept running while the service was down can
        renew and continue instead of being fenced."""
        self._reply_keep = max(256, _REPLY_CACHE * job.world_size)
        row = self.conn.execute("SELECT value FROM meta WHERE key='job'").fetchone()
        if row is None:
            st = new_job_state(job, monitor_cfg, controller_cfg)
            self._write_all(st)
            return st, True
        stored = JobConfig.from_dict(json.loads(row[0]))
        if stored != job:
            diff = {k: (v, getattr(job, k)) for k, v in stored.to_dict().items() if getattr(job, k) != v}
            raise ValueError(f"{self.path} holds a different job: {{field: (stored, requested)}} = {diff}. Use a "
                             "new --db file for a new job, or pass the stored job's parameters.")
        meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        st = JobState(stored, MonitorConfig.from_dict(json.loads(meta["monitor_cfg"])),
                      ControllerConfig.from_dict(json.loads(meta["controller_cfg"])))
        st.epoch = int(meta["epoch"])
        st.lease_seq = int(meta["lease_seq"])
        st.control = self._read_control(json.loads(meta["control"]))
        for r in self.conn.execute('SELECT epoch, shard_id, start, "end", ord, state, owner, incarnation, token, '
                                   "deadline, acked FROM shards"):
            s = Shard(*r)
            if s.state == "DOING":
                s = Shard(*r[:9], max(s.deadline, now + lease_grace_s), s.acked)
            st.shards[s.key] = s
        for r in self.conn.execute("SELECT rank, incarnation, pid, max_micro_batch FROM workers"):
            st.workers[r[0]] = Worker(*r)
        for cid, payload in self.conn.execute("SELECT id, payload FROM snapshots"):
            st.snapshots[int(cid)] = json.loads(payload)
        for rank, req_id, seq, reply in self.conn.execute("SELECT rank, request_id, seq, reply FROM replies "
                                                          "ORDER BY seq"):
            st.replies[(rank, req_id)] = reply
            self._reply_seq = max(self._reply_seq, seq)
        st.reindex()
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self._upsert_shards(st.shards.values())
            self._put_control(st.control)
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self._control = st.control
        return st, False

    def _read_control(self, core: dict) -> dict:
        if all(k in core for k in _SPLIT):
            return core  # written whole by an earlier version: the next write stores it in parts
        mon: dict[str, dict] = {"last_step": {}, "pending": {}, "windows": {}, "closed": {}, "shape": {}}
        for rank, entry in self.conn.execute("SELECT rank, entry FROM monitor"):
            for name, value in json.loads(entry).items():
                mon.setdefault(name, {})[rank] = value
        hist = [json.loads(e) for (e,) in self.conn.execute("SELECT entry FROM history ORDER BY round")]
        return {**core, "monitor": mon, "history": hist}

    def _put_control(self, control: dict, monitor: dict[str, dict] | None = None) -> None:
        """Write, inside the caller's transaction, the Monitor rows ``monitor`` (``{rank: entries}``) and the parts
        of ``control`` that differ from what the tables hold (``self._control``; every part when they hold none)."""
        last = self._control or {}
        c = self.conn
        core = {k: v for k, v in control.items() if k not in _SPLIT}
        if set(core) != {k for k in last if k not in _SPLIT} or any(v is not last.get(k) for k, v in core.items()):
            c.execute("INSERT OR REPLACE INTO meta VALUES ('control', ?)", (json.dumps(core),))
        if not last:
            c.execute("DELETE FROM monitor")
            ranks = {k for entries in control["monitor"].values() for k in entries}
            monitor = {k: {name: m[k] for name, m in control["monitor"].items() if k in m} for k in ranks}
        if monitor:
            c.executemany("INSERT OR REPLACE INTO monitor VALUES (?, ?)",
                          [(k, json.dumps(entries)) for k, entries in sorted(monitor.items())])
        hist = control["history"]
        if hist is not last.get("history"):
            if not last:
                c.execute("DELETE FROM history")
            top = c.execute("SELECT MAX(round) FROM history").fetchone()[0]
            c.executemany("INSERT OR REPLACE INTO history VALUES (?, ?)",
                          [(h["round"], json.dumps(h)) for h in hist if top is None or h["round"] > top])
            if hist:
                c.execute("DELETE FROM history WHERE round < ?", (hist[0]["round"],))

    def _write_all(self, st: JobState) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            meta = {"job": st.job.to_json(), "monitor_cfg": st.monitor_cfg.to_json(),
                    "controller_cfg": st.controller_cfg.to_json(), "epoch": str(st.epoch),
                    "lease_seq": str(st.lease_seq)}
            c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
            self._control = None
            self._put_control(st.control)
            c.execute("DELETE FROM shards")
            self._upsert_shards(st.shards.values())
            for cid, snap in st.snapshots.items():
                c.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (cid, json.dumps(snap)))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self._control = st.control

    def _upsert_shards(self, shards) -> None:
        self.conn.executemany(
            'INSERT OR REPLACE INTO shards (epoch, shard_id, start, "end", ord, state, owner, incarnation, token, '
            "deadline, acked) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [(s.epoch, s.shard_id, s.start, s.end, s.order, s.state, s.owner, s.incarnation, s.token, s.deadline,
              s.acked) for s in shards])

    # ------------------------------------------------------------------------------------------- commit
    def commit(self, d: Decision) -> None:
        """Persist one decision atomically and durably (returns after the fsync of the WAL)."""
        self.commit_many([d])

    def commit_many(self, decisions: list[Decision]) -> None:
        """Persist decisions, in the order they were decided, as one atomic and durable transaction.

        The tables end as if each decision had been committed alone, but each row is written once, with its last
        value: a shard or a rank touched by several requests of the group costs one write."""
        ds = [d for d in decisions if d.mutates]
        if not ds:
            return
        shards: dict[tuple[int, int], Shard] = {}
        replace = False
        workers: dict[int, Worker] = {}
        meta: dict[str, object] = {}
        control: dict | None = None
        monitor: dict[str, dict] = {}
        reset_monitor = False
        snapshots: dict[int, dict | None] = {}  # None: drop
        replies: list[tuple] = []
        seq = self._reply_seq
        for d in ds:
            if d.replace_shards:
                shards.clear()
                replace = True
            shards.update((s.key, s) for s in d.shards)
            workers.update((w.rank, w) for w in d.workers)
            for k, v in d.meta.items():
                if k == "control":
                    control = v
                else:
                    meta[k] = v
            if d.reset_monitor:
                monitor.clear()
                reset_monitor = True
            monitor.update(d.monitor)
            if d.snapshot_put is not None:
                snapshots[d.snapshot_put[0]] = d.snapshot_put[1]
            for k in d.snapshot_drop:
                snapshots[k] = None
            if d.reply_cache is not None:
                seq += 1
                replies.append((*d.reply_cache, seq, d.cache_text))
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            if replace:
                c.execute("DELETE FROM shards")
            self._upsert_shards(shards.values())
            c.executemany("INSERT OR REPLACE INTO workers VALUES (?,?,?,?)",
                          [(w.rank, w.incarnation, w.pid, w.max_micro_batch) for w in workers.values()])
            c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                          [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in meta.items()])
            if reset_monitor:
                c.execute("DELETE FROM monitor")
            if control is not None:
                self._put_control(control, monitor)
            c.executemany("INSERT OR REPLACE INTO snapshots VALUES (?, ?)",
                          [(k, json.dumps(v)) for k, v in snapshots.items() if v is not None])
            c.executemany("DELETE FROM snapshots WHERE id=?", [(k,) for k, v in snapshots.items() if v is None])
            if replies:
                c.executemany("INSERT OR REPLACE INTO replies VALUES (?,?,?,?)", replies)
                c.execute("DELETE FROM replies WHERE seq <= ?", (seq - self._reply_keep,))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        self._reply_seq = seq
        if control is not None:
            self._control = control
