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
    "eviction_refusal",
    "evict_node",
    "evict_saving_s",
    "reform_cost_s",
    "fit_step_cost",
    "initial_control_state",
    "monitor_observe",
    "predicted_step_time",
    "predicted_step_time_fixed",
    "proportional_split",
    "restart_saving_s",
]

_HISTORY = 256
_SHAPES = 16  # windows kept per rank for the per-step / per-sample cost fit


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
    # (mean batch, mean compute seconds) per step of the window: windows at different batch sizes (before and
    # after a re-split) separate a rank's per-step cost from its per-sample cost (`fit_step_cost`).
    shape = mon.setdefault("shape", {}).setdefault(key, [])
    shape.append([pend[0] / pend[2], pend[1] / pend[2]])
    del shape[:-_SHAPES]
    mon["closed"][key] = mon["closed"].get(key, 0) + 1
    mon["pending"][key] = [0, 0.0, 0]
    return True


def initial_control_state(world: int, batch_sizes: list[int]) -> dict:
    """Monitor + Controller state of a new job, JSON-able."""
    return {
        "monitor": {"last_step": {}, "pending": {}, "windows": {}, "closed": {}, "shape": {}},
        "rounds": 0,
        "streak": [0] * world,
        "classes": ["normal"] * world,
        "cooldown": 0,
        "restarts": 0,
        "plan": Plan(0, tuple(batch_sizes), tuple([None] * world), {}).to_dict(),
        "history": [],
        # Elastic membership (ND): the node of every rank of the current rendezvous round ([] = not told, then no
        # eviction is possible), the evicted nodes with why, and how many evictions were decided.
        "nodes": [],
        "blacklist": {},
        "evictions": 0,
        # Measured re-formations of this job (seconds from the leaving checkpoint's commit to the next round's
        # re-form), the latest last; they replace the configured eviction / restart cost once there is one.
        "reform_s": [],
    }


_REFORMS_KEPT = 5


def reform_cost_s(ctl: dict, configured: float, ccfg: ControllerConfig) -> tuple[float, str]:
    """What one re-formation (eviction or kill-and-restart) is expected to cost, and where the figure comes from:
    the median of this job's measured re-formations when ``ccfg.measure_reform_cost`` and there is one, else the
    configured value. A measured one counts checkpoint write, exits, torchrun's re-rendezvous (its last-call wait
    included), worker start-up and checkpoint load, which a configured guess easily gets wrong by a factor."""
    seen = [float(x) for x in ctl.get("reform_s", [])]
    if ccfg.measure_reform_cost and seen:
        return statistics.median(seen), f"measured over {len(seen)} re-formation(s) of this job"
    return configured, "configured"


def _classify(streak: int, ratio: float, rounds: int, mcfg: MonitorConfig) -> str:
    if streak < mcfg.consecutive_windows:
        return "normal"
    if streak < mcfg.persistent_windows:
        return "transient"
    # Slow since the first window at a steady ratio: heterogeneous hardware rather than contention.
    return "deterministic" if streak >= rounds else "persistent"


def fit_step_cost(shape: list[list[float]]) -> tuple[float, float]:
    """``(fixed_s, per_sample_s)`` of one rank from its windows' ``[mean batch, mean compute s]`` per step.

    A least-squares line through the windows. Why: a rank's step costs a part that does not shrink with its batch
    (optimizer, gradient buckets, Python per step) and a part per sample; a straggler slows both, and dynamic sharding
    can only take away the second. With one batch size seen (no re-split yet) the two cannot be told apart and the
    whole cost is taken as per-sample (what `proportional_split` assumes)."""
    pts = [(float(b), float(t)) for b, t in shape if b > 0 and t > 0]
    if not pts:
        return 0.0, 0.0
    mb = sum(b for b, _ in pts) / len(pts)
    mt = sum(t for _, t in pts) / len(pts)
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var < 0.25 * len(pts):  # batch sizes within about half a sample of each other: no slope to fit
        return 0.0, mt / mb
    c = sum((b - mb) * (t - mt) for b, t in pts) / var
    c = max(c, 1e-3 * mt / mb)  # noise can tilt the line the wrong way: time never falls with more samples
    f = min(max(mt - c * mb, 0.0), min(t for _, t in pts))
    return f, c


