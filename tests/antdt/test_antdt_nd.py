"""AntDT-ND without processes: the eviction break-even, the Controller's absorb-or-evict choice, the job's generation
(the incarnation fencing is per job and rendezvous round, not per agent), the persistent blacklist, and every bad
input refused with its reason and nothing changed."""

from __future__ import annotations

import copy

import pytest
from _service_sim import ServiceSim

from antdt_callbacks import (
    ControllerConfig,
    JobConfig,
    MonitorConfig,
    RefusedError,
    StaleIncarnationError,
    UnknownWorkerError,
    evict_saving_s,
)
from antdt_callbacks._state import apply, decide
from antdt_callbacks.controller import (
    controller_step,
    fit_step_cost,
    initial_control_state,
    monitor_observe,
    predicted_step_time_fixed,
)
from antdt_callbacks.store import SQLiteStore

MCFG = MonitorConfig(window_steps=2, consecutive_windows=1, persistent_windows=2, straggler_threshold=0.3,
                     severe_ratio=0.6)


def nd(**kw) -> ControllerConfig:
    return ControllerConfig(**{"policy": "nd", "cooldown_windows": 0, "max_evictions": 1, "evict_cost_s": 1.0,
                               "min_nodes": 1, **kw})


def test_fit_separates_the_per_step_cost_from_the_per_sample_cost():
    f, c = fit_step_cost([[8, 0.02 + 8 * 0.003], [3, 0.02 + 3 * 0.003], [5, 0.02 + 5 * 0.003]])
    assert f == pytest.approx(0.02) and c == pytest.approx(0.003)
    f, c = fit_step_cost([[8, 0.1], [8, 0.1]])  # one batch size: all of it per sample
    assert f == 0.0 and c == pytest.approx(0.1 / 8)


def test_break_even_evicts_only_when_the_slow_node_floor_outweighs_its_help():
    # A node 3x slow on a step dominated by a per-step part: its floor (3 x 20 ms) is worse than doing its share
    # elsewhere, so evicting pays once enough steps remain; dominated by per-sample work, absorbing it is better.
    fixed, per = [0.02, 0.06], [0.001, 0.003]
    t_all = predicted_step_time_fixed(16, fixed, per)
    assert t_all == pytest.approx(0.063)  # the slow rank held at one sample
    assert evict_saving_s(16, fixed, per, [1], remaining_steps=100, evict_cost_s=1.0) == pytest.approx(
        100 * (0.063 - 0.036) - 1.0)
    assert evict_saving_s(16, fixed, per, [1], remaining_steps=10, evict_cost_s=1.0) < 0  # too late to pay back
    assert evict_saving_s(16, [0.0, 0.0], [0.001, 0.003], [1], 10**6, 1.0) < 0  # pure per-sample: absorb


def _feed(ctl, ccfg, cost, steps, nodes=("a", "b"), remaining=10**5):
    """Feed per-rank step compute times ``cost(step, rank, b)`` through the Monitor and the Controller."""
    ctl["nodes"] = list(nodes)
    for k in range(steps):
        for r in range(len(ctl["streak"])):
            b = ctl["plan"]["batch_sizes"][r]
            monitor_observe(ctl["monitor"], MCFG, r, k, b, cost(k, r, b))
        ctl = controller_step(ctl, MCFG, ccfg, remaining_samples=remaining)
    return ctl


def _node_cost(slow_rank: int, until: int = 10**9):
    # fixed 20 ms + 1 ms/sample, 3x on the slow rank's node (a co-tenant takes 2/3 of its core)
    return lambda k, r, b: (0.02 + 0.001 * b) * (3.0 if r == slow_rank and k < until else 1.0)


def test_controller_evicts_a_persistently_slow_node_and_blacklists_it():
    ctl = _feed(initial_control_state(2, [8, 8]), nd(), _node_cost(1), 12)
    assert ctl["plan"]["actions"] == {"1": "evict"}, ctl["history"][-3:]
    assert list(ctl["blacklist"]) == ["b"] and "persistent straggler" in ctl["blacklist"]["b"]["reason"]
    assert ctl["evictions"] == 1
    note = next(n for h in ctl["history"] for n in h.get("eviction", []) if n["choice"] == "evict")
    assert note["node"] == "b" and note["saving_s"] > 0
    # the pending eviction stays in every later plan; nothing else is decided meanwhile
    later = _feed(ctl, nd(), _node_cost(1), 6)
    assert later["plan"]["actions"] == {"1": "evict"} and later["evictions"] == 1


