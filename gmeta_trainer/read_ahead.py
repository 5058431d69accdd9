"""Read-ahead: drive an iterator from a background thread a few items ahead of its consumer.

Meta-IO's readers (`TaskPrefetcher`, and the task DataLoader `MetaTrainer` builds) are ordinary iterators; this module
moves their work off the training thread without changing what they yield or in which order. Three rules make that
safe:

* the **first** item of a pass is read in the consumer's thread: whatever an iterator does once per pass (a sampler
  drawing its seed from the global RNG, an accelerate loader synchronising RNG states with a collective) happens where
  and when it would without read-ahead, so a run with read-ahead is bit-identical to one without;
* the thread holds no reference to the `ReadAhead` object, so dropping the iterator (a training loop that stops at
  ``max_steps`` mid-epoch) garbage-collects it and ``__del__`` stops the thread; live readers are also stopped at
  interpreter exit, so a process never hangs on one;
* an exception in the thread is handed to the consumer as a `ReadAheadError` naming the item it failed on, with the
  original exception as ``__cause__``; a thread that dies without reporting is an error too, never a silent hang.
"""

from __future__ import annotations

import atexit
import inspect
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["ReadAhead", "ReadAheadDataLoader", "ReadAheadError", "ReadAheadStats", "with_read_ahead"]

_ITEM, _END, _ERROR = "item", "end", "error"
_POLL_S = 0.05  # how often a blocked producer / consumer re-checks for shutdown
_JOIN_S = 10.0  # longest close() waits for a thread busy inside one read (it is a daemon past that)
_LIVE: weakref.WeakSet = weakref.WeakSet()


class ReadAheadError(RuntimeError):
    """The read-ahead thread raised; ``__cause__`` is the original exception."""


@dataclass
class ReadAheadStats:
    """Counters shared by the read-ahead iterators of one loader: items handed to the consumer and the seconds it
    spent waiting for them (its data-wait; the first item of a pass, read in the consumer's thread, counts whole)."""

    items: int = 0
    wait_seconds: float = 0.0


def _produce(source: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    # Runs in the thread. It must not reference the ReadAhead object (see the module docstring).
    def put(message) -> bool:
        while not stop.is_set():
            try:
                q.put(message, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in source:
            if not put((_ITEM, item)):
                return
        put((_END, None))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the consumer
        put((_ERROR, exc))


class ReadAhead(Iterator):
    """Iterate ``source`` with up to ``depth`` items read ahead by a daemon thread.

    Args:
        source (`Iterator`): what to read; only ever advanced by one thread at a time.
        depth (`int`): items buffered ahead of the consumer (>= 1).
        name (`str`): thread name, also used in error messages.
        timeout (`float`, *optional*): seconds to wait for one item before raising `TimeoutError`; ``None`` waits as
            long as the thread is alive (a slow reader is not an error, a dead one is).
        stats (`ReadAheadStats`, *optional*): counters to add this iterator's items and wait time to.
    """

    def __init__(self, source: Iterator, depth: int, name: str = "gmeta-read-ahead", timeout: float | None = None,
                 stats: ReadAheadStats | None = None):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1 (items read ahead).")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name, self._timeout = name, timeout
        self._index = 0  # items handed out so far
        self._done = False
        self.stats = stats if stats is not None else ReadAheadStats()

    def __iter__(self) -> ReadAhead:
        return self

    def __len__(self) -> int:
        return len(self._source)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._thread is None:
            t0 = time.perf_counter()
            try:
                item = next(self._source)  # the first item in the consumer's thread (see the module docstring)
            except StopIteration:
                self._done = True
                raise
            self.stats.wait_seconds += time.perf_counter() - t0
            self.stats.items += 1
            self._thread = threading.Thread(target=_produce, args=(self._source, self._queue, self._stop),
                                            name=self._name, daemon=True)
            _LIVE.add(self)
            self._thread.start()
            self._index = 1
            return item
        kind, payload = self._get()
        if kind == _END:
            self.close()
            raise StopIteration
        if kind == _ERROR:
            self.close()
            raise ReadAheadError(f"the {self._name} thread failed reading item {self._index} (0-based) of this pass: "
                                 f"{type(payload).__name__}: {payload}") from payload
        self._index += 1
        self.stats.items += 1
        return payload

    def _get(self) -> tuple[str, Any]:
        t0 = time.perf_counter()
        while True:
            try:
                message = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited = time.perf_counter() - t0
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise ReadAheadError(f"the {self._name} thread exited without reporting an item, an end or an "
                                         "error (was it killed?).") from None
                if self._timeout is not None and waited > self._timeout:
                    self.close()
                    raise TimeoutError(f"waited {self._timeout:.0f} s for item {self._index} from the {self._name} "
                                       "thread; the reader is stalled (slow storage?). Raise the timeout or check "
                                       "the data source.") from None
        self.stats.wait_seconds += time.perf_counter() - t0
        return message

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; idempotent. Also runs on garbage collection and at exit."""
        self._done = True
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=_JOIN_S)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        _LIVE.discard(self)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter teardown)
            pass


@atexit.register
def _close_live_readers() -> None:
    for reader in list(_LIVE):
        reader.close()


class ReadAheadDataLoader(DataLoader):
    """A `DataLoader` (``num_workers=0``) whose iterator is a `ReadAhead` over the normal single-process iterator:
    the same batches in the same order, with sampling, fetching and collation moved to a background thread.

    Extra args:
        read_ahead (`int`, defaults to 4): batches read ahead.
        stats (`ReadAheadStats`, *optional*): counters shared with the caller (data-wait).
    """

    def __init__(self, *args, read_ahead: int = 4, stats: ReadAheadStats | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.num_workers != 0:
            raise ValueError(f"ReadAheadDataLoader reads in one background thread; num_workers={self.num_workers} "
                             "would add worker processes that read ahead already. Use a plain DataLoader for that.")
        if read_ahead < 1:
            raise ValueError(f"read_ahead={read_ahead} must be >= 1.")
        self.read_ahead = read_ahead
        self.read_ahead_stats = stats if stats is not None else ReadAheadStats()

    def __iter__(self) -> ReadAhead:
        return ReadAhead(super().__iter__(), self.read_ahead, name="gmeta-meta-io-read-ahead",
                         stats=self.read_ahead_stats)


_REBUILT_BY_SAMPLER = {"self", "dataset", "batch_size", "shuffle", "sampler", "drop_last", "batch_sampler"}


def with_read_ahead(loader: DataLoader, read_ahead: int, dataset=None, collate_fn=None,
                    stats: ReadAheadStats | None = None) -> ReadAheadDataLoader:
    """A `ReadAheadDataLoader` that yields what ``loader`` yields: same batch sampler (so the same indices, sharding
    and epoch seeding), same settings, optionally another ``dataset``/``collate_fn`` pair that produces the same
    batches faster. ``loader`` must batch with a batch sampler and use ``num_workers=0``."""
    if loader.batch_sampler is None:
        raise ValueError("with_read_ahead needs a loader that batches with a batch sampler (batch_size=None loaders "
                         "yield single items).")
    settings = {name: getattr(loader, name) for name in inspect.signature(DataLoader.__init__).parameters
                if name not in _REBUILT_BY_SAMPLER and hasattr(loader, name)}
    if collate_fn is not None:
        settings["collate_fn"] = collate_fn
    return ReadAheadDataLoader(loader.dataset if dataset is None else dataset, batch_sampler=loader.batch_sampler,
                               read_ahead=read_ahead, stats=stats, **settings)
