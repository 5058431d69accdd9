"""What the service does to scale, checked against the plain way: the shard index against a rebuilt one and a full
scan, group commits against one transaction per request, the control state stored in parts against the whole, the
heap-based split against the scans it replaced, and group commits against the durability promise (a reply waits
for its transaction; a failed transaction fails its requests and the state rolls back)."""

from __future__ import annotations

import json
import math
import random
import sqlite3
import threading

import pytest

from antdt_callbacks import (
    AgentConfig,
    ControllerConfig,
    JobConfig,
    MonitorConfig,
    ServeConfig,
    ServiceError,
    ShardingClient,
    ShardingService,
    proportional_split,
)
from antdt_callbacks._index import ShardIndex
from antdt_callbacks._state import DOING, apply, decide, new_job_state
from antdt_callbacks.errors import ServiceError as _ServiceError
from antdt_callbacks.store import SQLiteStore

JOB = JobConfig(dataset_size=301, shard_size=8, world_size=4, global_batch_size=16, num_epochs=3, lease_ttl_s=5.0)
MCFG, CCFG = MonitorConfig(window_steps=2), ControllerConfig(policy="dd", min_gain=0.0)


def _random_requests(seed: int, n: int):
    """A random workload, as a generator that is sent each reply: leases, acks (with metrics and piggybacked
    leases), renewals, releases, re-registrations with a new incarnation, checkpoints and restores, on a clock that
    lets leases expire."""
    rng = random.Random(seed)
    held: dict[int, list[dict]] = {r: [] for r in range(JOB.world_size)}
    inc = dict.fromkeys(range(JOB.world_size), 0)
    step = dict.fromkeys(range(JOB.world_size), 0)
    now = 1000.0
    for r in range(JOB.world_size):
        yield {"op": "register", "rank": r, "incarnation": 0}, now
    for k in range(n):
        now += rng.choices([0.0, 0.1, 0.5, 2.0, 6.0], weights=[30, 30, 25, 10, 5])[0]
        r = rng.randrange(JOB.world_size)
        me = {"rank": r, "incarnation": inc[r]}
        keys = ("epoch", "shard_id", "token")
        lease = {"request_id": f"q{k}", "min_samples": rng.randint(1, 20), "max_shards": rng.randint(1, 3)}
        roll = rng.random()
        if roll < 0.3 or not held[r]:
            req = {"op": "lease", **me, **lease}
        elif roll < 0.7:
            items = []
            for h in held[r][: rng.randint(1, 2)]:
                h["offset"] = min(h["size"], h["offset"] + rng.randint(3, 8))
                items.append({**{x: h[x] for x in keys}, "offset": h["offset"]})
            step[r] += 1
            req = {"op": "ack", **me, "items": items,
                   "metrics": {"step": step[r], "samples": 4, "compute_s": 0.01 * (1 + r)}}
            if rng.random() < 0.5:
                req["lease"] = lease
        elif roll < 0.8:
            req = {"op": "renew", **me, "items": [{x: h[x] for x in keys} for h in held[r]]}
        elif roll < 0.86:
            req = {"op": "release", **me, "items": [{x: h[x] for x in keys} for h in held[r][:1]]}
        elif roll < 0.88:
            inc[r] += 1
            held[r] = []
            req = {"op": "register", "rank": r, "incarnation": inc[r]}
        elif roll < 0.993:
            req = {"op": "commit", **me, "checkpoint_id": k + 1}
        elif roll < 0.997:
            req = {"op": "restore", **me, "checkpoint_id": 0}
        else:  # the job re-forms (a new rendezvous round): a new generation, the Monitor rows replaced
            req = {"op": "reform", "rank": 0, "world_size": JOB.world_size, "checkpoint_id": 0,
                   "nodes": [f"n{i}" for i in range(JOB.world_size)]}
        reply = yield req, now
        op = req["op"]
        if op == "reform" and reply:
            held = {rr: [] for rr in held}
            for rr in range(JOB.world_size):
                inc[rr] = reply["generation"]
                yield {"op": "register", "rank": rr, "incarnation": inc[rr], "node": f"n{rr}"}, now
        if op in ("restore", "reform") and reply:
            held = {rr: [] for rr in held}  # every lease is revoked
        elif op in ("ack", "release") and not reply or op == "release":
            gone = {(i["epoch"], i["shard_id"]) for i in req["items"]}  # refused (fenced): drop them
            held[r] = [h for h in held[r] if (h["epoch"], h["shard_id"]) not in gone]
        elif op == "renew" and reply:
            gone = {(e, i) for e, i, _ in reply["fenced"]}
            held[r] = [h for h in held[r] if (h["epoch"], h["shard_id"]) not in gone]
        leased = (reply.get("lease") if op == "ack" else reply) if reply and op in ("ack", "lease") else None
        for s in (leased or {}).get("shards") or []:
            held[r].append({"epoch": s["epoch"], "shard_id": s["shard_id"], "token": s["token"],
                            "offset": s["offset"], "size": s["end"] - s["start"]})
        held[r] = [h for h in held[r] if h["offset"] < h["size"]]


