"""Monitor and Controller: pure functions from per-rank compute measurements to a batch-size plan.

Why local *compute* time and not step time: under synchronous DDP every rank waits for the slowest one in the
all-reduce, so wall-clock step times are equal everywhere and a straggler is invisible in them. The Agent measures
each rank's time from the start of its forward to the moment its last gradient bucket is ready (the DDP comm hook
fires before the collective), and reports ``samples / compute_seconds`` per step.

Everything here is plain data in, plain data out (JSON-able dicts), so the service can persist it in SQLite and the
tests can drive it step by step. Thresholds and windows come from `MonitorConfig` / `ControllerConfig`; the paper's
own values are not published.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import dataclass

from .config import ControllerConfig, MonitorConfig

__all__ = [
    "Plan",
    "controller_step",
    "equal_split",
    "initial_control_state",
    "monitor_observe",
    "predicted_step_time",
    "proportional_split",
    "restart_saving_s",
]

_HISTORY = 256


@dataclass(frozen=True)
class Plan:
    """What the Controller tells every Agent: per-rank batch sizes (summing to the global batch), per-rank
    micro-batch caps (``None`` = no cap) and per-rank actions (``"restart"`` = checkpoint and exit for a restart)."""

    version: int
    batch_sizes: tuple[int, ...]
    micro_batch: tuple[int | None, ...]
    actions: dict[int, str]

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(int(d["version"]), tuple(int(b) for b in d["batch_sizes"]),
                   tuple(None if m is None else int(m) for m in d["micro_batch"]),
                   {int(k): str(v) for k, v in d.get("actions", {}).items()})

    def to_dict(self) -> dict:
        return {"version": self.version, "batch_sizes": list(self.batch_sizes), "micro_batch": list(self.micro_batch),
                "actions": {str(k): v for k, v in self.actions.items()}}


def equal_split(total: int, world: int) -> list[int]:
    base, rem = divmod(total, world)
    return [base + (1 if r < rem else 0) for r in range(world)]


def proportional_split(total: int, rates: list[float], min_batch: int = 1) -> list[int]:
    """``b_i ~ total * rate_i / sum(rate)``, at least ``min_batch`` each, summing exactly to ``total``
    (largest-remainder rounding, so the global batch and hence the learning-rate semantics never change)."""
    world = len(rates)
    if total < world * min_batch:
        raise ValueError(f"total={total} cannot give {world} ranks at least min_batch={min_batch} each.")
    if any(not (r > 0 and math.isfinite(r)) for r in rates):
        return equal_split(total, world)
    s = sum(rates)
    raw = [total * r / s for r in rates]
    b = [max(min_batch, int(math.floor(x))) for x in raw]
    # Each loop below takes, step by step, the rank a scan ``max(range(world), key=...)`` would take (the first one
    # among equal keys), from a heap keyed (key, rank): a split costs O(world log world), not world times the
    # residue, which the service pays every Controller round (bench/antdt/README.md).
    # Give the residue to the largest fractional parts; take any excess from the ranks furthest above their share.
    if sum(b) < total:
        heap = [(b[j] - raw[j], j) for j in range(world)]
        heapq.heapify(heap)
        for _ in range(total - sum(b)):
            _, i = heapq.heappop(heap)
            b[i] += 1
            heapq.heappush(heap, (b[i] - raw[i], i))
    elif sum(b) > total:
        heap = [(raw[j] - b[j], j) for j in range(world) if b[j] > min_batch]
        heapq.heapify(heap)
        for _ in range(sum(b) - total):
            _, i = heapq.heappop(heap)
            b[i] -= 1
            if b[i] > min_batch:
                heapq.heappush(heap, (raw[i] - b[i], i))
    # Rounding for the synchronous step, not for the shares: move single samples off the rank that finishes last
    # while that shortens the predicted step ``max_i b_i / rate_i`` (largest-remainder rounding can leave the slow
    # rank one sample too many, e.g. [19, 7, 19, 19] for rates [231, 80, 231, 231] where [20, 6, 19, 19] is faster).
    # Heap entries carry the batch size they were computed for; an entry whose rank has changed since is stale.
    slow = [(-(b[j] / rates[j]), j, b[j]) for j in range(world)]  # the rank that finishes last first
    take = [((b[j] + 1) / rates[j], j, b[j]) for j in range(world)]  # the rank one more sample costs least first
    heapq.heapify(slow)
    heapq.heapify(take)
    for _ in range(total):
        while slow[0][2] != b[slow[0][1]]:
            heapq.heappop(slow)
        i = slow[0][1]
        t_i = b[i] / rates[i]
        j, held = None, []
        while take:
            _, k, bk = take[0]
            if bk != b[k]:
                heapq.heappop(take)
            elif k == i:
                held.append(heapq.heappop(take))
            else:
                j = k
                break
        for e in held:
            heapq.heappush(take, e)
        if j is None or b[i] <= min_batch or (b[j] + 1) / rates[j] >= t_i:
            break
        b[i] -= 1
        b[j] += 1
        for r in (i, j):
            heapq.heappush(slow, (-(b[r] / rates[r]), r, b[r]))
            heapq.heappush(take, ((b[r] + 1) / rates[r], r, b[r]))
    return b


def predicted_step_time(batch_sizes: list[int], rates: list[float]) -> float:
    """Synchronous step time: the slowest rank's ``b_i / tau_i``."""
    return max(b / r for b, r in zip(batch_sizes, rates))


