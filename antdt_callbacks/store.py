"""SQLite persistence of the service state: WAL journal, ``synchronous=FULL``, one ``BEGIN IMMEDIATE ... COMMIT``
per mutating request, committed before the reply is sent. A service killed at any instant restarts from the last
committed request; a request whose reply was lost is retried by the client and is idempotent (see `_state`)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from ._state import Decision, JobState, Shard, Worker, new_job_state
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
"""


class SQLiteStore:
    """Durable home of a `JobState`. Not thread-safe: the server serialises requests under one lock."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(_SCHEMA)
        self._reply_seq = 0

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------------------------------- load / create
    def load_or_create(self, job: JobConfig, monitor_cfg: MonitorConfig, controller_cfg: ControllerConfig,
                       lease_grace_s: float, now: float) -> tuple[JobState, bool]:
        """Return the stored state (``created=False``) or create a new job (``True``).

        A stored job must match ``job``: serving a different dataset from the same file would corrupt both. Leases of
        a stored job get ``lease_grace_s`` more seconds, so workers that kept running while the service was down can
        renew and continue instead of being fenced."""
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
        st.control = json.loads(meta["control"])
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
            st.replies[(rank, req_id)] = json.loads(reply)
            self._reply_seq = max(self._reply_seq, seq)
        self._write_shards(st.shards.values())
        return st, False

    def _write_all(self, st: JobState) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            meta = {"job": st.job.to_json(), "monitor_cfg": st.monitor_cfg.to_json(),
                    "controller_cfg": st.controller_cfg.to_json(), "epoch": str(st.epoch),
                    "lease_seq": str(st.lease_seq), "control": json.dumps(st.control)}
            c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", meta.items())
            c.execute("DELETE FROM shards")
            self._upsert_shards(st.shards.values())
            for cid, snap in st.snapshots.items():
                c.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)", (cid, json.dumps(snap)))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def _write_shards(self, shards) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self._upsert_shards(shards)
        self.conn.execute("COMMIT")

    def _upsert_shards(self, shards) -> None:
        self.conn.executemany(
            'INSERT OR REPLACE INTO shards (epoch, shard_id, start, "end", ord, state, owner, incarnation, token, '
            "deadline, acked) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            [(s.epoch, s.shard_id, s.start, s.end, s.order, s.state, s.owner, s.incarnation, s.token, s.deadline,
              s.acked) for s in shards])

    # ------------------------------------------------------------------------------------------- commit
    def commit(self, d: Decision) -> None:
        """Persist one decision atomically and durably (returns after the fsync of the WAL)."""
        if not d.mutates:
            return
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            if d.replace_shards:
                c.execute("DELETE FROM shards")
            self._upsert_shards(d.shards)
            c.executemany("INSERT OR REPLACE INTO workers VALUES (?,?,?,?)",
                          [(w.rank, w.incarnation, w.pid, w.max_micro_batch) for w in d.workers])
            for k, v in d.meta.items():
                c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (k, v if isinstance(v, str) else json.dumps(v)))
            if d.snapshot_put is not None:
                c.execute("INSERT OR REPLACE INTO snapshots VALUES (?, ?)",
                          (d.snapshot_put[0], json.dumps(d.snapshot_put[1])))
            c.executemany("DELETE FROM snapshots WHERE id=?", [(k,) for k in d.snapshot_drop])
            if d.reply_cache is not None:
                self._reply_seq += 1
                c.execute("INSERT OR REPLACE INTO replies VALUES (?,?,?,?)",
                          (*d.reply_cache, self._reply_seq,
                           json.dumps(d.cached_reply if d.cached_reply is not None else d.reply)))
                c.execute("DELETE FROM replies WHERE seq <= ?", (self._reply_seq - 256,))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
