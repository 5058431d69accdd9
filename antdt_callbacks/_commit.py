"""Group commit: the decisions of concurrent requests are written by one thread, many per transaction.

With one transaction per request, requests queue behind each other's fsync: the service's throughput is one request
per fsync whatever the number of cores or workers. Here a request is decided and applied to the in-memory state as
before, handed to the writer, and its reply waits until the transaction holding its decision is durable. While the
writer waits for one fsync, the requests that arrive are decided and gathered into the next transaction.

Durability is unchanged: no reply leaves before the rows it depends on are committed. A request decided after
another reads the state that includes the earlier decision; it is handed over later, so it commits in the same
transaction or a later one, and its reply waits for that. A read (or a replayed reply) waits for every decision
made before it. If a transaction fails, every request not yet durable gets an error and the service rebuilds its
in-memory state from the file, which drops exactly those decisions.

The requests are decided on one thread (the server's event loop), so the order of `submit` calls is the order of
the decisions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ._state import Decision
from .errors import ServiceError
from .store import SQLiteStore

__all__ = ["Batch", "GroupCommitter", "raise_if_failed"]

logger = logging.getLogger(__name__)

WAIT_LIMIT_S = 120.0
"""Longest a reply waits for its transaction before the request is answered with an error."""


class Batch:
    """Decisions committed in one transaction. ``done`` is set once it is durable or failed (``error``)."""

    __slots__ = ("_callbacks", "_lock", "decisions", "done", "error", "future")

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.future = None  # the server's awaitable for this batch (owned by its event loop)
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the batch is durable or failed (at once if it already is), on the writer's thread."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self.error = error
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - e.g. the server's loop closed at shutdown
                logger.debug("antdt service: batch callback failed: %r", e)


class GroupCommitter:
    """The writer thread. `submit` hands a decision over and returns the batch its reply waits for; `Batch.on_done`
    (or `wait`) tells when that batch is durable. Each batch notifies only its own waiters.

    A failed transaction fails its batch and the one being gathered, then refuses every request until the owner
    has rebuilt its in-memory state from the file and called `recovered` (``on_failure`` is called to ask for that,
    on the writer's thread): the decisions applied in memory since the last durable transaction are dropped with
    the rebuild, and nothing may be decided on top of them meanwhile."""

    def __init__(self, store: SQLiteStore, on_failure: Callable[[BaseException], None]):
        self.store = store
        self.on_failure = on_failure
        self.cond = threading.Condition()  # guards `pending` / `inflight`; only the writer waits on it
        self.pending = Batch()
        self.inflight: Batch | None = None
        self.recovering: BaseException | None = None
        self.transactions = 0
        self.committed = 0
        self.commit_s = 0.0
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="antdt-commit", daemon=True)
        self._thread.start()

    def submit(self, d: Decision) -> Batch | None:
        """Hand ``d`` over; returns the batch its reply waits for (None: nothing to wait for). A decision that
        changes nothing (a read, a replayed reply) still waits for the newest batch not yet durable, since it may
        have read what that batch writes. Call from one thread (the decisions' order is the commit order)."""
        with self.cond:
            if self.recovering is not None:
                raise ServiceError(f"writing the state file failed ({self.recovering!r}); the service is reloading "
                                   "its state. Retry the request.")
            if d.mutates:
                self.pending.decisions.append(d)
                self.cond.notify()
                return self.pending
            if self.pending.decisions:
                return self.pending
            if self.inflight is not None and not self.inflight.done.is_set():
                return self.inflight
            return None

    @staticmethod
    def wait(batch: Batch | None) -> None:
        """Block until ``batch`` is durable; raise if it failed or did not commit in `WAIT_LIMIT_S`."""
        if batch is None:
            return
        if not batch.done.wait(WAIT_LIMIT_S):
            raise ServiceError(f"the state writer did not commit this request within {WAIT_LIMIT_S:.0f} s; it was "
                               "not applied. Retry it.")
        raise_if_failed(batch)

    def recovered(self) -> None:
        with self.cond:
            self.recovering = None

    def stats(self) -> dict:
        return {"transactions": self.transactions, "committed": self.committed, "commit_s": self.commit_s,
                "requests_per_transaction": self.committed / max(self.transactions, 1)}

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join(timeout=WAIT_LIMIT_S)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending.decisions and not self._stop:
                    self.cond.wait()
                if not self.pending.decisions:
                    return
                batch, self.pending = self.pending, Batch()
                self.inflight = batch
            t0 = time.perf_counter()
            try:
                self.store.commit_many(batch.decisions)
            except Exception as e:  # noqa: BLE001 - every waiter gets the error; the owner rebuilds its state
                logger.error("antdt service: group commit of %d requests failed: %r", len(batch.decisions), e)
                with self.cond:
                    self.recovering = e
                    dropped, self.pending = self.pending, Batch()
                batch.finish(e)
                dropped.finish(e)
                self.on_failure(e)
                continue
            self.transactions += 1
            self.committed += len(batch.decisions)
            self.commit_s += time.perf_counter() - t0
            batch.finish()


def raise_if_failed(batch: Batch) -> None:
    if batch.error is not None:
        raise ServiceError(f"writing the state file failed ({batch.error!r}); this request was not applied. "
                           "Retry it.")