def predicted_step_time_fixed(total: int, fixed: list[float], per_sample: list[float], min_batch: int = 1) -> float:
    """Shortest synchronous step ``max_i fixed_i + b_i * per_sample_i`` over splits of ``total`` samples with
    ``b_i >= min_batch`` (continuous water-filling: ranks finish together, except those held at ``min_batch``).
    Every member costs at least its own fixed part plus ``min_batch`` samples: that floor is what a slow node
    imposes on every step however little data it gets."""
    n = len(fixed)
    if n == 0:
        return math.inf
    held: set[int] = set()
    while True:
        free = [i for i in range(n) if i not in held]
        if not free:
            t = 0.0
            break
        inv = sum(1.0 / per_sample[i] for i in free)
        t = (total - min_batch * len(held) + sum(fixed[i] / per_sample[i] for i in free)) / inv
        low = [i for i in free if (t - fixed[i]) / per_sample[i] < min_batch]
        if not low:
            break
        held.update(low)
    return max([t] + [fixed[i] + min_batch * per_sample[i] for i in held])


def evict_saving_s(total: int, fixed: list[float], per_sample: list[float], leaving: list[int],
                   remaining_steps: float, evict_cost_s: float, min_batch: int = 1) -> float:
    """ND break-even of an eviction: seconds saved over the remaining steps by running without the ranks in
    ``leaving`` (their node evicted, the global batch split over the others) rather than absorbing them with dynamic
    sharding, minus what the eviction costs (checkpoint, re-rendezvous, restart, redone steps). Positive = evict."""
    keep = [i for i in range(len(fixed)) if i not in set(leaving)]
    if not keep:
        return -math.inf
    t_absorb = predicted_step_time_fixed(total, fixed, per_sample, min_batch)
    t_without = predicted_step_time_fixed(total, [fixed[i] for i in keep], [per_sample[i] for i in keep], min_batch)
    return remaining_steps * (t_absorb - t_without) - evict_cost_s


def eviction_refusal(ctl: dict, ccfg: ControllerConfig, node: str) -> str | None:
    """Why evicting ``node`` must be refused now (None: it may go). Shared by the Controller and the ``evict`` op."""
    nodes = list(ctl.get("nodes") or [])
    if node in ctl.get("blacklist", {}):
        return f"node {node!r} is already evicted ({ctl['blacklist'][node].get('reason', '')})."
    if node not in nodes:
        return (f"node {node!r} is not a member of the current rendezvous round (members: {sorted(set(nodes))}); "
                "only a member can be evicted.")
    pending = sorted({nodes[int(r)] for r, a in ctl["plan"].get("actions", {}).items()
                      if a == "evict" and int(r) < len(nodes)})
    if pending:
        return f"the eviction of {pending} is pending until the job re-forms; evict one node at a time."
    left = len(set(nodes) - {node})
    if left < ccfg.min_nodes:
        return (f"evicting node {node!r} would leave {left} node(s), fewer than min_nodes={ccfg.min_nodes} (torchrun "
                "--nnodes MIN:MAX); its straggling is absorbed by dynamic sharding instead.")
    return None


def evict_node(ctl: dict, node: str, reason: str) -> dict:
    """Control state with ``node`` blacklisted and an ``evict`` action for each of its ranks (a new plan version).
    Every rank checkpoints at the same step; the node's ranks then stop their agent and the others re-form."""
    nodes = list(ctl.get("nodes") or [])
    plan = Plan.from_dict(ctl["plan"])
    actions = {r: "evict" for r, n in enumerate(nodes) if n == node}
    new = {**ctl, "blacklist": {**ctl.get("blacklist", {}), node: {"reason": reason, "round": ctl["rounds"]}},
           "evictions": int(ctl.get("evictions", 0)) + 1}
    new["plan"] = Plan(plan.version + 1, plan.batch_sizes, plan.micro_batch, actions).to_dict()
    return new


