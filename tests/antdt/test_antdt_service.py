"""The service over HTTP: security refusals, and durability across a SIGKILL of the service process."""

from __future__ import annotations

import http.client
import json
import threading
from collections import Counter

import pytest

from antdt_callbacks import (
    AgentConfig,
    JobConfig,
    ServeConfig,
    ShardingClient,
    ShardingService,
    StaleIncarnationError,
    UnauthorizedError,
    UnknownWorkerError,
    launch_service,
)
from antdt_callbacks._state import shard_sample_ids


@pytest.fixture()
def service(tmp_path):
    svc = ShardingService(ServeConfig(db=str(tmp_path / "s.sqlite"), token="s3cret", max_request_bytes=4096),
                          JobConfig(dataset_size=64, shard_size=8, world_size=2, global_batch_size=4)).start()
    yield svc
    svc.stop()


def raw_post(svc, path: str, body: bytes, token: str | None = "s3cret") -> tuple[int, dict]:
    host, port = svc.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_non_loopback_bind_requires_a_token(monkeypatch):
    monkeypatch.delenv("ANTDT_TOKEN", raising=False)
    with pytest.raises(ValueError, match="not a loopback address"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", token="x")  # accepted with a token


def test_refusals_carry_a_reason_and_change_nothing(service):
    good = ShardingClient(service.url, rank=0, config=AgentConfig(url=service.url, token="s3cret"))
    good.register()
    before = good.status()
    cases = [
        (b'{"rank": 0, "incarnation": 0, "request_id": "x"}', "/v1/lease", None, 401, "unauthorized"),
        (b'{"rank": 0, "incarnation": 0, "request_id": "x"}', "/v1/lease", "wrong", 401, "unauthorized"),
        (b"{not json", "/v1/lease", "s3cret", 400, "bad_request"),
        (b"[1, 2]", "/v1/ack", "s3cret", 400, "bad_request"),
        (b'{"rank": 0, "incarnation": 0, "items": "x"}', "/v1/ack", "s3cret", 400, "bad_request"),
        (b'{"rank": 1, "incarnation": 0, "request_id": "x"}', "/v1/lease", "s3cret", 403, "unknown_worker"),
        (b'{"rank": 9, "incarnation": 0}', "/v1/register", "s3cret", 403, "unknown_worker"),
        (b'{"rank": 0, "incarnation": 0}', "/v1/nope", "s3cret", 400, "bad_request"),
        (json.dumps({"rank": 0, "incarnation": 0, "pad": "x" * 5000}).encode(), "/v1/ack", "s3cret", 413,
         "payload_too_large"),
    ]
    for body, path, token, status, code in cases:
        got_status, payload = raw_post(service, path, body, token)
        assert (got_status, payload["error"]) == (status, code), (path, body[:40], payload)
        assert payload["message"]
    assert good.status() == before
    with pytest.raises(UnauthorizedError):
        ShardingClient(service.url, rank=0, config=AgentConfig(url=service.url, token="bad")).status()
    stale = ShardingClient(service.url, rank=0, incarnation=0, config=AgentConfig(url=service.url, token="s3cret"))
    ShardingClient(service.url, rank=0, incarnation=1, config=AgentConfig(url=service.url, token="s3cret")).register()
    with pytest.raises(StaleIncarnationError):
        stale.lease()
    with pytest.raises(UnknownWorkerError):
        ShardingClient(service.url, rank=1, config=AgentConfig(url=service.url, token="s3cret")).lease()


def _consumer(client: ShardingClient, job: JobConfig, got: list, stop_after: int | None = None) -> None:
    client.register()
    for _ in range(10_000):  # bounded: 10k requests at most
        rep = client.lease()
        if rep["status"] == "end":
            return
        if rep["status"] == "wait":
            continue
        s = rep["shard"]
        ids = shard_sample_ids(job, s["epoch"], s["shard_id"], s["start"], s["end"])
        for off in range(s["offset"], s["end"] - s["start"], 4):  # ack in batches of 4
            stop = min(off + 4, s["end"] - s["start"])
            client.ack([{"epoch": s["epoch"], "shard_id": s["shard_id"], "token": s["token"], "offset": stop}])
            got.extend(ids[off:stop].tolist())


@pytest.mark.timeout(180)
def test_service_sigkill_and_restart_loses_and_duplicates_nothing(tmp_path):
    job = JobConfig(dataset_size=2000, shard_size=20, world_size=2, global_batch_size=8, num_epochs=1)
    svc = launch_service(tmp_path / "state.sqlite", job)
    try:
        cfg = AgentConfig(url=svc.url, retry_timeout_s=60)
        got: list[list[int]] = [[], []]
        threads = [threading.Thread(target=_consumer, args=(ShardingClient(svc.url, rank=r, config=cfg), job, got[r]))
                   for r in range(2)]
        for t in threads:
            t.start()
        probe = ShardingClient(svc.url, rank=0, config=AgentConfig(url=svc.url, retry_timeout_s=30))
        for _ in range(600):
            acked = probe.status()["acked_samples"]
            if acked >= 300:
                break
            threading.Event().wait(0.05)
        svc.kill()  # SIGKILL mid-epoch
        assert acked < job.dataset_size
        threading.Event().wait(1.0)
        svc.start()  # same port, same database
        for t in threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in threads)
        counts = Counter(got[0] + got[1])
        assert len(counts) == job.dataset_size and set(counts.values()) == {1}
        status = probe.status()
        assert status["counts"]["DONE"] == 100 and status["counts"]["DOING"] == 0
        assert min(len(got[0]), len(got[1])) > 0
    finally:
        svc.stop()