def _drive(seed: int, n: int, on_decision):
    """Run the workload through decide -> apply; ``on_decision(state, decision, now)`` sees every accepted one."""
    st = new_job_state(JOB, MCFG, CCFG)
    gen = _random_requests(seed, n)
    reply = None
    while True:
        try:
            req, now = gen.send(reply)
        except StopIteration:
            return st
        try:
            d = decide(st, req, now)
        except _ServiceError:
            reply = None
            continue
        apply(st, d)
        on_decision(st, d, now)
        reply = d.reply


def _index_view(idx: ShardIndex, shards) -> tuple:
    live = {(dl, e, i) for dl, e, i in idx.deadlines
            if (s := shards.get((e, i))) is not None and s.state == DOING and s.deadline == dl}
    return (list(idx.todo), {r: set(k) for r, k in idx.owned.items() if k}, idx.doing, idx.size, idx.acked, live)


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_index_follows_the_table_through_random_workloads(seed):
    seen = {"expired": 0, "decisions": 0, "epoch": 0, "replaced": 0}

    def check(st, d, now):
        seen["decisions"] += 1
        seen["epoch"] = max(seen["epoch"], st.epoch)
        seen["replaced"] += d.replace_shards
        assert _index_view(st.index, st.shards) == _index_view(ShardIndex.build(st.shards.values()), st.shards)
        for later in (now, now + 3.0, now + 7.0):
            scan = sorted(k for k, s in st.shards.items() if s.state == DOING and s.deadline < later)
            assert sorted(st.index.expired(st.shards, later)) == scan
            seen["expired"] += len(scan)

    _drive(seed, 1000, check)
    # The workload exercised what the index must follow: expiries, epochs opening (the table is replaced), restores.
    assert seen["decisions"] > 600 and seen["expired"] > 0
    assert seen["epoch"] >= 1 and seen["replaced"] > seen["epoch"]


def _loaded(path: str):
    store = SQLiteStore(path)
    try:
        st, created = store.load_or_create(JOB, MCFG, CCFG, lease_grace_s=0.0, now=0.0)
    finally:
        store.close()
    assert not created
    return (st.epoch, st.lease_seq, st.shards, st.workers, st.control, st.snapshots, st.replies)


@pytest.mark.parametrize("seed", [1, 2])
def test_group_commits_write_what_one_commit_per_request_writes(tmp_path, seed):
    one, grouped = SQLiteStore(tmp_path / "one.sqlite"), SQLiteStore(tmp_path / "grouped.sqlite")
    for store in (one, grouped):
        store.load_or_create(JOB, MCFG, CCFG, lease_grace_s=0.0, now=0.0)
    rng = random.Random(seed)
    pending: list = []

    def commit(st, d, now):
        one.commit(d)
        pending.append(d)
        if rng.random() < 0.1:  # groups of ten on average, one request up to dozens
            grouped.commit_many(pending)
            pending.clear()

    st = _drive(seed, 1000, commit)
    grouped.commit_many(pending)
    one.close()
    grouped.close()
    assert st.control["history"], "the workload ran no Controller round: the history part is not exercised"
    a, b = _loaded(str(tmp_path / "one.sqlite")), _loaded(str(tmp_path / "grouped.sqlite"))
    assert a == b
    # ... and both are the state the service held in memory (the reply cache stores JSON text in both).
    assert a == (st.epoch, st.lease_seq, st.shards, st.workers, st.control, st.snapshots, st.replies)


def test_a_control_state_stored_whole_by_an_earlier_version_still_loads(tmp_path):
    path = str(tmp_path / "old.sqlite")
    store = SQLiteStore(path)
    store.load_or_create(JOB, MCFG, CCFG, lease_grace_s=0.0, now=0.0)
    st = _drive(4, 300, lambda s, d, now: store.commit(d))
    store.close()
    conn = sqlite3.connect(path)
    with conn:  # what the earlier version wrote: the whole control state in one meta row, no parts
        conn.execute("UPDATE meta SET value=? WHERE key='control'", (json.dumps(st.control),))
        conn.execute("DELETE FROM monitor")
        conn.execute("DELETE FROM history")
    conn.close()
    assert _loaded(path)[4] == st.control
    assert _loaded(path)[4] == st.control  # loaded again from the parts the first load wrote


