"""The PaRO guideline and cost model: the paper's numbers (paro.md §12-13) and picks (issue 4), strategies, config."""

from __future__ import annotations

import json

import pytest

from hf_placement.partition import VALID_STRATEGY_NAMES
from paro_zero_backend import GuidelineInputs, ParoConfig, advise, memory_bytes, parse_strategy, traffic
from paro_zero_backend.__main__ import main
from paro_zero_backend.cost_model import estimate_compute_time_s

GIB = 2**30
# The paper's cluster (§4.5): 4 nodes x 8 A100-80GB, NVLink 2000 Gbit/s, RoCE 80 Gbit/s per GPU, s = 10,
# sequence 512 x micro-batch 4; LLaMA-65B with activation checkpointing.
PAPER = {"world_size": 32, "group_size": 8, "bandwidth_intra_gbps": 2000, "bandwidth_inter_gbps": 80,
         "accumulation_steps": 10, "device_memory_gb": 80}
TOKENS = 512 * 4 * 10
# The paper reports every NN* strategy out of memory for LLaMA-7B (no activation checkpointing) although NNG's model
# states are 28.5 GiB: at least 49.4 GB of that run's memory was activations and buffers. This is that measured
# headroom, passed explicitly; the 65B runs use the default (10 % of memory).
WORKING_7B_GB = 50


def _paper(psi, fraction, working=None, checkpointing=False, compute=True):
    t_comp = estimate_compute_time_s(psi, psi * fraction, TOKENS, 312, 0.4, checkpointing) if compute else 0.0
    return advise(GuidelineInputs(num_params=psi, trainable_params=psi * fraction, working_memory_gb=working,
                                  compute_time_s=t_comp, **PAPER))


def test_fourteen_valid_strategies_and_invalid_ones_rejected():
    assert len(VALID_STRATEGY_NAMES) == 14
    for bad in ("GNI", "INN", "GGI", "NGI"):
        with pytest.raises(ValueError, match="must be partitioned at least as finely"):
            parse_strategy(bad)
    with pytest.raises(ValueError, match="three letters"):
        parse_strategy("ZeRO")
    with pytest.raises(ValueError, match="must be partitioned at least as finely"):
        ParoConfig(strategy="INN")


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="mixed_precision"):
        ParoConfig(mixed_precision="int8")
    with pytest.raises(ValueError, match="group_size=3 does not divide the world size 4"):
        ParoConfig(group_size=3).resolve_group_size(4)
    with pytest.raises(ValueError, match="max_grad_norm"):
        ParoConfig(max_grad_norm=0)
    assert ParoConfig(strategy="auto").strategy == "auto"
    assert ParoConfig(strategy="iig").strategy == "IIG"


def test_comm_times_reproduce_section_12():
    """7B full: NN* 0.36 s < NIG/NII 0.80 < ING/INI 1.29 < IIG/III 1.73 < NGG 1.98 < IGG 2.91 < GNG 3.79 < GIG 4.23
    < GGG 5.41 (comm-only times, paro.md §12)."""
    rows = {r.strategy: r for r in _paper(7e9, 1, compute=False).rows}
    want = {"NNG": 0.36, "NNI": 0.36, "NNN": 0.36, "NIG": 0.80, "NII": 0.80, "ING": 1.29, "INI": 1.29, "IIG": 1.73,
            "III": 1.73, "NGG": 1.98, "IGG": 2.91, "GNG": 3.79, "GIG": 4.23, "GGG": 5.41}
    for st, t in want.items():
        assert rows[st].t_comm_s == pytest.approx(t, abs=0.006), st
    assert rows["GGG"].t_comm_s / rows["IIG"].t_comm_s == pytest.approx(3.12, abs=0.01)
    mem = {st: memory_bytes(st, 7e9, 7e9, 32, 8)["total"] / GIB for st in ("NNG", "NIG", "IIG", "GGG")}
    assert mem == pytest.approx({"NNG": 28.5, "NIG": 17.1, "IIG": 5.7, "GGG": 3.3}, abs=0.06)


