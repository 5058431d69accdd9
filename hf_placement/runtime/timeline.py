"""Per-rank timeline of phases -> Chrome trace JSON, a PNG Gantt chart and a summary with idle time per rank.

Each rank records ``(phase, start, end, bytes)`` events with wall-clock seconds (``time.time()``, comparable across
processes of one machine; across nodes, clock skew of the hosts shows up as shifts). Phases named ``wait:<what>``
mark time blocked on a peer. Idle time is the story of placement: a disaggregated schedule
trades idle gaps on one group for overlap, so the summary reports, per rank, busy time (union of its non-wait
intervals), idle time within the iteration span, explicit waits, and time per phase. `gather_timelines` collects
every rank's events (an object all-gather on a group with a timeout).

The Chrome trace (``chrome://tracing`` / Perfetto) uses complete events (``"ph": "X"``), microsecond timestamps,
one process row per rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PhaseEvent", "Timeline", "gather_timelines", "plot_timeline", "summarize_timelines", "to_chrome_trace",
           "write_chrome_trace"]


@dataclass(frozen=True)
class PhaseEvent:
    """One phase on one rank: wall-clock ``start``/``end`` in seconds and the bytes it moved."""

    rank: int
    phase: str
    start: float
    end: float
    bytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Events of one rank. Record with `phase` (a context manager) or `record`.

    Example:

    ```python
    tl = Timeline(rank)
    with tl.phase("generate"):
        ...
    with tl.phase("sync", bytes=nbytes):
        ...
    ```
    """

    rank: int
    events: list[PhaseEvent] = field(default_factory=list)

    def record(self, phase: str, start: float, end: float, bytes: int = 0) -> PhaseEvent:  # noqa: A002
        if end < start:
            raise ValueError(f"phase '{phase}' ends ({end}) before it starts ({start}).")
        ev = PhaseEvent(self.rank, str(phase), float(start), float(end), int(bytes))
        self.events.append(ev)
        return ev

    @contextmanager
    def phase(self, name: str, bytes: int = 0) -> Iterator[dict[str, int]]:  # noqa: A002
        """Time the block as phase ``name``; set ``info["bytes"]`` inside the block to record bytes known later."""
        info = {"bytes": int(bytes)}
        start = time.time()
        try:
            yield info
        finally:
            self.record(name, start, time.time(), info["bytes"])

    def to_list(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.events]

    @classmethod
    def from_list(cls, rank: int, events: Sequence[dict[str, Any]]) -> Timeline:
        return cls(rank, [PhaseEvent(**e) for e in events])


def gather_timelines(timeline: Timeline, group: Any = None) -> list[Timeline]:
    """All ranks' timelines, on every rank of ``group`` (default: the world), via one object all-gather."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [timeline]
    n = dist.get_world_size(group)
    out: list[Any] = [None] * n
    dist.all_gather_object(out, (timeline.rank, timeline.to_list()), group=group)
    return [Timeline.from_list(r, evs) for r, evs in sorted(out, key=lambda x: x[0])]


def _all_events(timelines: Sequence[Timeline]) -> list[PhaseEvent]:
    return [e for tl in timelines for e in tl.events]


def to_chrome_trace(timelines: Sequence[Timeline]) -> dict[str, Any]:
    """Chrome trace-event JSON object (merged over ranks, time zero at the earliest event)."""
    events = _all_events(timelines)
    t0 = min((e.start for e in events), default=0.0)
    trace: list[dict[str, Any]] = []
    for tl in timelines:
        trace.append({"name": "process_name", "ph": "M", "pid": tl.rank, "tid": 0, "args": {"name": f"rank {tl.rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": tl.rank, "tid": 0,
                      "args": {"sort_index": tl.rank}})
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        trace.append({"name": e.phase, "cat": e.phase.split(":")[0], "ph": "X", "pid": e.rank, "tid": 0,
                      "ts": round((e.start - t0) * 1e6, 3), "dur": round(e.duration * 1e6, 3),
                      "args": {"bytes": e.bytes}})
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"producer": "hf_placement.runtime.timeline"}}


def write_chrome_trace(path: str | Path, timelines: Sequence[Timeline]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(timelines)))
    return path


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def is_wait(phase: str) -> bool:
    """Whether a phase name marks time blocked on a peer (``wait`` or ``wait:<what>``)."""
    return phase == "wait" or phase.startswith("wait:")


def summarize_timelines(timelines: Sequence[Timeline]) -> dict[str, Any]:
    """Time per phase (summed over ranks and per rank), busy and idle time per rank, bytes per phase.

    Busy time of a rank = union of its intervals, except phases named ``wait`` or ``wait:<what>`` (blocked on a
    peer: a shadow waiting for the trainer's weights, a data rank waiting for its owner's results). Idle time = span
    of the whole job's events (earliest start to latest end, over all ranks) minus busy time, so both explicit waits
    and gaps count as idle; ``wait_s`` reports the explicit waits alone.
    """
    events = _all_events(timelines)
    if not events:
        return {"span_s": 0.0, "phases": {}, "ranks": {}}
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    span = t1 - t0
    phases: dict[str, dict[str, float]] = {}
    for e in events:
        p = phases.setdefault(e.phase, {"seconds": 0.0, "bytes": 0, "count": 0})
        p["seconds"] += e.duration
        p["bytes"] += e.bytes
        p["count"] += 1
    ranks: dict[int, dict[str, Any]] = {}
    for tl in timelines:
        busy = _union_length([(e.start, e.end) for e in tl.events if not is_wait(e.phase)])
        wait = _union_length([(e.start, e.end) for e in tl.events if is_wait(e.phase)])
        per_phase: dict[str, float] = {}
        for e in tl.events:
            per_phase[e.phase] = per_phase.get(e.phase, 0.0) + e.duration
        ranks[tl.rank] = {"busy_s": busy, "idle_s": max(0.0, span - busy), "wait_s": wait,
                          "idle_fraction": (max(0.0, span - busy) / span) if span > 0 else 0.0,
                          "bytes": sum(e.bytes for e in tl.events), "phases": per_phase}
    return {"span_s": span, "phases": phases, "ranks": ranks}


def plot_timeline(timelines: Sequence[Timeline], path: str | Path, title: str = "hf_placement timeline") -> Path:
    """Draw one row per rank, one colour per phase (matplotlib Agg, no display needed); writes a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plot_timeline needs matplotlib: `pip install matplotlib` (the Chrome trace and the summary "
                          "work without it).") from exc

    events = _all_events(timelines)
    t0 = min((e.start for e in events), default=0.0)
    names = sorted({e.phase for e in events})
    fig = Figure(figsize=(10, 0.6 * max(2, len(timelines)) + 1.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}
    for row, tl in enumerate(timelines):
        for e in tl.events:
            ax.broken_barh([(e.start - t0, max(e.duration, 1e-6))], (row - 0.4, 0.8), facecolors=colors[e.phase],
                           edgecolors="black", linewidth=0.3)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([f"rank {tl.rank}" for tl in timelines])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since first event")
    ax.set_title(title)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors[n], label=n) for n in names], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small", frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