def test_eviction_below_min_nodes_is_absorbed_with_the_reason():
    ctl = _feed(initial_control_state(2, [8, 8]), nd(min_nodes=2), _node_cost(1), 12)
    assert ctl["plan"]["actions"] == {} and ctl["blacklist"] == {}
    assert ctl["plan"]["batch_sizes"][1] < 8  # absorbed by dynamic sharding
    notes = [n for h in ctl["history"] for n in h.get("eviction", [])]
    assert notes and all(n["choice"] == "absorb" and "min_nodes=2" in n["why"] for n in notes)


def test_a_node_slow_per_sample_only_is_absorbed_not_evicted():
    cost = lambda k, r, b: 0.001 * b * (3.0 if r == 1 else 1.0)  # noqa: E731 - no per-step part
    ctl = _feed(initial_control_state(2, [8, 8]), nd(), cost, 12)
    assert ctl["plan"]["actions"] == {} and ctl["blacklist"] == {}
    assert ctl["plan"]["batch_sizes"] == [12, 4]


def test_transient_straggler_is_absorbed_then_forgotten():
    # Mostly per-sample cost here: with a large per-step part the rate of a rank given a small batch looks low even
    # once its node recovered (samples / compute time is not batch-free), which the Monitor does not correct yet.
    mcfg_long = MonitorConfig(window_steps=2, consecutive_windows=1, persistent_windows=50, straggler_threshold=0.3,
                              severe_ratio=0.6)
    ctl = initial_control_state(2, [8, 8])
    ctl["nodes"] = ["a", "b"]
    plans = []
    for k in range(40):
        for r in range(2):
            b = ctl["plan"]["batch_sizes"][r]
            monitor_observe(ctl["monitor"], mcfg_long, r, k, b, (0.002 + 0.003 * b) * (3.0 if r == 1 and k < 12 else 1))
        ctl = controller_step(ctl, mcfg_long, nd(), remaining_samples=10**5)
        plans.append(list(ctl["plan"]["batch_sizes"]))
    assert any(p[1] < 8 for p in plans[:14])  # absorbed while slow
    assert plans[-1] == [8, 8] and ctl["streak"] == [0, 0] and ctl["blacklist"] == {}  # then forgotten


# ------------------------------------------------------------------------------------------ service state


class Svc(ServiceSim):
    def __init__(self, ccfg: ControllerConfig | None = None, **job):
        job = {"dataset_size": 96, "shard_size": 8, "world_size": 3, "global_batch_size": 12, **job}
        super().__init__(JobConfig(**job), MCFG, ccfg or nd())

    def snapshot(self):
        return copy.deepcopy((self.st.shards, self.st.workers, self.st.control, self.st.epoch, self.st.lease_seq))


def _round(svc: Svc, nodes: list[str], checkpoint_id: int = 0) -> int:
    gen = svc("reform", rank=0, world_size=len(nodes), nodes=nodes, checkpoint_id=checkpoint_id)["generation"]
    for r, n in enumerate(nodes):
        svc("register", rank=r, incarnation=gen, node=n)
    return gen


def test_generation_is_monotonic_per_job_and_fences_every_earlier_round():
    svc = Svc()
    g1 = _round(svc, ["a", "b", "c"])
    lease = svc("lease", rank=2, incarnation=g1, request_id="x")["shard"]
    # A re-formed round (two nodes): a new generation, whatever the agents' restart counts are.
    g2 = _round(svc, ["a", "c"])
    assert g2 == g1 + 1
    assert svc.st.control["plan"]["batch_sizes"] == [6, 6]
    # The old round's rank 2 holds nothing any more: its lease went back with the rollback, and it is fenced.
    assert svc.st.shards[(0, lease["shard_id"])].state == "TODO"
    with pytest.raises(UnknownWorkerError, match="outside the current round's world size 2"):
        svc("lease", rank=2, incarnation=g1, request_id="y")
    with pytest.raises(StaleIncarnationError, match="earlier rendezvous round"):
        svc("lease", rank=1, incarnation=g1, request_id="z")
    # A legacy per-agent restart count (0 for a replacement agent) is refused the same way.
    with pytest.raises(StaleIncarnationError):
        svc("register", rank=0, incarnation=0, node="a")