def test_paper_pick_7b_full_training():
    table = _paper(7e9, 1, working=WORKING_7B_GB)
    fits = {r.strategy: r.fits for r in table.rows}
    assert not any(fits[s] for s in ("NNN", "NNI", "NNG"))  # the paper's NN* OOM
    top = [r.strategy for r in table.rows[:4]]
    assert {"NII", "IIG", "III"} <= set(top), top
    assert table.recommended in ("NII", "IIG", "III")
    # Communication-bound view (t_comp = 0): NII first.
    assert _paper(7e9, 1, working=WORKING_7B_GB, compute=False).recommended == "NII"


def test_paper_pick_65b_full_training():
    for compute in (True, False):
        table = _paper(65e9, 1, checkpointing=True, compute=compute)
        assert {r.strategy for r in table.rows if r.fits} == {"IIG", "IGG", "GIG", "GGG"}
        assert table.recommended == "IIG"
    mem = {st: memory_bytes(st, 65e9, 65e9, 32, 8)["total"] / GIB for st in ("IIG", "IGG", "GIG", "GGG")}
    assert mem == pytest.approx({"IIG": 53.0, "IGG": 41.6, "GIG": 41.6, "GGG": 30.3}, abs=0.06)


def test_paper_pick_65b_sixteenth_trainable():
    table = _paper(65e9, 1 / 16, checkpointing=True)
    assert table.recommended in ("IIG", "III")
    # Without a compute term the pure comm model prefers the g=N strategies by ~3 % (paro.md §13); IIG/III lead
    # once those are set aside.
    comm_only = _paper(65e9, 1 / 16, compute=False)
    rows = {r.strategy: r.t_comm_s for r in comm_only.rows}
    assert rows["INI"] == pytest.approx(9.28, abs=0.01) and rows["IIG"] == pytest.approx(9.54, abs=0.01)
    no_gn = [r.strategy for r in comm_only.rows if parse_strategy(r.strategy).g.name != "N" and r.fits]
    assert no_gn[:2] == ["III", "IIG"]


