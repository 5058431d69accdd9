"""The Agent's ack sender: acks queued by steps go out on the sender's own beat, merged into one request."""

from __future__ import annotations

import threading
import time

from antdt_callbacks import AgentConfig, AntDTAgent

PLAN = {"version": 0, "batch_sizes": [4, 4], "micro_batch": [None, None], "actions": {}}


class FakeClient:
    def __init__(self):
        self.calls: list[tuple[list[dict], object]] = []

    def ack(self, items, metrics=None, lease=None):
        self.calls.append((items, metrics))
        return {"ok": True, "plan": PLAN}


class FakeDataset:
    """The part of `ServiceIterableDataset` the sender uses."""

    rank = 0
    plan_version = 0
    batch_size = 4

    def __init__(self):
        self.client = FakeClient()
        self.acked: list[list[dict]] = []

    def lease_request(self):
        return None

    def accept_lease(self, reply):
        pass

    def mark_acked(self, items):
        self.acked.append(items)

    def apply_plan(self, plan, force=False):
        return False


def _item(shard: int, offset: int, token: int = 1) -> dict:
    return {"epoch": 0, "shard_id": shard, "token": token, "offset": offset}


def _agent(period: float) -> tuple[AntDTAgent, FakeDataset]:
    agent = AntDTAgent(AgentConfig(url="http://127.0.0.1:1", ack_period_s=period))
    agent.dataset = FakeDataset()
    agent._sender = threading.Thread(target=agent._send_loop, daemon=True)
    agent._sender.start()
    return agent, agent.dataset


def test_steps_between_beats_go_out_as_one_ack_with_the_last_offset_per_shard():
    agent, ds = _agent(period=30.0)  # no beat during the test: only flush sends
    agent._queue.put(([_item(3, 4)], {"step": 1, "samples": 4, "compute_s": 0.1}))
    agent._queue.put(([_item(3, 8), _item(5, 2)], {"step": 2, "samples": 6, "compute_s": 0.1}))
    agent._queue.put(([_item(5, 4)], None))
    time.sleep(0.05)
    assert ds.client.calls == []  # steps only queue; nothing is sent before the beat
    t0 = time.perf_counter()
    agent.flush()  # wakes the sender at once instead of at the next beat
    assert time.perf_counter() - t0 < 5
    (items, metrics), = ds.client.calls
    assert items == [_item(3, 8), _item(5, 4)]
    assert [m["step"] for m in metrics] == [1, 2]
    assert ds.acked == [items]
    agent._queue.put(None)
    agent._wake.set()
    agent._sender.join(timeout=5)
    assert not agent._sender.is_alive()


def test_the_beat_sends_without_a_flush_and_zero_period_sends_every_step():
    agent, ds = _agent(period=0.02)
    agent._queue.put(([_item(1, 2)], {"step": 1, "samples": 2, "compute_s": 0.1}))
    deadline = time.monotonic() + 5
    while not ds.client.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.client.calls == [([_item(1, 2)], {"step": 1, "samples": 2, "compute_s": 0.1})]

    agent, ds = _agent(period=0.0)
    for step in (1, 2):
        agent._queue.put(([_item(1, 2 * step)], None))
        agent._queue.join()
    assert [items for items, _ in ds.client.calls] == [[_item(1, 2)], [_item(1, 4)]]


def test_negative_period_is_refused():
    import pytest

    with pytest.raises(ValueError, match="ack_period_s=-1"):
        AgentConfig(url="http://127.0.0.1:1", ack_period_s=-1)


def test_sigterm_marks_the_rank_preempted_once_and_a_second_one_takes_the_default_action(monkeypatch):
    import os
    import signal

    class _DS:
        rank, preempted = 0, False

    agent = AntDTAgent(AgentConfig(url="http://127.0.0.1:1"))
    agent.dataset = _DS()
    before = signal.getsignal(signal.SIGTERM)
    agent._install_sigterm()
    try:
        assert signal.getsignal(signal.SIGTERM) == agent._on_sigterm
        os.kill(os.getpid(), signal.SIGTERM)  # handled: only the mark
        assert agent.dataset.preempted
        sent = []
        monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
        agent._on_sigterm(signal.SIGTERM, None)  # the second one: handler restored, the signal sent again
        assert sent == [(os.getpid(), signal.SIGTERM)] and signal.getsignal(signal.SIGTERM) == before
    finally:
        agent._restore_sigterm()
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_handling_can_be_switched_off():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    agent = AntDTAgent(AgentConfig(url="http://127.0.0.1:1", checkpoint_on_sigterm=False))
    agent._install_sigterm()
    assert signal.getsignal(signal.SIGTERM) == before
