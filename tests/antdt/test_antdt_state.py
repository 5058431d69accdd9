"""The pure service state machine and the Controller, without processes (decide/apply as the server runs them)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _service_sim import ServiceSim

from antdt_callbacks import (
    BadRequestError,
    ControllerConfig,
    FencedError,
    JobConfig,
    MonitorConfig,
    NotFoundError,
    StaleIncarnationError,
    UnknownWorkerError,
    controller_step,
    proportional_split,
    restart_saving_s,
)
from antdt_callbacks._state import decide, new_job_state, shard_sample_ids
from antdt_callbacks.controller import initial_control_state, monitor_observe


class Svc(ServiceSim):
    def __init__(self, **job):
        super().__init__(JobConfig(**job), MonitorConfig(), ControllerConfig())

    def lease(self, rank: int, inc: int = 0):
        return self("lease", rank=rank, incarnation=inc, request_id=f"r{self.n}")


def consume_all(svc: Svc, ranks=(0, 1), inc: int = 0) -> list[int]:
    ids: list[int] = []
    for _ in range(1000):
        progressed = False
        for r in ranks:
            rep = svc.lease(r, inc)
            if rep["status"] != "shard":
                continue
            s = rep["shard"]
            ids += shard_sample_ids(svc.st.job, s["epoch"], s["shard_id"], s["start"], s["end"])[s["offset"]:].tolist()
            svc("ack", rank=r, incarnation=inc, items=[{"epoch": s["epoch"], "shard_id": s["shard_id"],
                                                         "token": s["token"], "offset": s["end"] - s["start"]}])
            progressed = True
        if not progressed:
            break
    return ids


def registered(**job) -> Svc:
    svc = Svc(**{"dataset_size": 100, "shard_size": 16, "world_size": 2, "global_batch_size": 8, **job})
    svc("register", rank=0, incarnation=0)
    svc("register", rank=1, incarnation=0)
    return svc


def test_every_sample_once_per_epoch_with_seeded_shuffle():
    svc = registered(num_epochs=3, seed=7)
    ids = consume_all(svc)
    assert len(ids) == 300
    assert np.bincount(ids).tolist() == [3] * 100
    assert svc.lease(0)["status"] == "end"
    again = consume_all(registered(num_epochs=3, seed=7))
    assert again == ids  # same seed, same order
    assert consume_all(registered(num_epochs=3, seed=8)) != ids


def test_expired_lease_requeues_only_the_unconsumed_tail_and_fences_the_owner():
    svc = registered(lease_ttl_s=5)
    s = svc.lease(0)["shard"]
    item = {"epoch": 0, "shard_id": s["shard_id"], "token": s["token"]}
    svc("ack", rank=0, incarnation=0, items=[{**item, "offset": 6}])
    svc.now += 6  # past the lease deadline, no heartbeat
    other = svc.lease(1)["shard"]
    assert (other["shard_id"], other["offset"]) == (s["shard_id"], 6)  # the tail [6, 16), not the whole shard
    with pytest.raises(FencedError):
        svc("ack", rank=0, incarnation=0, items=[{**item, "offset": 10}])
    renew = svc("renew", rank=0, incarnation=0, items=[item])
    assert renew["fenced"] and not renew["renewed"]


def test_heartbeat_keeps_a_lease_alive():
    svc = registered(lease_ttl_s=5)
    s = svc.lease(0)["shard"]
    item = {"epoch": 0, "shard_id": s["shard_id"], "token": s["token"]}
    for _ in range(4):
        svc.now += 3
        assert svc("renew", rank=0, incarnation=0, items=[item])["renewed"]
    svc("ack", rank=0, incarnation=0, items=[{**item, "offset": 16}])
    assert svc.st.shards[(0, s["shard_id"])].state == "DONE"


def test_rejections_change_nothing():
    svc = registered()
    s = svc.lease(0)["shard"]
    before = copy.deepcopy((svc.st.shards, svc.st.workers, svc.st.control, svc.st.lease_seq))
    bad = [
        ("ack", {"rank": 5, "incarnation": 0, "items": []}, UnknownWorkerError),
        ("ack", {"rank": 0, "incarnation": 0, "items": [{"epoch": 0, "shard_id": s["shard_id"],
                                                          "token": s["token"], "offset": 99}]}, BadRequestError),
        # A valid first item with a forged second one: the whole request is refused, the first is not applied.
        ("ack", {"rank": 0, "incarnation": 0, "items": [
            {"epoch": 0, "shard_id": s["shard_id"], "token": s["token"], "offset": 4},
            {"epoch": 0, "shard_id": s["shard_id"], "token": s["token"] + 1, "offset": 5}]}, FencedError),
        ("ack", {"rank": 0, "incarnation": "0", "items": []}, BadRequestError),
        ("lease", {"rank": 0, "incarnation": 0}, BadRequestError),
        ("frobnicate", {}, BadRequestError),
        ("restore", {"rank": 0, "incarnation": 0, "checkpoint_id": 42}, NotFoundError),
        ("register", {"rank": 2, "incarnation": 0}, UnknownWorkerError),
    ]
    for op, req, exc in bad:
        with pytest.raises(exc):
            decide(svc.st, {"op": op, **req}, svc.now)
    assert (svc.st.shards, svc.st.workers, svc.st.control, svc.st.lease_seq) == before


def test_new_incarnation_fences_the_old_one():
    svc = registered()
    s = svc.lease(1)["shard"]
    svc("register", rank=1, incarnation=1)
    with pytest.raises(StaleIncarnationError):
        svc.lease(1, inc=0)
    with pytest.raises(StaleIncarnationError):
        svc("register", rank=1, incarnation=0)
    assert svc.st.shards[(0, s["shard_id"])].state == "TODO"  # its lease went back


def test_commit_restore_rolls_back_to_exactly_the_checkpointed_progress():
    svc = registered(num_epochs=2, keep_snapshots=2)
    a = svc.lease(0)["shard"]
    svc("ack", rank=0, incarnation=0, items=[{"epoch": a["epoch"], "shard_id": a["shard_id"], "token": a["token"],
                                              "offset": 5}])
    svc("commit", rank=0, incarnation=0, checkpoint_id=10)
    snap = {k: (s.state if s.state == "DONE" else "TODO", s.acked) for k, s in svc.st.shards.items()}
    svc("ack", rank=0, incarnation=0, items=[{"epoch": a["epoch"], "shard_id": a["shard_id"], "token": a["token"],
                                              "offset": 12}])
    consume_all(svc)  # runs on into the next epoch
    svc("restore", rank=0, incarnation=0, checkpoint_id=10)
    assert {k: (s.state if s.state == "DONE" else "TODO", s.acked) for k, s in svc.st.shards.items()} == snap
    assert all(s.state != "DOING" for s in svc.st.shards.values())
    # After the rollback the rest of the data is exactly what the checkpoint had not seen.
    rest = consume_all(svc)
    assert len(rest) == 200 - 5
    for cid in (20, 30, 40):
        svc("commit", rank=0, incarnation=0, checkpoint_id=cid)
    assert sorted(svc.st.snapshots) == [0, 30, 40]


def test_lease_replay_and_ack_replay_are_idempotent():
    svc = registered()
    r1 = svc("lease", rank=0, incarnation=0, request_id="same")
    r2 = svc("lease", rank=0, incarnation=0, request_id="same")
    assert r1 == r2 and sum(s.state == "DOING" for s in svc.st.shards.values()) == 1
    s = r1["shard"]
    item = {"epoch": 0, "shard_id": s["shard_id"], "token": s["token"], "offset": 16}
    svc("ack", rank=0, incarnation=0, items=[item])
    svc("ack", rank=0, incarnation=0, items=[item])  # the reply was lost; the retry is accepted and changes nothing
    assert svc.st.shards[(0, s["shard_id"])].acked == 16


def test_proportional_split_keeps_the_global_batch():
    assert proportional_split(32, [3.0, 1.0]) == [24, 8]
    for rates in ([1, 1, 1], [5, 1, 1, 1], [100, 1], [0.3, 0.3, 0.4]):
        b = proportional_split(37, rates, min_batch=2)
        assert sum(b) == 37 and min(b) >= 2
    # Rounding minimises the synchronous step time: no single-sample move shortens max_i b_i / rate_i.
    rates = [231.0, 80.0, 231.0, 231.0]
    b = proportional_split(64, rates)
    assert b == [20, 6, 19, 19]
    t = max(bi / r for bi, r in zip(b, rates))
    for i in range(4):
        for j in range(4):
            if i != j:
                moved = list(b)
                moved[i] -= 1
                moved[j] += 1
                assert max(bi / r for bi, r in zip(moved, rates)) >= t - 1e-12


def _feed(ctl, mcfg, ccfg, rates, steps, start_step):
    """Feed `steps` steps of per-rank throughputs through the Monitor/Controller; return the plans per step."""
    plans = []
    for k in range(steps):
        for r, tau in enumerate(rates(start_step + k)):
            b = ctl["plan"]["batch_sizes"][r]
            monitor_observe(ctl["monitor"], mcfg, r, start_step + k, b, b / tau)
        ctl = controller_step(ctl, mcfg, ccfg, remaining_samples=10**6)
        plans.append(list(ctl["plan"]["batch_sizes"]))
    return ctl, plans


def test_dd_policy_moves_batch_to_the_fast_rank_within_one_window():
    mcfg, ccfg = MonitorConfig(window_steps=4), ControllerConfig(policy="dd")
    ctl = initial_control_state(2, [16, 16])
    ctl, plans = _feed(ctl, mcfg, ccfg, lambda s: [300.0, 100.0], 8, 0)
    assert plans[2] == [16, 16] and plans[3] == [24, 8]  # decided when the first window closes
    assert ctl["history"][-1]["classes"][1] != "normal"


def test_nd_policy_reacts_to_a_transient_straggler_and_undoes_it():
    mcfg = MonitorConfig(window_steps=2, consecutive_windows=2, persistent_windows=50)
    ccfg = ControllerConfig(policy="nd", cooldown_windows=0)
    ctl = initial_control_state(2, [16, 16])
    slow = lambda s: [300.0, 100.0 if 10 <= s < 30 else 300.0]  # noqa: E731
    ctl, plans = _feed(ctl, mcfg, ccfg, slow, 50, 0)
    changed = next(s for s, p in enumerate(plans) if p != [16, 16])
    assert 10 < changed <= 10 + mcfg.window_steps * (mcfg.consecutive_windows + 1)
    reverted = next(s for s, p in enumerate(plans) if s > changed and p == [16, 16])
    assert 30 <= reverted <= 30 + mcfg.window_steps * 2
    assert plans[-1] == [16, 16]


def test_nd_cost_rule_restarts_only_when_it_pays():
    mcfg = MonitorConfig(window_steps=1, consecutive_windows=1, persistent_windows=2, severe_ratio=0.5)
    rates = lambda s: [300.0, 300.0, 300.0, 50.0]  # noqa: E731
    cheap = ControllerConfig(policy="nd", restart_cost_s=1.0, max_restarts=1)
    ctl, _ = _feed(initial_control_state(4, [8] * 4), mcfg, cheap, rates, 4, 0)
    assert ctl["plan"]["actions"] == {"3": "restart"} and ctl["restarts"] == 1
    dear = ControllerConfig(policy="nd", restart_cost_s=1e9, max_restarts=1)
    ctl, _ = _feed(initial_control_state(4, [8] * 4), mcfg, dear, rates, 4, 0)
    assert ctl["plan"]["actions"] == {} and ctl["restarts"] == 0
    # The rule itself: saving = remaining_steps * (t_now - t_healed) - cost.
    b = [10, 10, 10, 2]
    t_now = max(bi / ri for bi, ri in zip(b, rates(0)))
    assert restart_saving_s(b, rates(0), 3, 100, 0.0) == pytest.approx(100 * (t_now - 32 / 1200))


def test_one_lease_request_can_take_several_shards():
    svc = registered(shuffle=False)
    rep = svc("lease", rank=0, incarnation=0, request_id="multi", min_samples=40, max_shards=8)
    assert [s["end"] - s["start"] for s in rep["shards"]] == [16, 16, 16]  # stops once 40 samples are held
    assert len({s["token"] for s in rep["shards"]}) == 3 and rep["shard"] == rep["shards"][0]
    capped = svc("lease", rank=1, incarnation=0, request_id="cap", min_samples=1000, max_shards=2)
    assert len(capped["shards"]) == 2
    assert svc("lease", rank=0, incarnation=0, request_id="multi", min_samples=40, max_shards=8) == rep  # replay
    ids = consume_all(svc) + [i for r in (rep, capped) for s in r["shards"] for i in
                              shard_sample_ids(svc.st.job, 0, s["shard_id"], s["start"], s["end"]).tolist()]
    assert sorted(ids) == list(range(100))


def test_ack_renews_the_callers_other_leases_and_can_carry_a_lease():
    svc = registered(lease_ttl_s=5)
    a, b = svc("lease", rank=0, incarnation=0, request_id="ab", min_samples=32, max_shards=2)["shards"]
    other = svc.lease(1)["shard"]
    for _ in range(3):  # acks of `a` only: `b` stays alive without any renew call; rank 1's lease is not renewed
        svc.now += 3
        svc("ack", rank=0, incarnation=0, items=[{"epoch": 0, "shard_id": a["shard_id"], "token": a["token"],
                                                   "offset": 1}])
    assert svc.st.shards[(0, b["shard_id"])].state == "DOING"
    assert svc.st.shards[(0, other["shard_id"])].state == "TODO"  # expired, tail back in TODO
    item = {"epoch": 0, "shard_id": a["shard_id"], "token": a["token"], "offset": 16}
    rep = svc("ack", rank=0, incarnation=0, items=[item], lease={"request_id": "p1", "min_samples": 20,
                                                                   "max_shards": 4})
    assert rep["ok"] and rep["lease"]["status"] == "shard" and len(rep["lease"]["shards"]) == 2
    assert svc.st.shards[(0, a["shard_id"])].state == "DONE"
    # A retried request (reply lost) changes nothing more and replays the same leases.
    again = svc("ack", rank=0, incarnation=0, items=[item], lease={"request_id": "p1", "min_samples": 20,
                                                                     "max_shards": 4})
    assert again["lease"] == rep["lease"]
    # A fenced ack refuses the piggybacked lease too.
    before = copy.deepcopy(svc.st.shards)
    with pytest.raises(FencedError):
        decide(svc.st, {"op": "ack", "rank": 0, "incarnation": 0, "items": [{**item, "token": 999}],
                        "lease": {"request_id": "p2"}}, svc.now)
    assert svc.st.shards == before


def test_coalesced_metrics_drive_the_controller_like_one_ack_per_step():
    """An Agent that coalesces acks sends several steps' metrics in one request; each closed window is still a
    Controller round, so the control state equals that of one ack per step (same order per rank)."""
    mcfg, ccfg = MonitorConfig(window_steps=2), ControllerConfig(policy="dd", min_gain=0.0)
    job = JobConfig(dataset_size=100, shard_size=16, world_size=2, global_batch_size=32)

    def service() -> Svc:
        svc = Svc.__new__(Svc)
        svc.st, svc.now, svc.n = new_job_state(job, mcfg, ccfg), 1000.0, 0
        svc("register", rank=0, incarnation=0)
        svc("register", rank=1, incarnation=0)
        return svc

    def m(rank: int, step: int) -> dict:
        return {"step": step, "samples": 16, "compute_s": 16 / (300.0 if rank == 0 else 100.0)}

    one, many = service(), service()
    for first in range(0, 12, 3):  # steps in groups of three, rank 0 then rank 1
        for rank in (0, 1):
            group = [m(rank, s) for s in range(first, first + 3)]
            for entry in group:
                one("ack", rank=rank, incarnation=0, items=[], metrics=entry)
            many("ack", rank=rank, incarnation=0, items=[], metrics=group)
    assert many.st.control == one.st.control
    assert many.st.control["plan"]["batch_sizes"] == [24, 8]  # the fast rank got the larger share


def test_bad_metric_lists_are_refused_and_change_nothing():
    from antdt_callbacks._state import MAX_METRICS_PER_ACK

    svc = registered()
    before = copy.deepcopy(svc.st.control)
    entry = {"step": 1, "samples": 4, "compute_s": 0.1}
    for bad, reason in ([[entry, "x"], "every entry"], [[entry] * (MAX_METRICS_PER_ACK + 1), "at most"],
                        ["fast", "an object"], [[{**entry, "samples": -1}], "samples"]):
        with pytest.raises(BadRequestError, match=reason):
            decide(svc.st, {"op": "ack", "rank": 0, "incarnation": 0, "items": [], "metrics": bad}, svc.now)
    assert svc.st.control == before
