"""hf_placement runtime on 2 and 4 gloo ranks: role groups, typed channels, owner dispatch (ref || reward), weight
sync (broadcast, bucketed p2p, LoRA-only), timeline export, and a stalled peer.

All checks of one world size run in one `run_distributed` call (each spawn costs seconds); every rank returns a dict
of named booleans / values and the test asserts on all of them.
"""

from __future__ import annotations

import json
import struct
import time

import pytest
import torch
import torch.distributed as dist

from hf_placement import PlacementPlan, build_role_groups
from hf_placement.runtime import (
    Channel,
    ChannelError,
    ChannelTimeoutError,
    RoleCall,
    RoleHandle,
    Timeline,
    WeightSync,
    WeightSyncError,
    gather_timelines,
    plot_timeline,
    run_concurrently,
    select_tensors,
    summarize_timelines,
    write_chrome_trace,
)

pytestmark = pytest.mark.distributed


# ------------------------------------------------------------------------------------------------ helpers (all ranks)
def _message(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "mask": torch.rand(2, 3, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "nested": [torch.arange(4, dtype=torch.int32), (torch.ones(1, dtype=torch.float16), 7, "tag", None)],
    }


def _trees_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_trees_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_trees_equal(x, y) for x, y in zip(a, b))
    return a == b


def _frozen_model(seed: int, out: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, out)).eval()


