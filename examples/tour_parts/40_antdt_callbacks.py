"""Tour part: the AntDT sharding service, a service-fed dataset, and the DD Controller reacting to a slow rank."""

from __future__ import annotations

import tempfile
import threading
from collections import Counter
from pathlib import Path

COMPONENT = "antdt_callbacks"
DESCRIPTION = "sharding service (SQLite, HTTP) feeding 2 consumers exactly once + DD re-split for a 3x slow rank"


def run() -> str:
    import torch

    from antdt_callbacks import AgentConfig, JobConfig, ServeConfig, ServiceIterableDataset, ShardingService

    data = [{"x": torch.tensor([float(i)]), "sample_id": torch.tensor(i)} for i in range(101)]
    with tempfile.TemporaryDirectory() as tmp:
        svc = ShardingService(ServeConfig(db=str(Path(tmp) / "state.sqlite")),
                              JobConfig(dataset_size=101, shard_size=16, world_size=2, global_batch_size=16)).start()
        try:
            seen: Counter[int] = Counter()
            # Two independent consumers on threads; rank 1 reports 3x the compute time per sample.
            dss = [ServiceIterableDataset(data, AgentConfig(url=svc.url), rank=r, world_size=2, sync=False)
                   for r in range(2)]

            def consume(r: int) -> None:
                for step, batch in enumerate(dss[r], start=1):
                    meta = batch["antdt_meta"]
                    seen.update(int(i) for i in batch["sample_id"])
                    dss[r].ack(meta, {"step": step, "samples": meta.local_samples,
                                      "compute_s": 0.001 * meta.local_samples * (3 if r == 1 else 1)})
                dss[r].close()

            threads = [threading.Thread(target=consume, args=(r,)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            stuck = [t.name for t in threads if t.is_alive()]
            if stuck:
                raise RuntimeError(f"AntDT tour: consumer threads {stuck} did not finish within 120 s")
            sizes = dss[0].client.plan()["plan"]["batch_sizes"]  # the Controller's current split
        finally:
            svc.stop()
    assert sorted(seen) == list(range(101)) and set(seen.values()) == {1}
    return f"101 samples consumed exactly once by 2 workers; DD plan for a 3x slower rank 1: batch sizes {sizes}"
