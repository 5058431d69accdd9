"""Lookup structures over the shard table, so that a request costs what it touches, not the size of the table.

Without them every request scanned every shard of the table: for expired leases, for the lowest TODO shards in lease
order, for the caller's leases to renew, for the samples left. The table holds every shard of the open epochs (tens
of thousands for a large dataset), and with a thousand workers each sending a request per step the scans, not the
writes, bounded the service (bench/antdt/README.md).

`ShardIndex` is derived data: `build` makes it from a table, `update` follows every change of a shard, and nothing
outside `_state.apply` (and the store's load) may change the table without calling it. It is never persisted.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._state import Shard

__all__ = ["ShardIndex"]

_TODO, _DOING = "TODO", "DOING"
Key = tuple[int, int]


@dataclass
class ShardIndex:
    """- ``todo``: the TODO shards as ``(epoch, order, shard_id)``, sorted: lease order is its head;
    - ``owned``: rank -> keys of the DOING shards it owns (renewals piggybacked on acks, fencing on re-register);
    - ``deadlines``: a heap of ``(deadline, epoch, shard_id)`` with an entry for the current deadline of every DOING
      shard, plus stale entries (renewed or finished leases) dropped lazily when they reach the top;
    - ``doing``: number of DOING shards; ``size`` / ``acked``: samples in the table and acked of them."""

    todo: list[tuple[int, int, int]] = field(default_factory=list)
    owned: dict[int, set[Key]] = field(default_factory=dict)
    deadlines: list[tuple[float, int, int]] = field(default_factory=list)
    doing: int = 0
    size: int = 0
    acked: int = 0

    @classmethod
    def build(cls, shards: Iterable[Shard]) -> ShardIndex:
        idx = cls()
        for s in shards:
            idx._add(s)
        idx.todo.sort()
        heapq.heapify(idx.deadlines)
        return idx

    def _add(self, s: Shard) -> None:
        self.size += s.size
        self.acked += s.acked
        if s.state == _TODO:
            self.todo.append((s.epoch, s.order, s.shard_id))
        elif s.state == _DOING:
            self.doing += 1
            self.owned.setdefault(s.owner, set()).add(s.key)
            self.deadlines.append((s.deadline, s.epoch, s.shard_id))

    def update(self, old: Shard | None, new: Shard) -> None:
        """Follow the change of one shard from ``old`` (None: a new shard) to ``new``."""
        if old is not None:
            self.size -= old.size
            self.acked -= old.acked
            if old.state == _TODO and new.state != _TODO:
                entry = (old.epoch, old.order, old.shard_id)
                i = bisect.bisect_left(self.todo, entry)
                if i < len(self.todo) and self.todo[i] == entry:
                    del self.todo[i]
            if old.state == _DOING and (new.state != _DOING or new.owner != old.owner):
                self.doing -= 1
                mine = self.owned.get(old.owner)
                if mine is not None:
                    mine.discard(old.key)
                    if not mine:
                        del self.owned[old.owner]
        self.size += new.size
        self.acked += new.acked
        was_todo = old is not None and old.state == _TODO
        was_doing_here = old is not None and old.state == _DOING and old.owner == new.owner
        if new.state == _TODO and not was_todo:
            bisect.insort(self.todo, (new.epoch, new.order, new.shard_id))
        elif new.state == _DOING:
            if not was_doing_here:
                self.doing += 1
                self.owned.setdefault(new.owner, set()).add(new.key)
            if not was_doing_here or old.deadline != new.deadline:
                heapq.heappush(self.deadlines, (new.deadline, new.epoch, new.shard_id))

    def prune(self, shards: dict[Key, Shard]) -> None:
        """Drop stale deadline entries from the top of the heap (the entries below stay until they surface)."""
        h = self.deadlines
        while h:
            deadline, epoch, shard_id = h[0]
            s = shards.get((epoch, shard_id))
            if s is not None and s.state == _DOING and s.deadline == deadline:
                return
            heapq.heappop(h)

    def expired(self, shards: dict[Key, Shard], now: float) -> Iterator[Key]:
        """Keys of the DOING shards whose deadline is before ``now``, each once (a lease given up and taken again at
        the same instant has two entries with the same deadline): walks only the heap entries before ``now``."""
        h, stack, seen = self.deadlines, [0], set()
        while stack:
            i = stack.pop()
            if i < len(h) and h[i][0] < now:
                deadline, epoch, shard_id = h[i]
                s = shards.get((epoch, shard_id))
                if s is not None and s.state == _DOING and s.deadline == deadline and s.key not in seen:
                    seen.add(s.key)
                    yield s.key
                stack.append(2 * i + 1)
                stack.append(2 * i + 2)

    def todo_keys(self) -> Iterator[Key]:
        """TODO shards in lease order (epoch, then the shard's seeded order)."""
        for epoch, _, shard_id in self.todo:
            yield (epoch, shard_id)
