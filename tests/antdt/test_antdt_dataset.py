"""ServiceIterableDataset with independent (non-synchronous) consumers: exactly once, and no end-of-data deadlock."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from antdt_callbacks import AgentConfig, JobConfig, ServeConfig, ServiceIterableDataset, ShardingService


def _data(n: int) -> list[dict]:
    return [{"x": torch.tensor([float(i)]), "sample_id": torch.tensor(i)} for i in range(n)]


def test_independent_consumers_holding_short_tails_do_not_wait_on_each_other(tmp_path):
    # Four shards of 5, batches of 4, one shard leased ahead per rank: after two batches each rank holds a tail
    # shorter than a batch and the service says WAIT to both (the other still holds a lease). Waiting for a full
    # batch deadlocked here (until stop_timeout_s); the tails must come out as short last batches.
    job = JobConfig(dataset_size=20, shard_size=5, world_size=2, global_batch_size=8)
    svc = ShardingService(ServeConfig(db=str(tmp_path / "state.sqlite")), job).start()
    try:
        cfg = AgentConfig(url=svc.url, prefetch_batches=1, prefetch_shards=1, stop_timeout_s=5.0)
        data = _data(20)
        dss = [ServiceIterableDataset(data, cfg, rank=r, world_size=2, sync=False) for r in range(2)]
        its = [iter(ds) for ds in dss]
        sizes: list[list[int]] = [[], []]
        seen: Counter[int] = Counter()
        live = [0, 1]
        while live:  # one thread, alternating: a deadlock shows as the stop_timeout_s error, not a hang
            for r in list(live):
                batch = next(its[r], None)
                if batch is None:
                    live.remove(r)
                    continue
                meta = batch["antdt_meta"]
                seen.update(int(i) for i in batch["sample_id"])
                sizes[r].append(len(meta.sample_ids))
                dss[r].ack(meta, {"step": len(sizes[r]), "samples": len(meta.sample_ids), "compute_s": 0.001})
        for ds in dss:
            ds.close()
    finally:
        svc.stop()
    assert sorted(seen) == list(range(20)) and set(seen.values()) == {1}
    for got in sizes:  # full batches, then at most one short one at the end of the data
        assert all(n == 4 for n in got[:-1]) and 0 < got[-1] <= 4, sizes
    assert any(got[-1] < 4 for got in sizes), sizes


@pytest.mark.parametrize("config, device", [("cpu:gloo,cuda:gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                            ("cuda:nccl", "cuda:1")])
def test_stop_together_counts_travel_on_a_device_the_backend_carries(monkeypatch, config, device):
    """gloo (alone or paired with NCCL) carries CPU tensors; NCCL alone, as `transformers.Trainer` sets it up on GPUs,
    needs them on the rank's GPU."""
    import torch.distributed as dist

    from antdt_callbacks.dataset import _control_device

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # no GPU here: the rank's current device
    assert _control_device() == torch.device(device)