def test_bad_input_is_refused_with_a_reason_and_changes_nothing():
    svc = Svc(nd(min_nodes=2))
    gen = _round(svc, ["a", "b"])
    svc("lease", rank=1, incarnation=gen, request_id="l1")
    before = svc.snapshot()
    cases = [
        # an eviction that would leave fewer nodes than MIN
        ("evict", {"node": "b"}, RefusedError, "fewer than min_nodes=2"),
        ("evict", {"node": "zz"}, RefusedError, "not a member"),
        # a spare with a stale incarnation
        ("register", {"rank": 1, "incarnation": gen - 1, "node": "b"}, StaleIncarnationError, "earlier rendezvous"),
        ("register", {"rank": 1, "incarnation": gen, "node": "a"}, Exception, "runs on node 'b'"),
    ]
    for op, req, exc, text in cases:
        with pytest.raises(exc, match=text):
            decide(svc.st, {"op": op, **req}, svc.now)
    assert svc.snapshot() == before


def test_blacklisted_node_cannot_rejoin_and_the_blacklist_survives_a_restart(tmp_path):
    db = tmp_path / "s.sqlite"
    store = SQLiteStore(db)
    job = JobConfig(dataset_size=96, shard_size=8, world_size=3, global_batch_size=12)
    st, _ = store.load_or_create(job, MCFG, nd(), 10.0, 1000.0)

    def call(op, **req):
        d = decide(st, {"op": op, **req}, 1000.0)
        store.commit(d)
        apply(st, d)
        return d.reply

    gen = call("reform", rank=0, world_size=3, nodes=["a", "b", "c"], checkpoint_id=0)["generation"]
    for r, n in enumerate("abc"):
        call("register", rank=r, incarnation=gen, node=n)
    held = call("lease", rank=1, incarnation=gen, request_id="q")["shard"]
    reply = call("evict", node="b", reason="slow co-tenant")
    assert reply["plan"]["actions"] == {"1": "evict"} and "b" in reply["blacklist"]
    with pytest.raises(RefusedError, match="pending"):
        decide(st, {"op": "evict", "node": "c"}, 1000.0)
    store.close()

    store = SQLiteStore(db)  # the service restarted: the blacklist and the generation are back from the file
    st, created = store.load_or_create(job, MCFG, nd(), 10.0, 1000.0)
    assert not created and list(st.control["blacklist"]) == ["b"] and st.control["generation"] == gen
    before = copy.deepcopy((st.shards, st.workers, st.control))
    for op, req in [("reform", {"rank": 0, "world_size": 3, "nodes": ["a", "b", "c"], "checkpoint_id": 0}),
                    ("register", {"rank": 1, "incarnation": gen, "node": "b"})]:
        with pytest.raises(RefusedError, match="blacklisted.*slow co-tenant"):
            decide(st, {"op": op, **req}, 1000.0)
    assert copy.deepcopy((st.shards, st.workers, st.control)) == before
    # The job re-forms without it: the evicted worker's lease is re-leased to the survivors.
    d = decide(st, {"op": "reform", "rank": 0, "world_size": 2, "nodes": ["a", "c"], "checkpoint_id": 0}, 1000.0)
    store.commit(d)
    apply(st, d)
    assert d.reply["generation"] == gen + 1 and d.reply["plan"]["actions"] == {}
    assert st.shards[(0, held["shard_id"])].state == "TODO"
    store.close()
    store = SQLiteStore(db)
    st2, _ = store.load_or_create(job, MCFG, nd(), 10.0, 1000.0)
    assert st2.control["generation"] == gen + 1 and st2.control["nodes"] == ["a", "c"]
    assert set(st2.control["monitor"]["closed"]) == {"0", "1"}  # the old round's three Monitor rows are gone
    store.close()