def test_a_failed_group_commit_fails_its_requests_and_rolls_the_state_back(tmp_path, monkeypatch):
    svc = ShardingService(ServeConfig(db=str(tmp_path / "s.sqlite")),
                          JobConfig(dataset_size=64, shard_size=8, world_size=1, global_batch_size=4)).start()
    try:
        client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=10))
        client.register()
        s = client.lease()["shard"]
        item = {"epoch": s["epoch"], "shard_id": s["shard_id"], "token": s["token"], "offset": 4}
        before = client.status()
        real = svc.store.commit_many

        def broken(decisions):
            monkeypatch.setattr(svc.store, "commit_many", real)  # fail once
            raise sqlite3.OperationalError("disk I/O error (injected)")

        monkeypatch.setattr(svc.store, "commit_many", broken)
        with pytest.raises(ServiceError, match="injected"):
            client.ack([item])
        for _ in range(200):  # the service reloads its state from the file, then accepts requests again
            try:
                after = client.status()
                break
            except ServiceError as e:
                assert "reloading" in str(e)
        else:
            pytest.fail("the service did not come back after a failed commit")
        assert after["acked_samples"] == before["acked_samples"] == 0  # the failed ack is not in the state
        client.ack([item])  # the retry is accepted: nothing of the failed attempt remains
        assert client.status()["acked_samples"] == 4
    finally:
        svc.stop()


def test_a_group_commit_reply_waits_for_its_transaction(tmp_path, monkeypatch):
    svc = ShardingService(ServeConfig(db=str(tmp_path / "s.sqlite")),
                          JobConfig(dataset_size=64, shard_size=8, world_size=1, global_batch_size=4)).start()
    release = threading.Event()
    try:
        client = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=10))
        client.register()
        entered, real = threading.Event(), svc.store.commit_many

        def held_back(decisions):
            entered.set()
            assert release.wait(timeout=60)
            return real(decisions)

        monkeypatch.setattr(svc.store, "commit_many", held_back)
        got: list[dict] = []
        t = threading.Thread(target=lambda: got.append(client.lease()), daemon=True)
        t.start()
        assert entered.wait(timeout=60)
        t.join(timeout=0.5)  # a bounded look: no reply may leave while its transaction is held back
        assert t.is_alive() and not got
        release.set()
        t.join(timeout=60)
        assert got and got[0]["status"] == "shard"
    finally:
        release.set()
        svc.stop()


def _split_by_scans(total: int, rates: list[float], min_batch: int = 1) -> list[int]:
    """`proportional_split` as it was written first, with a scan over the ranks per step: the oracle of the heap
    version (same results, ties included)."""
    world = len(rates)
    s = sum(rates)
    raw = [total * r / s for r in rates]
    b = [max(min_batch, int(math.floor(x))) for x in raw]
    while sum(b) < total:
        i = max(range(world), key=lambda j: raw[j] - b[j])
        b[i] += 1
    while sum(b) > total:
        i = max((j for j in range(world) if b[j] > min_batch), key=lambda j: b[j] - raw[j])
        b[i] -= 1
    for _ in range(total):
        t = [b[j] / rates[j] for j in range(world)]
        i = max(range(world), key=lambda j: t[j])
        j = min((k for k in range(world) if k != i), key=lambda k: (b[k] + 1) / rates[k], default=None)
        if j is None or b[i] <= min_batch or (b[j] + 1) / rates[j] >= t[i]:
            break
        b[i] -= 1
        b[j] += 1
    return b


def test_proportional_split_equals_the_scan_it_replaced():
    rng = random.Random(0)
    for _ in range(3000):
        world, min_batch = rng.randint(1, 24), rng.randint(1, 3)
        total = world * min_batch + rng.randint(0, 80)
        kind = rng.random()
        if kind < 0.3:  # many ties
            rates = [float(rng.randint(1, 4)) for _ in range(world)]
        elif kind < 0.5:
            rates = [rng.choice([231.0, 80.0, 100.0, 300.0]) for _ in range(world)]
        else:
            rates = [rng.lognormvariate(0, 1) for _ in range(world)]
        assert proportional_split(total, rates, min_batch) == _split_by_scans(total, rates, min_batch), (
            total, rates, min_batch)