def _consider_eviction(new: dict, mcfg: MonitorConfig, ccfg: ControllerConfig, rank: int, ratio: float,
                       total: int, remaining_steps: float) -> dict:
    """The ND choice for one persistent severe straggler: a history note, with ``"evict": True`` when it pays."""
    nodes = list(new.get("nodes") or [])
    world = len(new["streak"])
    if len(nodes) != world:
        return {"rank": rank, "choice": "absorb", "why": "the nodes of the ranks are unknown"}
    node = nodes[rank]
    refusal = eviction_refusal(new, ccfg, node)
    if refusal is not None:
        return {"rank": rank, "node": node, "choice": "absorb", "why": refusal}
    costs = [fit_step_cost(new["monitor"].get("shape", {}).get(str(r), [])) for r in range(world)]
    if any(c <= 0 for _, c in costs):
        return {"rank": rank, "node": node, "choice": "absorb", "why": "no cost measurement for every rank yet"}
    leaving = [r for r in range(world) if nodes[r] == node]
    cost, source = reform_cost_s(new, ccfg.evict_cost_s, ccfg)
    saving = evict_saving_s(total, [f for f, _ in costs], [c for _, c in costs], leaving, remaining_steps,
                            cost, ccfg.min_batch_size)
    note = {"rank": rank, "node": node, "saving_s": round(saving, 3), "evict_cost_s": round(cost, 3),
            "evict_cost_source": source, "fixed_s": round(costs[rank][0], 5),
            "per_sample_s": round(costs[rank][1], 6),
            "others_fixed_s": round(statistics.median([f for i, (f, _) in enumerate(costs) if i not in leaving]
                                                      or [0.0]), 5)}
    if saving <= 0:
        return {**note, "choice": "absorb", "why": "evicting does not pay back its cost over the remaining steps"}
    return {**note, "choice": "evict", "evict": True,
            "why": (f"persistent straggler at {ratio:.2f}x the median rate for {new['streak'][rank]} windows; "
                    f"evicting saves {saving:.1f} s over the remaining {remaining_steps:.0f} steps net of "
                    f"an eviction cost of {cost:.1f} s ({source})")}


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
    notes: list[dict] = []
    evicted: dict | None = None
    if ccfg.policy == "dd":
        target = proportional_split(total, rates, ccfg.min_batch_size)
    elif ccfg.policy == "nd":
        stragglers = [r for r in range(world) if new["classes"][r] != "normal"]
        target = proportional_split(total, rates, ccfg.min_batch_size) if stragglers else equal_split(total, world)
        remaining_steps = remaining_samples / max(total, 1)
        pending = {r: a for r, a in plan.actions.items() if a == "evict"}
        if pending:
            stragglers = []  # an eviction holds until the job re-forms without the node; nothing else is decided
        for r in stragglers:
            severe = ratios[r] < mcfg.severe_ratio and new["classes"][r] in ("persistent", "deterministic")
            if severe and int(new.get("evictions", 0)) < ccfg.max_evictions:
                note = _consider_eviction(new, mcfg, ccfg, r, ratios[r], total, remaining_steps)
                notes.append(note)
                if note.pop("evict", False):
                    evicted = note
                    break
            if severe and new["restarts"] < ccfg.max_restarts:
                saving = restart_saving_s(target, rates, r, remaining_steps,
                                          reform_cost_s(new, ccfg.restart_cost_s, ccfg)[0], ccfg.min_batch_size)
                if saving > 0:
                    actions[r] = "restart"
    if evicted is not None:
        new = evict_node(new, evicted["node"], evicted["why"])
        new["history"].append({"round": new["rounds"], "rates": rates, "classes": list(new["classes"]),
                               "batch_sizes": list(cur), "version": new["plan"]["version"], "eviction": notes})
        del new["history"][:-_HISTORY]
        return new
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
    if ccfg.policy == "nd" and plan.actions and all(a == "evict" for a in plan.actions.values()):
        actions = dict(plan.actions)  # keep the pending eviction in every new plan
    if changed:
        new["plan"] = Plan(plan.version + 1, tuple(cur), plan.micro_batch, actions).to_dict()
    entry = {"round": new["rounds"], "rates": rates, "classes": list(new["classes"]), "batch_sizes": list(cur),
             "version": new["plan"]["version"]}
    if notes:
        entry["eviction"] = notes
    new["history"].append(entry)
    del new["history"][:-_HISTORY]
    return new