def restart_saving_s(batch_sizes: list[int], rates: list[float], rank: int, remaining_steps: float,
                     restart_cost_s: float, min_batch: int = 1) -> float:
    """ND cost rule: seconds saved by killing and restarting ``rank`` on a healthy slot (its throughput back at the
    median of the others) over the remaining steps, minus what the restart costs. Positive = worth it."""
    others = [r for i, r in enumerate(rates) if i != rank]
    healed = list(rates)
    healed[rank] = statistics.median(others) if others else rates[rank]
    total = sum(batch_sizes)
    t_now = predicted_step_time(batch_sizes, rates)
    t_after = predicted_step_time(proportional_split(total, healed, min_batch), healed)
    return remaining_steps * (t_now - t_after) - restart_cost_s


def monitor_observe(mon: dict, cfg: MonitorConfig, rank: int, step: int, samples: int, compute_s: float) -> bool:
    """Add one step of one rank to the Monitor state ``mon`` (mutated in place); return whether a window closed.

    A retried report (same or older step) is ignored, so acks can be replayed safely."""
    key = str(rank)
    if step <= mon["last_step"].get(key, -1) or compute_s <= 0 or samples <= 0:
        return False
    mon["last_step"][key] = step
    pend = mon["pending"].setdefault(key, [0, 0.0, 0])
    pend[0] += samples
    pend[1] += compute_s
    pend[2] += 1
    if pend[2] < cfg.window_steps:
        return False
    wins = mon["windows"].setdefault(key, [])
    wins.append(pend[0] / pend[1])
    del wins[:-_HISTORY]
    mon["closed"][key] = mon["closed"].get(key, 0) + 1
    mon["pending"][key] = [0, 0.0, 0]
    return True


def initial_control_state(world: int, batch_sizes: list[int]) -> dict:
    """Monitor + Controller state of a new job, JSON-able."""
    return {
        "monitor": {"last_step": {}, "pending": {}, "windows": {}, "closed": {}},
        "rounds": 0,
        "streak": [0] * world,
        "classes": ["normal"] * world,
        "cooldown": 0,
        "restarts": 0,
        "plan": Plan(0, tuple(batch_sizes), tuple([None] * world), {}).to_dict(),
        "history": [],
    }


def _classify(streak: int, ratio: float, rounds: int, mcfg: MonitorConfig) -> str:
    if streak < mcfg.consecutive_windows:
        return "normal"
    if streak < mcfg.persistent_windows:
        return "transient"
    # Slow since the first window at a steady ratio: heterogeneous hardware rather than contention.
    return "deterministic" if streak >= rounds else "persistent"


def controller_step(ctl: dict, mcfg: MonitorConfig, ccfg: ControllerConfig, remaining_samples: int) -> dict:
    """Run the Controller once every rank has closed a new window. Returns the new control state (the input is not
    modified; what this step does not change, the Monitor included, is shared with it rather than copied, since the
    Monitor's windows and the history grow with the world size); ``state["plan"]["version"]`` grows when the split
    or an action changed."""
    world = len(ctl["streak"])
    closed = [ctl["monitor"]["closed"].get(str(r), 0) for r in range(world)]
    if min(closed) <= ctl["rounds"]:
        return ctl
    new = {**ctl, "streak": list(ctl["streak"]), "classes": list(ctl["classes"]), "history": list(ctl["history"])}
    new["rounds"] = min(closed)
    rates = [new["monitor"]["windows"][str(r)][-1] for r in range(world)]
    med = statistics.median(rates)
    ratios = [r / med for r in rates]
    for r in range(world):
        slow = ratios[r] < 1.0 - mcfg.straggler_threshold
        new["streak"][r] = new["streak"][r] + 1 if slow else 0
        new["classes"][r] = _classify(new["streak"][r], ratios[r], new["rounds"], mcfg)
    plan = Plan.from_dict(new["plan"])
    cur = list(plan.batch_sizes)
    total = sum(cur)
    target = cur
    actions: dict[int, str] = {}
    if ccfg.policy == "dd":
        target = proportional_split(total, rates, ccfg.min_batch_size)
    elif ccfg.policy == "nd":
        stragglers = [r for r in range(world) if new["classes"][r] != "normal"]
        target = proportional_split(total, rates, ccfg.min_batch_size) if stragglers else equal_split(total, world)
        remaining_steps = remaining_samples / max(total, 1)
        for r in stragglers:
            severe = ratios[r] < mcfg.severe_ratio and new["classes"][r] in ("persistent", "deterministic")
            if severe and new["restarts"] < ccfg.max_restarts:
                saving = restart_saving_s(target, rates, r, remaining_steps, ccfg.restart_cost_s,
                                          ccfg.min_batch_size)
                if saving > 0:
                    actions[r] = "restart"
    changed = False
    if new["cooldown"] > 0:
        new["cooldown"] -= 1
    elif target != cur:
        gain = predicted_step_time(cur, rates) / predicted_step_time(target, rates) - 1.0
        if gain >= ccfg.min_gain:
            cur = target
            changed = True
            new["cooldown"] = ccfg.cooldown_windows
    if actions:
        new["restarts"] += len(actions)
        changed = True
    if changed:
        new["plan"] = Plan(plan.version + 1, tuple(cur), plan.micro_batch, actions).to_dict()
    new["history"].append({"round": new["rounds"], "rates": rates, "classes": list(new["classes"]),
                           "batch_sizes": list(cur), "version": new["plan"]["version"]})
    del new["history"][:-_HISTORY]
    return new