def _batch(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {"x": torch.randn(rank + 1, 8, generator=g), "ids": torch.arange(rank + 1)}


def _trainer_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


class _LoraLinear(torch.nn.Module):
    """A LoRA-adapted linear layer with PEFT's parameter names (``base_layer``, ``lora_A.default``, ...); the real
    PEFT model is checked in test_placement_plan.py (importing peft in every spawned rank costs seconds)."""

    def __init__(self, base: torch.nn.Linear, r: int = 2):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def _lora_model(seed: int) -> torch.nn.Module:
    base = _trainer_model(0)  # same frozen base everywhere
    torch.manual_seed(seed)  # different adapter init per seed
    base[0], base[2] = _LoraLinear(base[0]), _LoraLinear(base[2])
    for name, p in base.named_parameters():
        p.requires_grad_("lora_" in name)  # like PEFT: only adapters train
    return base


def _state_equal(a: torch.nn.Module, b: torch.nn.Module, names=None) -> bool:
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    names = names if names is not None else list(sa)
    return all(torch.equal(sa[n], sb[n]) for n in names)


# ------------------------------------------------------------------------------------------------------- rank main
def _runtime_checks(rank: int, world: int, out_dir: str) -> dict:
    checks: dict = {}
    tl = Timeline(rank)

    # --- plans and groups (collective, same order on every rank)
    inter = PlacementPlan.interleaved(world)
    owner_pairs = [[r, r + world // 2] for r in range(world // 2)]  # (ref owner, reward owner) pairs
    with tl.phase("groups"):
        groups = build_role_groups(inter, timeout_s=60, extra_rank_sets=owner_pairs)
        dis = PlacementPlan.disaggregated(world)
        dgroups = build_role_groups(dis, timeout_s=60)
    checks["groups_created_once"] = build_role_groups(inter, timeout_s=60, extra_rank_sets=owner_pairs) is groups
    ref_group = groups.group("ref")
    checks["ref_group_membership"] = (ref_group is not None) == (rank in inter.roles["ref"])
    if ref_group is not None:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=ref_group)
        checks["ref_group_all_reduce"] = t.item() == float(sum(inter.roles["ref"]))
    checks["world_group_size"] = dist.get_world_size(groups.group("actor")) == world

    # --- typed channels: even rank -> odd rank and back
    peer = rank ^ 1
    ch = Channel(peer, f"test:typed:{min(rank, peer)}-{max(rank, peer)}", timeout_s=60)
    with tl.phase("channel") as info:
        if rank % 2 == 0:
            ch.send(_message(rank))
            reply = ch.recv(expect=[("torch.float32", (2, 2))])
            checks["channel_reply"] = torch.equal(reply, torch.full((2, 2), float(peer)))
        else:
            got = ch.recv()
            checks["channel_roundtrip"] = _trees_equal(got, _message(peer))
            ch.send(torch.full((2, 2), float(rank)))
        info["bytes"] = ch.bytes_sent + ch.bytes_received

    # --- pipelining: the producer runs up to 2 messages ahead (bounded); order and contents are preserved
    pipe = Channel(peer, f"test:pipe:{min(rank, peer)}-{max(rank, peer)}", timeout_s=60, max_in_flight=2)
    if rank % 2 == 0:
        for i in range(4):
            pipe.send({"step": i, "x": torch.full((i + 1,), float(i))}, wait=False)
            checks["pipe_pending_bounded"] = checks.get("pipe_pending_bounded", True) and len(pipe._pending) <= 2
        pipe.flush()
    else:
        got = [pipe.recv() for _ in range(4)]
        checks["pipe_in_order"] = all(m["step"] == i and torch.equal(m["x"], torch.full((i + 1,), float(i)))
                                      for i, m in enumerate(got))

    # --- owner dispatch: ref on the first half, reward on the second, running concurrently
    ref_model, reward_model = _frozen_model(1, 3), _frozen_model(2, 1)
    pair_group = groups.group_for_ranks(next(p for p in owner_pairs if rank in p))

    def ref_fn(batch):
        # The owner pair meets in an all-reduce inside every call: this only completes if the ref owner and the
        # reward owner compute at the same time, i.e. the two roles really run concurrently.
        t = torch.ones(1)
        dist.all_reduce(t, group=pair_group)
        return {"logprobs": torch.log_softmax(ref_model(batch["x"]), -1), "ids": batch["ids"] * 2}

    def reward_fn(batch):
        t = torch.ones(1)
        dist.all_reduce(t, group=pair_group)
        return reward_model(batch["x"]).squeeze(-1)

    ref_h = RoleHandle(inter, "ref", timeout_s=60, timeline=tl)
    rw_h = RoleHandle(inter, "reward", timeout_s=60, timeline=tl)
    batch = _batch(rank)
    ref_out, rw_out = run_concurrently([RoleCall(ref_h, ref_fn, batch), RoleCall(rw_h, reward_fn, batch)])
    with torch.no_grad():
        local_ref = {"logprobs": torch.log_softmax(ref_model(batch["x"]), -1), "ids": batch["ids"] * 2}
        local_rw = reward_model(batch["x"]).squeeze(-1)
    checks["dispatch_ref_equal"] = _trees_equal(ref_out, local_ref)
    checks["dispatch_reward_equal"] = _trees_equal(rw_out, local_rw)
    checks["dispatch_owner"] = {"ref": ref_h.owner, "reward": rw_h.owner}
    checks["dispatch_bytes"] = ref_h.bytes_sent + rw_h.bytes_sent

    # many partners on one owner, concat mode: reward owned by the last rank only, every rank a data rank
    custom = PlacementPlan.custom(world, {"actor": list(range(world)), "critic": list(range(world)),
                                          "ref": list(range(world - 1)) or [0], "reward": [world - 1]}) \
        if world > 2 else PlacementPlan.custom(world, {"actor": [0, 1], "critic": [0, 1], "ref": [0], "reward": [1]})
    for concat in (False, True):
        h = RoleHandle(custom, "reward", data_ranks=list(range(world)), timeout_s=60, concat=concat)
        out = h.call(lambda b: reward_model(b["x"]).squeeze(-1), batch)
        same = torch.equal(out, local_rw) if not concat else torch.allclose(out, local_rw, atol=1e-6)
        checks[f"dispatch_one_owner_concat={concat}"] = same

    # --- weight sync: trainer (actor ranks) -> shadow (rollout ranks) of the disaggregated plan
    src, dsts = min(dis.roles["actor"]), dis.roles["rollout"]
    expected = _trainer_model(0)
    if rank == src:
        model = _trainer_model(0)
    else:
        model = _trainer_model(10 + rank)  # different weights before the first sync
    for version, strategy, bucket in ((1, "broadcast", 100 << 20), (2, "broadcast", 600), (3, "bucketed_p2p", 600)):
        _perturb(expected, version)
        if rank == src:
            _perturb(model, version)
        ws = WeightSync(model, src, dsts, strategy=strategy, group=dgroups.sync_group("rollout"),
                        bucket_bytes=bucket, timeout_s=60, timeline=tl)
        ws.version = version - 1 if version > 1 else None
        stats = ws.sync(version=version if rank == src else None)
        if rank in dsts:
            checks[f"sync_{strategy}_{bucket}_bitexact"] = _state_equal(model, expected)
            checks[f"sync_{strategy}_{bucket}_version"] = stats.version == version
        if stats is not None:
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            checks[f"sync_{strategy}_{bucket}_bytes"] = stats.payload_bytes == total
            checks[f"sync_{strategy}_{bucket}_buckets"] = stats.num_buckets
        else:
            checks[f"sync_{strategy}_{bucket}_idle"] = rank not in [src, *dsts]

    # stale version refused by the source before anything is sent; wrong expected version rejected by the receiver
    ws = WeightSync(model, src, dsts, strategy="bucketed_p2p", timeout_s=60)
    if rank == src:
        ws.sync(version=5)
        try:
            ws.sync(version=5)
            checks["stale_version_refused"] = False
        except WeightSyncError as exc:
            checks["stale_version_refused"] = "not newer" in str(exc)
        _perturb(model, 99)
        ws.sync(version=6)  # receivers expect 7: they drain the payload and reject it
    elif rank in dsts:
        ws.sync()
        before = [p.clone() for p in model.parameters()]
        try:
            ws.sync(version=7)
            checks["wrong_version_rejected"] = False
        except WeightSyncError as exc:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            checks["wrong_version_rejected"] = "expected weight version 7" in str(exc) and unchanged

    # LoRA: only adapters travel; the shadow's frozen base is not touched
    lora = _lora_model(seed=0 if rank == src else 50 + rank)
    if rank == src:
        with torch.no_grad():
            for n, p in lora.named_parameters():
                p.add_(0.5 if "lora_" in n else 0.0)
    lora_names = [n for n, _ in select_tensors(lora, "lora")]
    base_before = {n: p.clone() for n, p in lora.named_parameters() if "lora_" not in n}
    for strategy in ("broadcast", "bucketed_p2p"):
        ws = WeightSync(lora, src, dsts, strategy=strategy, group=dgroups.sync_group("rollout"), param_filter="lora",
                        bucket_bytes=256, timeout_s=60)
        stats = ws.sync(version=1 if rank == src else None)
        if stats is not None:
            lora_bytes = sum(p.numel() * p.element_size() for n, p in lora.named_parameters() if "lora_" in n)
            checks[f"lora_{strategy}_bytes"] = stats.payload_bytes == lora_bytes and stats.num_tensors == len(
                lora_names)
        if rank in dsts:
            ref_lora = _lora_model(seed=0)
            with torch.no_grad():
                for n, p in ref_lora.named_parameters():
                    p.add_(0.5 if "lora_" in n else 0.0)
            checks[f"lora_{strategy}_adapters_equal"] = _state_equal(lora, ref_lora, lora_names)
            checks[f"lora_{strategy}_base_untouched"] = all(
                torch.equal(p, base_before[n]) for n, p in lora.named_parameters() if "lora_" not in n)
    checks["trainable_filter_is_lora"] = [n for n, _ in select_tensors(lora, "trainable")] == lora_names

    # --- timeline: gather everywhere, rank 0 writes the trace and the picture
    timelines = gather_timelines(tl)
    checks["timeline_ranks"] = [t.rank for t in timelines]
    if rank == 0:
        write_chrome_trace(f"{out_dir}/trace.json", timelines)
        plot_timeline(timelines, f"{out_dir}/timeline.png")
        summary = summarize_timelines(timelines)
        checks["timeline_summary_ranks"] = sorted(summary["ranks"])
        checks["timeline_summary"] = summary
        checks["timeline_phases"] = sorted(summary["phases"])

    # --- a stalled peer: rank 1 never sends; rank 0's receive fails within its timeout, naming rank 1
    dist.barrier(group=groups.group("actor"))
    if rank == 0:
        stall = Channel(1, "test:stall", timeout_s=2.0)
        start = time.monotonic()
        try:
            stall.recv()
            checks["stall"] = None
        except ChannelTimeoutError as exc:
            checks["stall"] = {"peer": exc.peer, "channel": exc.channel, "message": str(exc),
                               "elapsed": time.monotonic() - start}
    elif rank == 1:
        time.sleep(4.0)
    # --- a peer that is gone: rank 3 leaves the job; rank 2's receive fails naming rank 3 instead of hanging
    if world >= 4 and rank == 2:
        gone = Channel(3, "test:gone", timeout_s=30.0)
        try:
            gone.recv()
            checks["gone"] = None
        except ChannelError as exc:
            checks["gone"] = {"peer": exc.peer, "message": str(exc)}
    return checks


def _assert_runtime(results: list[dict], world: int, out_dir) -> None:
    for rank, checks in enumerate(results):
        for key, value in checks.items():
            if isinstance(value, bool):
                assert value, f"rank {rank}: check {key} failed"
    ref_owner = {r: (r if r < world // 2 else r - world // 2) for r in range(world)}
    rw_owner = {r: (r if r >= world // 2 else r + world // 2) for r in range(world)}
    for rank, checks in enumerate(results):
        assert checks["dispatch_owner"] == {"ref": ref_owner[rank], "reward": rw_owner[rank]}
        assert checks["dispatch_bytes"] > 0  # everyone is a non-owner of one role
        assert checks["timeline_ranks"] == list(range(world))
    dis = PlacementPlan.disaggregated(world)
    for rank in dis.roles["rollout"]:
        assert results[rank]["sync_broadcast_600_buckets"] > 1  # 600-byte buckets: the model needs several
        assert results[rank]["sync_bucketed_p2p_600_buckets"] > 1
        assert results[rank]["sync_broadcast_104857600_buckets"] == 1
        assert results[rank]["wrong_version_rejected"] is True
        assert results[rank]["lora_bucketed_p2p_adapters_equal"] is True
    src = min(dis.roles["actor"])
    assert results[src]["stale_version_refused"] is True
    # the Chrome trace is valid trace-event JSON with one process per rank; the PNG exists
    trace = json.loads((out_dir / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events and all({"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0 for e in events)
    assert {e["pid"] for e in events} == set(range(world))
    assert {"sync", "ref", "reward", "channel"} <= {e["name"] for e in events}
    png = (out_dir / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 100 and height > 100
    assert set(results[0]["timeline_phases"]) >= {"sync", "ref", "reward", "dispatch:ref", "dispatch:reward",
                                                   "wait:ref", "wait:reward", "wait:sync"}
    summary = results[0]["timeline_summary"]
    for info in summary["ranks"].values():
        assert info["busy_s"] + info["idle_s"] == pytest.approx(summary["span_s"])
        assert 0 <= info["wait_s"] <= info["idle_s"] + 1e-9
    stall = results[0]["stall"]
    assert stall is not None and stall["peer"] == 1 and stall["channel"] == "test:stall"
    assert "peer rank 1" in stall["message"] and "'test:stall'" in stall["message"]
    assert stall["elapsed"] < 30  # bounded by the 2 s channel timeout, not by the harness timeout
    if world >= 4:
        gone = results[2]["gone"]
        assert gone is not None and gone["peer"] == 3 and "peer rank 3" in gone["message"]


def test_runtime_two_ranks(tmp_path):
    results = run_distributed_checked(2, tmp_path)
    _assert_runtime(results, 2, tmp_path)


@pytest.mark.slow
def test_runtime_four_ranks(tmp_path):
    results = run_distributed_checked(4, tmp_path)
    _assert_runtime(results, 4, tmp_path)


def run_distributed_checked(world: int, out_dir) -> list[dict]:
    from hf_placement import run_distributed

    return run_distributed(_runtime_checks, world, str(out_dir), timeout=240, collective_timeout=120)


@pytest.mark.parametrize("config, device", [("cpu:gloo,cuda:gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"),
                                            ("cuda:nccl", "cuda:1")])
def test_channel_wire_buffers_default_to_the_device_the_backend_carries(monkeypatch, config, device):
    """NCCL alone carries only GPU tensors: a channel left on CPU buffers there would fail at its first send."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # no GPU here: the rank's current device
    assert Channel(1, "experience").device == torch.device(device)
    assert Channel(1, "experience", device="cpu").device == torch.device("cpu")


def _over_a_wire_group(rank: int, world: int) -> dict:
    """The role channels and a bucketed weight sync over `RoleGroups.wire_group`, built as it is where the world's
    backend carries no CPU tensors (NCCL alone; here the backend's answer is replaced, the world stays gloo)."""
    import hf_placement.groups as groups_module

    real = build_role_groups(PlacementPlan.interleaved(world), timeout_s=61)
    out: dict = {"gloo_world_has_no_wire": real.wire_group is None}
    groups_module.backend_device_types = lambda group=None: ("cuda",)
    inter = PlacementPlan.interleaved(world)
    groups = build_role_groups(inter, timeout_s=60)
    wire = groups.wire_group
    out["wire_is_gloo_world"] = wire is not None and dist.get_backend(wire) == "gloo" \
        and dist.get_world_size(wire) == world
    ref_model, reward_model = _frozen_model(1, 3), _frozen_model(2, 1)
    ref_h = RoleHandle(inter, "ref", timeout_s=60, group=wire)
    rw_h = RoleHandle(inter, "reward", timeout_s=60, group=wire)
    batch = _batch(rank)
    ref_out, rw_out = run_concurrently([
        RoleCall(ref_h, lambda b: torch.log_softmax(ref_model(b["x"]), -1), batch),
        RoleCall(rw_h, lambda b: reward_model(b["x"]).squeeze(-1), batch)])
    with torch.no_grad():
        out["dispatch_equal"] = torch.equal(ref_out, torch.log_softmax(ref_model(batch["x"]), -1)) and \
            torch.equal(rw_out, reward_model(batch["x"]).squeeze(-1))
    channels = [*ref_h._channels.values(), *rw_h._channels.values()]
    out["channels_on_wire"] = bool(channels) and all(c.group is wire and c.device.type == "cpu" for c in channels)
    dis = PlacementPlan.disaggregated(world)
    src, dst = min(dis.roles["actor"]), dis.roles["rollout"]
    model = _trainer_model(0)
    if rank != src:
        _perturb(model, rank)
    sync = WeightSync(model, src, dst, strategy="bucketed_p2p", group=wire, bucket_bytes=600, timeout_s=60)
    if sync.participates:
        sync.sync(version=1)
    out["sync_equal"] = _state_equal(model, _trainer_model(0)) if rank in [src, *dst] else True
    out["sync_on_wire"] = all(c.group is wire for c in sync._channels.values())
    return out


@pytest.mark.slow
def test_role_channels_and_p2p_sync_run_on_a_gloo_wire_group_where_the_world_has_no_cpu_transport():
    from hf_placement import run_distributed

    for rank, out in enumerate(run_distributed(_over_a_wire_group, 4, timeout=240, collective_timeout=120)):
        assert all(out.values()), (rank, out)