def test_refusals_travel_over_http_as_typed_errors_and_the_cli_reports_them(tmp_path, capsys):
    from antdt_callbacks import AgentConfig, ServeConfig, ShardingClient, ShardingService
    from antdt_callbacks.__main__ import main

    svc = ShardingService(ServeConfig(db=str(tmp_path / "s.sqlite")), JobConfig(dataset_size=64, shard_size=8,
                          world_size=2, global_batch_size=4), MCFG, nd(min_nodes=2)).start()
    try:
        client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=5))
        gen = client.reform(2, ["a", "b"], 0)["generation"]
        with pytest.raises(RefusedError, match="fewer than min_nodes=2"):
            client.evict("b")
        assert main(["evict", "--url", svc.url, "--node", "b"]) == 1
        assert "refused: eviction refused" in capsys.readouterr().err
        stale = ShardingClient(svc.url, rank=1, incarnation=gen - 1, config=AgentConfig(url=svc.url))
        with pytest.raises(StaleIncarnationError):
            stale.register(node="b")
        status = client.status()
        assert status["generation"] == gen and status["nodes"] == ["a", "b"] and status["blacklist"] == {}
    finally:
        svc.stop()


def test_a_measured_reformation_replaces_the_configured_eviction_cost():
    # _node_cost(1) evicts at a configured cost of 1 s; a job whose own re-formations took 500 s absorbs instead
    def start(reforms):
        ctl = initial_control_state(2, [8, 8])
        ctl["reform_s"] = list(reforms)
        return ctl

    ctl = _feed(start([400.0, 500.0, 600.0]), nd(), _node_cost(1), 12, remaining=2000)
    assert ctl["plan"]["actions"] == {} and ctl["blacklist"] == {}
    notes = [n for h in ctl["history"] for n in h.get("eviction", [])]
    assert notes and all(n["choice"] == "absorb" and n["evict_cost_s"] == 500.0 for n in notes), notes
    assert "measured over 3 re-formation(s)" in notes[0]["evict_cost_source"]
    # switched off, or before any re-formation: the configured cost decides (and the note says so)
    for ccfg, reforms in [(nd(measure_reform_cost=False), [400.0, 500.0, 600.0]), (nd(), [])]:
        ctl = _feed(start(reforms), ccfg, _node_cost(1), 12, remaining=2000)
        assert ctl["plan"]["actions"] == {"1": "evict"}, ctl["history"][-2:]
        note = next(n for h in ctl["history"] for n in h.get("eviction", []) if n["choice"] == "evict")
        assert note["evict_cost_s"] == 1.0 and note["evict_cost_source"] == "configured"


def test_the_service_times_each_reformation_from_the_leaving_checkpoint(tmp_path):
    db = tmp_path / "s.sqlite"
    job = JobConfig(dataset_size=96, shard_size=8, world_size=2, global_batch_size=8)
    store = SQLiteStore(db)
    st, _ = store.load_or_create(job, MCFG, nd(), 10.0, 1000.0)

    def call(op, now, **req):
        d = decide(st, {"op": op, **req}, now)
        store.commit(d)
        apply(st, d)
        return d.reply

    gen = call("reform", 1000.0, rank=0, world_size=2, nodes=["a", "b"], checkpoint_id=0)["generation"]
    for r, n in enumerate("ab"):
        call("register", 1000.0, rank=r, incarnation=gen, node=n)
    call("commit", 1010.0, rank=0, incarnation=gen, checkpoint_id=4)  # a periodic checkpoint: nobody leaves
    gen = call("reform", 1011.0, rank=0, world_size=2, nodes=["a", "b"], checkpoint_id=4)["generation"]
    assert st.control["reform_s"] == [] and "left_at" not in st.control
    for r, n in enumerate("ab"):
        call("register", 1011.0, rank=r, incarnation=gen, node=n)
    call("commit", 1020.0, rank=0, incarnation=gen, checkpoint_id=8, leaving=True)
    store.close()
    store = SQLiteStore(db)  # the service restarted between the checkpoint and the re-form: the mark survives
    st, _ = store.load_or_create(job, MCFG, nd(), 10.0, 1000.0)
    call("reform", 1062.5, rank=0, world_size=1, nodes=["a"], checkpoint_id=8)
    assert st.control["reform_s"] == [42.5] and "left_at" not in st.control
    assert decide(st, {"op": "status"}, 1063.0).reply["reform_s"] == [42.5]
    store.close()