def test_traffic_formulas_table_4_4():
    psi, s, n, m = 1.0, 10, 32, 8
    a_i, a_e = (m - 1) / m, (n // m - 1) / n
    t = lambda st: traffic(st, psi, psi, n, m, s, bytes_param=1, bytes_grad=1)  # noqa: E731
    assert t("IIG")["intra"] == pytest.approx(2 * s * a_i + s * a_i)
    assert t("IIG")["inter"] == pytest.approx(2 * a_e)
    assert t("GGG")["inter"] == pytest.approx(2 * s * a_e + s * a_e)
    assert t("NGG")["inter"] == pytest.approx((s + 1) * a_e)
    flat = traffic("NNG", psi, psi, n, m, s, 1, 1, paro_cc=False)
    assert flat["flat"] == pytest.approx(2 * (n - 1) / n) and flat["inter"] == 0


def test_guideline_input_errors():
    with pytest.raises(ValueError, match="group_size=3 must divide world_size=32"):
        GuidelineInputs(num_params=1e9, world_size=32, group_size=3, bandwidth_intra_gbps=1, bandwidth_inter_gbps=1)
    with pytest.raises(ValueError, match="trainable_params"):
        GuidelineInputs(num_params=1e9, trainable_params=2e9, world_size=8, group_size=8, bandwidth_intra_gbps=1,
                        bandwidth_inter_gbps=1)


def test_cli_advise(capsys):
    assert main(["advise", "--num-params", "65e9", "--trainable-fraction", "0.0625", "-n", "32", "-m", "8",
                 "--intra-gbps", "2000", "--inter-gbps", "80", "-s", "10", "--device-memory-gb", "80",
                 "--tokens-per-step", str(TOKENS), "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "recommended: III" in out and "NO" in out
    assert main(["advise", "--num-params", "7e9", "-n", "32", "-m", "8", "--intra-gbps", "2000", "--inter-gbps", "80",
                 "-s", "10", "--device-memory-gb", "80", "--working-memory-gb", "50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] == "NII" and len(data["rows"]) == 14
    with pytest.raises(SystemExit, match="group_size=3"):
        main(["advise", "--num-params", "7e9", "-n", "32", "-m", "3", "--intra-gbps", "1", "--inter-gbps", "1"])


@pytest.mark.slow  # importing the transformers auto classes takes tens of seconds on a loaded machine
def test_cli_hf_config(tmp_path, capsys):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32).save_pretrained(tmp_path)
    assert main(["advise", "--hf-config", str(tmp_path), "-n", "4", "-m", "2", "--intra-gbps", "100",
                 "--inter-gbps", "10", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["num_params"] == 2 * (12 * 64 * 64 + 13 * 64) + 100 * 64 + 32 * 64 + 2 * 64


@pytest.mark.parametrize("paro_cc", [True, False])
def test_collectives_sum_to_traffic(paro_cc):
    """The per-call split the latency/factor terms use moves exactly the bytes of the §4.4 traffic table."""
    from hf_placement.partition import collectives

    for st in VALID_STRATEGY_NAMES:
        want = traffic(st, 1000, 400, 8, 2, 3, bytes_param=2, bytes_grad=4, paro_cc=paro_cc)
        got = {"intra": 0.0, "inter": 0.0, "flat": 0.0}
        for c in collectives(st, 1000, 400, 8, 2, 3, bytes_param=2, bytes_grad=4, paro_cc=paro_cc):
            got[c["link"]] += c["bytes"]
        for link in got:
            assert got[link] == pytest.approx(want[link]), (st, link)


def test_calibrated_terms():
    """Defaults keep the paper's T = max(t_comm, t_comp); overlap=0 adds them; latency grows with calls per step;
    the optimizer term is divided by d(os); a reduce-scatter factor only charges strategies that reduce-scatter."""
    base = {"num_params": 1e8, "world_size": 4, "group_size": 2, "bandwidth_intra_gbps": 100,
            "bandwidth_inter_gbps": 2, "accumulation_steps": 4, "compute_time_s": 0.5}
    rows = {r.strategy: r for r in advise(GuidelineInputs(**base)).rows}
    serial = {r.strategy: r for r in advise(GuidelineInputs(**base, overlap=0.0)).rows}
    for st, r in rows.items():
        assert r.t_step_s == pytest.approx(max(r.t_comm_s, 0.5))
        assert serial[st].t_step_s == pytest.approx(r.t_comm_s + 0.5)
    lat = {r.strategy: r for r in advise(GuidelineInputs(**base, latency_inter_s=0.01, num_buckets=3)).rows}
    # GGG: 2s AG + s RS inter calls per bucket = 12 calls x 3 buckets; NNN: one inter all-reduce x 3 buckets
    assert lat["GGG"].t_comm_s - rows["GGG"].t_comm_s == pytest.approx(0.36)
    assert lat["NNN"].t_comm_s - rows["NNN"].t_comm_s == pytest.approx(0.03)
    opt = {r.strategy: r for r in advise(GuidelineInputs(**base, overlap=0.0, optimizer_time_s=0.4)).rows}
    assert opt["NNN"].t_step_s - serial["NNN"].t_step_s == pytest.approx(0.4)
    assert opt["NNI"].t_step_s - serial["NNI"].t_step_s == pytest.approx(0.2)
    assert opt["GGG"].t_step_s - serial["GGG"].t_step_s == pytest.approx(0.1)
    rs = {r.strategy: r for r in advise(GuidelineInputs(**base, reduce_scatter_factor=2.0)).rows}
    assert rs["GGG"].t_comm_s > rows["GGG"].t_comm_s
    with pytest.raises(ValueError, match="overlap=2"):
        GuidelineInputs(**base, overlap=2)
    with pytest.raises(ValueError, match="latency_inter_s"):
        GuidelineInputs(**base, latency_inter_s=-1)
