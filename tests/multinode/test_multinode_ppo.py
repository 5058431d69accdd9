"""PPO and LightTEA under real two-node launches on the emulated cluster (network namespaces, root).

PPO: the TRL-order worker of the engine tests (``tests/ppo/accelerate_ppo_worker.py``, passed to the launcher as is)
on 2 nodes x 2 ranks, one launcher agent per node (``torchrun --nnodes 2 --rdzv-backend c10d`` with the rendezvous
on node 0, or ``accelerate launch --num_machines 2 --machine_rank R`` with a per-machine config). Per device 2
sequences, no accumulation: global batch 8, the single-process reference's (``--grad-accum 4``). Every launch must
end within fp32 tolerance of the reference: weights (atol 1e-4) and the logged scores (atol 1e-5).

LightTEA: its single-process CLI is a control; run inside node 1's namespace (with the node's environment, as its
agent would get it) it writes the same metrics as run plainly.

Skipped with the reason where namespaces cannot be created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_placement.testing import AgentResult, MultiNodeCluster, skip_unless_available

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "ppo" / "accelerate_ppo_worker.py"
NPROC = 2  # ranks per node
WORLD = 2 * NPROC
PER_DEVICE = 2
GLOBAL_BATCH = 8
LAUNCH_TIMEOUT_S = 300.0
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "TOKENIZERS_PARALLELISM": "false"}
IIG_ROLES = dict.fromkeys(("actor", "critic", "ref", "reward"), "IIG")  # I partitions parameters: all four sharded


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launch variables (a stray PARO_* would change the engine)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PARO_", "ACCELERATE_", "FSDP_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    return {**env, "OMP_NUM_THREADS": "1", **ENV, **(extra or {})}


@pytest.fixture(scope="module")
def cluster():
    skip_unless_available()
    stray = sorted(k for k in os.environ if k.startswith(("PARO_", "ACCELERATE_", "FSDP_")))
    if stray:  # the agents inherit this environment (MultiNodeCluster.node_env): it would pick another engine
        pytest.fail(f"launch variables set in the test environment: {stray}")
    with MultiNodeCluster() as c:
        yield c
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in leftover for ns in c.namespaces), "namespaces left behind"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Tiny policy / value / reward models, saved where both namespaces see them (one filesystem)."""
    from trl_trainers.testing import char_tokenizer, tiny_causal_lm, tiny_value_model

    path = tmp_path_factory.mktemp("mn_ppo_models")
    n = len(char_tokenizer())
    tiny_causal_lm(n, 0).save_pretrained(path / "policy")
    tiny_value_model(n, 1).save_pretrained(path / "value")
    tiny_value_model(n, 2).save_pretrained(path / "reward")
    return path


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory) -> dict:
    """One plain process on the same global batch: 2 sequences per micro-batch, 4 micro-batches per step."""
    out = tmp_path_factory.mktemp("mn_ppo_single")
    accum = GLOBAL_BATCH // PER_DEVICE
    proc = subprocess.run([sys.executable, str(WORKER), "--models", str(models), "--out", str(out),
                           "--per-device", str(PER_DEVICE), "--grad-accum", str(accum)],
                          env=_clean_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return {"params": dict(np.load(out / "params.npz")), **json.loads((out / "rank0.json").read_text())}


def _worker_args(models: Path, out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    accum = GLOBAL_BATCH // (PER_DEVICE * WORLD)
    return ["--models", str(models), "--out", str(out), "--per-device", str(PER_DEVICE), "--grad-accum", str(accum),
            *extra]


def _rank_reports(agents: list[AgentResult], out: Path) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == sorted(f"rank{r}.json" for r in range(WORLD)), \
        [a.stderr[-3000:] for a in agents]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["rank"] for r in reports] == list(range(WORLD))
    return reports


def _assert_same_update(reference: dict, out: Path, reports: list[dict]) -> None:
    params = np.load(out / "params.npz")
    assert sorted(params.files) == sorted(reference["params"])
    for name, want in reference["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=1e-4, err_msg=name)
    logged = [r for r in reports if r["scores"]]  # a disaggregated inference rank logs no training metrics
    assert logged, "no rank logged scores"
    for report in logged:
        np.testing.assert_allclose(report["scores"], reference["scores"], rtol=0, atol=1e-5)


def _torchrun(cluster: MultiNodeCluster, models: Path, out: Path, env: dict[str, str],
              extra: tuple[str, ...] = ()) -> list[dict]:
    agents = cluster.torchrun(str(WORKER), _worker_args(models, out, extra), nproc_per_node=NPROC,
                              env={**ENV, **env}, timeout=LAUNCH_TIMEOUT_S)
    return _rank_reports(agents, out)


@pytest.mark.timeout(420)
def test_torchrun_ppo_paro_iig_colocated_on_node_local_groups(cluster, models, reference, tmp_path):
    """PARO_STRATEGY=IIG without a group size: the intra group is the launcher's LOCAL_WORLD_SIZE (one node)."""
    reports = _torchrun(cluster, models, tmp_path, {"PARO_STRATEGY": "IIG"})
    for r in reports:
        assert r["engine"] == "paro" and r["world"] == WORLD, r
        assert r["local_world_size"] == str(NPROC), r
        assert r["sharded_roles"] == IIG_ROLES, r
    _assert_same_update(reference, tmp_path, reports)


@pytest.mark.timeout(420)
def test_torchrun_ppo_paro_ggg_interleaved(cluster, models, reference, tmp_path):
    reports = _torchrun(cluster, models, tmp_path, {"PARO_STRATEGY": "GGG"}, ("--placement", "interleaved"))
    for r in reports:
        assert r["engine"] == "paro" and r["local_world_size"] == str(NPROC), r
        assert set(r["sharded_roles"].values()) == {"GGG"} and {"actor", "critic"} <= set(r["sharded_roles"]), r
    _assert_same_update(reference, tmp_path, reports)


@pytest.mark.timeout(420)
def test_torchrun_ppo_disaggregated_data_parallel(cluster, models, reference, tmp_path):
    """No PaRO config: plain data parallel on the training ranks, inference ranks on the other side of the plan."""
    reports = _torchrun(cluster, models, tmp_path, {}, ("--placement", "disaggregated"))
    for r in reports:
        assert r["engine"] == "replicated" and r["sharded_roles"] == {}, r
    assert 0 < sum(bool(r["scores"]) for r in reports) < WORLD, reports  # some ranks train, the others generate
    _assert_same_update(reference, tmp_path, reports)


@pytest.mark.timeout(420)
def test_accelerate_launch_ppo_paro_iig_per_machine_config(cluster, models, reference, tmp_path):
    """accelerate launch --num_machines 2 --machine_rank R, a per-machine config, the PaRO config file beside it
    (no group size: LOCAL_WORLD_SIZE, which accelerate sets from num_processes / num_machines)."""
    paro = tmp_path / "paro.yaml"
    paro.write_text("strategy: IIG\n")
    out = tmp_path / "out"
    agents = cluster.accelerate(str(WORKER), _worker_args(models, out), nproc_per_node=NPROC,
                                env={**ENV, "PARO_CONFIG_FILE": str(paro)}, timeout=LAUNCH_TIMEOUT_S)
    reports = _rank_reports(agents, out)
    for r in reports:
        assert r["engine"] == "paro" and r["world"] == WORLD, r
        assert r["local_world_size"] == str(NPROC) and r["sharded_roles"] == IIG_ROLES, r
    _assert_same_update(reference, out, reports)


# -- LightTEA: a single-process CLI as the control ------------------------------------------------------------------
MEASURED_KEYS = ("wall_s", "load_s", "timings_s", "seconds", "peak_rss_gb")  # time and memory of the run


def _tea_metrics(path: Path) -> dict:
    """metrics.json without what it measures of the run (times, peak RSS): the rest is deterministic."""
    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in MEASURED_KEYS}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    return strip(json.loads(path.read_text()))


@pytest.mark.timeout(240)
def test_lighttea_cli_in_a_node_namespace_equals_plain_run(cluster, tmp_path):
    from tea_pipeline import make_synthetic_pair

    data = make_synthetic_pair(num_entities=200, seed=2).save_text(tmp_path / "synthetic")
    outputs = {}
    for where in ("plain", "node1"):
        out = tmp_path / where
        argv = [sys.executable, "-m", "tea_pipeline", "align", "--data", str(data), "--seeds", "40", "--output",
                str(out), "--device", "cpu", "--dim", "64", "--top-k", "20", "--rounds", "2", "--threads", "1",
                "--no-progress", "--cache-dir", str(tmp_path / f"cache_{where}")]
        if where == "plain":
            env = _clean_env()
        else:  # as node 1's launcher agent runs it: in its namespace, with its environment
            argv = ["ip", "netns", "exec", cluster.namespaces[1], *argv]
            env = cluster.node_env(1, ENV)
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert proc.returncode == 0, f"{where}: {proc.stderr[-3000:]}"
        outputs[where] = out
    plain, node = (_tea_metrics(outputs[w] / "metrics.json") for w in ("plain", "node1"))
    assert plain["final"]["hits@1"] > 0.5, plain["final"]
    assert node == plain
    assert (outputs["node1"] / "alignment.tsv").read_text() == (outputs["plain"] / "alignment.tsv").read_text()
