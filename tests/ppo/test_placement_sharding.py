"""ZeRO-3-style sharding (`hf_placement.ShardedModule`) and the sharded All-colocated PPO executor.

Checked against the unsharded computation: the same forward outputs, gradients equal to the data-parallel average,
and PPO under ``PlacementPlan.colocated(2, sharded=True)`` ending with the parameters of the unsharded colocated run
(fp32 tolerance), while holding fewer model-state bytes per rank and paying parameter all-gathers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_placement.testing import run_distributed

pytestmark = pytest.mark.distributed


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _module_run(rank: int, world_size: int):
    import torch.distributed as dist

    from hf_placement import ShardedModule, resident_bytes

    torch.set_num_threads(1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    ref = _mlp()
    ref_out = ref(x)
    ref_out.square().sum().backward()
    ref_grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    dist.all_reduce(ref_grad)
    ref_grad /= world_size

    model = _mlp()
    full_bytes = resident_bytes([model])
    unit = ShardedModule(model, trainable=True, timeout_s=60)
    held = resident_bytes([model], extra=[unit.shard])
    out = model(x)
    released_after_forward = not unit.is_gathered
    out.square().sum().backward()  # re-gathers before backward
    unit.reduce_gradients()
    with unit.gathered():
        full = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = rank * unit.chunk, min((rank + 1) * unit.chunk, unit.numel)
    return {"out": (out - ref_out).abs().max().item(), "released": released_after_forward,
            "grad": (unit.shard.grad[: hi - lo] - ref_grad[lo:hi]).abs().max().item(),
            "weights": (full - torch.cat([p.detach().reshape(-1) for p in ref.parameters()])).abs().max().item(),
            "gathers": unit.gathers, "full_bytes": full_bytes, "held_bytes": held}


def test_sharded_module_matches_unsharded_two_ranks():
    for res in run_distributed(_module_run, 2, timeout=120):
        assert res["out"] == 0.0 and res["weights"] == 0.0
        assert res["grad"] < 1e-6
        assert res["released"]
        assert res["gathers"] == 3  # forward, backward, the explicit gathered() block
        assert res["held_bytes"] <= res["full_bytes"] // 2 + 64


def _ppo_run(rank: int, world_size: int, output_dir: str):
    from test_placement_ppo_equivalence import _build

    from hf_placement import PlacementPlan, resident_bytes

    torch.set_num_threads(1)
    out = {}
    for name, plan in (("colocated", "colocated"), ("sharded", PlacementPlan.colocated(world_size, sharded=True))):
        trainer = _build(f"{output_dir}/{name}", plan, iterations=2)
        trainer.train()
        held = resident_bytes([trainer.model.policy, trainer.model.value_model, trainer.ref_model,
                               trainer.reward_model], trainer.optimizer)
        with trainer.full_weights():  # clone first: .numpy() would pin the storage that release() frees
            params = {k: v.detach().clone().numpy() for k, v in trainer.model.state_dict().items()}
        out[name] = {"params": params, "held": held, "gathered": trainer.executor.bytes_gathered(),
                     "phases": sorted({e.phase for e in trainer.timeline.events})}
    return out


@pytest.mark.slow
def test_sharded_colocated_ppo_matches_unsharded_two_ranks(tmp_path):
    results = run_distributed(_ppo_run, 2, str(tmp_path), timeout=280)
    base = results[0]["colocated"]["params"]
    for r in range(2):
        sharded = results[r]["sharded"]
        for key in base:
            np.testing.assert_allclose(sharded["params"][key], base[key], rtol=1e-4, atol=2e-5, err_msg=key)
        assert sharded["held"] < 0.6 * results[r]["colocated"]["held"]
        assert sharded["gathered"] > 0 and results[r]["colocated"]["gathered"] == 0
        assert "reduce_scatter" in sharded["phases"]
