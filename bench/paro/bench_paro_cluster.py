"""PaRO on an emulated two-node cluster under a per-rank memory budget, against tuned DeepSpeed and FSDP2 baselines.

    sudo .venv/bin/python bench/paro/bench_paro_cluster.py          # writes bench/results/paro_cluster.json

Set-up: two network namespaces ("nodes") x 2 ranks, gloo over TCP; the veth pair between the nodes is shaped with
``tbf`` (`hf_placement.testing.emulated_cluster`). The inter-node rate is set to ``intra / ratio``. One GPT-2 built
from a config, fp32 + AdamW everywhere. See ``bench/paro/README.md`` for what is measured and how to read it.

1. Footprints: every PaRO strategy runs two steps untimed; its model-state bytes per rank are measured.
2. Budgets (`budget_from`): `advise` says which strategies fit a 65B model (n=32, m=8) on 80 GB ("tight": IIG, IGG,
   GIG, GGG) and on 192 GB ("loose": adds III, NIG, ING, NGG, GNG); each budget is the geometric mean of the largest
   measured footprint on the fitting side and the smallest on the other.
3. Main setting (1:50, s=4): calibration, compute-only run, every strategy that fits the loose budget (the budget's
   fitting set and III with a settings search), every baseline with its settings search (`SEARCH`; the first
   candidate is the documented default). Configurations over the loose budget stop after the memory probe, untimed.
4. Other settings (s=1, s=16, 1:10): the tuned pick of each family only.
Every timed configuration's per-step loss must match the single-process run (``--rtol``) or it is marked invalid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf_placement.partition import VALID_STRATEGY_NAMES  # noqa: E402
from hf_placement.testing.emulated_cluster import ClusterRunError, EmulatedCluster  # noqa: E402
from paro_zero_backend import GuidelineInputs, advise, bytes_per_element  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_worker.py"
def kendall_distance(pred: list[str], measured: dict[str, float], tie_rel: float = 0.0) -> tuple[float, int]:
    """Fraction of strategy pairs that the predicted order (best first) puts the other way round from the measured
    throughput. Pairs whose measured throughputs differ by less than ``tie_rel`` (relative) are measurement ties:
    they are left out (neither order is wrong). Returns (distance, pairs compared)."""
    pos = {s: k for k, s in enumerate(pred)}
    bad = total = 0
    for a, b in itertools.combinations(pred, 2):
        ta, tb = measured[a], measured[b]
        if abs(ta - tb) <= tie_rel * max(ta, tb):
            continue
        total += 1
        if (pos[a] < pos[b]) != (ta > tb):
            bad += 1
    return (bad / total if total else 0.0), total


def run_launch(cluster, configs: list[str], args, *, accumulation: int, steps: int, calibrate: bool = False,
               budget_bytes: float = 0.0, probe_only: bool = False) -> tuple[dict, dict, dict]:
    """Run ``configs`` in launches of ``--chunk`` configurations (process start-up is paid per launch, but a stalled
    or failed launch loses only its own configurations, which are reported as errors)."""
    results, model, calib, errors = {}, {}, {}, {}
    chunks = [configs[k:k + args.chunk] for k in range(0, len(configs), args.chunk)]
    for k, chunk in enumerate(chunks):
        argv = [sys.executable, str(WORKER), "--configs", ",".join(chunk), "--steps", str(steps),
                "--warmup", str(args.warmup), "--accumulation", str(accumulation), "--n-layer",
                str(args.n_layer), "--n-embd", str(args.n_embd), "--vocab", str(args.vocab), "--seq-len",
                str(args.seq_len), "--micro-batch", str(args.micro_batch), "--group-size", str(args.procs_per_node),
                "--budget-bytes", str(budget_bytes)]
        if calibrate and k == 0:
            argv.append("--calibrate")
        if probe_only:
            argv.append("--probe-only")
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
        try:
            ranks = cluster.run(argv, env=env, timeout=args.launch_timeout)
        except ClusterRunError as exc:
            print(f"launch of {chunk} failed: {str(exc)[:500]}", flush=True)
            errors.update(dict.fromkeys(chunk, str(exc)[:2000]))
            continue
        for line in ranks[0].stdout.splitlines():
            if line.startswith("PARO_BENCH "):
                r = json.loads(line[len("PARO_BENCH "):])
                results[r["config"]] = r
                what = (f"median step {statistics.median(r['step_times_s']):.2f} s" if r.get("timed") else
                        r.get("error", "not timed")[:200])
                mem = r.get("model_state_bytes_max", 0) / 1e6
                print(f"  {r['config']:<60} {mem:8.1f} MB  {what}", flush=True)
            elif line.startswith("PARO_MODEL "):
                model = json.loads(line[len("PARO_MODEL "):])
            elif line.startswith("PARO_CALIB "):
                calib = json.loads(line[len("PARO_CALIB "):])
    for name in configs:
        if name not in results and name not in errors:
            errors[name] = "no result line (see the launch's stderr)"
    if errors:
        results["_errors"] = errors
    return results, model, calib


def summarize(results: dict, tokens_per_step: int, reference: list[float], rtol: float) -> dict:
    """One row per configuration: footprint and fit, and for timed ones throughput, traffic and the loss check
    against the single-process reference (max relative deviation over every step, warm-up included)."""
    out = {}
    for name, r in results.items():
        if name == "_errors":
            continue
        if "error" in r:
            out[name] = {"error": r["error"], "valid": False}
            continue
        row = {"settings": r.get("settings", {}), "model_state_mb": r["model_state_bytes_max"] / 1e6,
               "model_state_bytes": r["model_state_bytes_max"], "timed": r["timed"]}
        if "engine_memory_bytes" in r:
            row["engine_memory_bytes"] = r["engine_memory_bytes"]
            row["num_buckets"] = r["num_buckets"]
        if r["timed"]:
            med = statistics.median(r["step_times_s"])
            row.update({"median_step_s": med, "tokens_per_s": tokens_per_step / med,
                        "inter_node_mb_per_step": (r["inter_node_bytes_per_step"] or 0) / 1e6,
                        "intra_node_mb_per_step": (r["intra_node_bytes_per_step"] or 0) / 1e6,
                        "median_optimizer_s": statistics.median(r["optimizer_times_s"]),
                        "step_times_s": r["step_times_s"], "loss_trajectory": r["loss_trajectory"]})
            if "engine_bytes_per_step" in r:
                row["engine_bytes_per_step"] = r["engine_bytes_per_step"]
            if name == "compute":  # per-rank local data: not the global batch, nothing to compare
                row["valid"] = True
            else:
                traj = r["loss_trajectory"]
                dev = max(abs(x - y) / abs(y) for x, y in zip(traj, reference))
                row["loss_max_rel_dev"] = dev
                row["valid"] = len(traj) == len(reference) and dev <= rtol
                if not row["valid"]:
                    print(f"  !! {name}: loss trajectory deviates from the single-process run by {dev:.2e} "
                          f"(> {rtol:g}): marked invalid", flush=True)
        out[name] = row
    return out


def reference_trajectory(args, accumulation: int, total_steps: int) -> list[float]:
    """The single-process run every configuration must reproduce: one model, AdamW, and per global step the mean
    loss over all ranks' micro-batches (the same `batch` ids the ranks draw), accumulated over ``s`` micro-steps."""
    sys.path.insert(0, str(WORKER.parent))
    import torch
    from _worker import ADAMW, batch, build_model

    ns = argparse.Namespace(**{**vars(args), "n_head": 4, "accumulation": accumulation})
    model = build_model(ns)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    n = 2 * args.procs_per_node
    traj = []
    for step in range(total_steps):
        total = 0.0
        for k in range(accumulation):
            for r in range(n):
                loss = model(input_ids=(ids := batch(ns, step, k, r)), labels=ids).loss
                (loss / (accumulation * n)).backward()
                total += float(loss.detach()) / (accumulation * n)
        opt.step()
        opt.zero_grad(set_to_none=True)
        traj.append(total)
    return traj


def set_ratio(cluster, ratio: float, intra_mb_s: float) -> dict:
    cluster.set_inter_mbit(intra_mb_s / ratio * 8)
    bw = cluster.measure_bandwidth()
    bw["inter_mbit"] = cluster.inter_mbit
    bw["target_ratio"] = ratio
    return bw


def guideline(calib: dict, compute: dict, model: dict, args, accumulation: int, num_buckets: int,
              candidates: list[str]):
    """The guideline fed only calibration figures: collective timings and the compute-only run."""
    intra, inter = calib["intra"], calib["inter"]
    n = 2 * args.procs_per_node
    opt = compute["median_optimizer_s"]
    inputs = GuidelineInputs(
        num_params=model["params"], world_size=n, group_size=args.procs_per_node,
        bandwidth_intra_gbps=intra["bandwidth_mb_s"] * 8e-3, bandwidth_inter_gbps=inter["bandwidth_mb_s"] * 8e-3,
        accumulation_steps=accumulation, compute_time_s=compute["median_step_s"] - opt,
        **bytes_per_element(), overlap=0.0, latency_intra_s=intra["latency_s"], latency_inter_s=inter["latency_s"],
        num_buckets=num_buckets, reduce_scatter_factor=inter["reduce_scatter_factor"],
        all_reduce_factor=inter["all_reduce_factor"], optimizer_time_s=opt, candidates=candidates)
    return advise(inputs)


def compare(table, tput: dict[str, float], tie_rel: float) -> dict:
    """The guideline's order against measured throughput ``tput`` (strategy -> tokens/s)."""
    pred = [r.strategy for r in table.rows if r.strategy in tput]
    best = max(tput, key=tput.get)
    strict, pairs = kendall_distance(pred, tput, 0.0)
    tied, pairs_t = kendall_distance(pred, tput, tie_rel)
    return {"predicted_order": pred, "measured_order": sorted(tput, key=tput.get, reverse=True),
            "predicted_best": pred[0], "measured_best": best, "pairs": pairs,
            "kendall_distance": strict, "kendall_distance_ties_excluded": tied, "pairs_compared_ties_excluded": pairs_t,
            "tie_threshold_rel": tie_rel, "top1_regret": tput[best] / tput[pred[0]] - 1,
            "predicted_step_s": {r.strategy: r.t_step_s for r in table.rows}}


def breakdown(name: str, r: dict, compute: dict, bw: dict) -> dict:
    """Where one step's time goes: compute (the compute-only run), inter and intra communication (bytes over the
    link divided by the measured TCP bandwidth, per direction), and the rest (synchronisation, latency, CPU
    contention of copies)."""
    comp = compute["median_step_s"]
    # bytes are totals over the cluster; each direction/node carries about half, in parallel
    inter = r["inter_node_mb_per_step"] / 2 / bw["inter_mb_s"]
    intra = r["intra_node_mb_per_step"] / 2 / bw["intra_mb_s"]
    step = r["median_step_s"]
    return {"config": name, "step_s": step, "compute_s": comp, "inter_comm_s": inter, "intra_comm_s": intra,
            "other_s": step - comp - inter - intra}


# ----------------------------------------------------------------------------------------------- what is searched
# Settings strings are `_worker.parse_config`'s ``kind:what|key=value``. The first candidate of each baseline is its
# documented default (no setting given); the others are the search. PaRO gets the same kinds of knobs.
B1M, B5M = 1_000_000, 5_000_000
DS12 = ["", f"|reduce_bucket_size={B1M}|allgather_bucket_size={B1M}",
        f"|overlap_comm=true|reduce_bucket_size={B1M}|allgather_bucket_size={B1M}"]
# stage3_max_reuse_distance / max_live_parameters default to 1e9 elements: on a 65B model that bounds the gathered
# working set to ~1.5% of the model, here it keeps the whole model gathered from forward to backward. The scaled
# candidates set them so that parameters are released after use, as they are at scale.
R0 = "|stage3_max_reuse_distance=0|stage3_max_live_parameters=1000000"
DS3 = ["", f"|reduce_bucket_size={B1M}|stage3_prefetch_bucket_size={B1M}",
       f"|reduce_bucket_size={B1M}|stage3_prefetch_bucket_size={B1M}{R0}",
       f"|reduce_bucket_size=200000|stage3_prefetch_bucket_size=200000{R0}",
       f"|overlap_comm=false|reduce_bucket_size={B1M}|allgather_bucket_size={B1M}|stage3_prefetch_bucket_size={B1M}"
       f"|stage3_param_persistence_threshold=0{R0}"]
SEARCH = {
    "ds:1": [f"ds:1{x}" for x in DS12],
    "ds:2": [f"ds:2{x}" for x in DS12],
    "ds:3": [f"ds:3{x}" for x in DS3],
    "ds:3+hpz": [f"ds:3|hpz=1{x}" for x in (DS3[0], DS3[2], DS3[3])],
    "fsdp2:full": ["fsdp2:full", "fsdp2:full|prefetch=true", "fsdp2:full|reshard_after_forward=2"],
    "fsdp2:hybrid": ["fsdp2:hybrid", "fsdp2:hybrid|prefetch=true"],
}
PARO_SEARCH = ["", "|bucket_size=100000", "|reshard_after_forward=false"]
# strategies that get the PaRO settings search (the others run at defaults): the 65B-like budget's fitting set + III
PARO_SEARCHED = ("IIG", "IGG", "GIG", "GGG", "III")
LABELS = {"ds:1": "DeepSpeed ZeRO-1", "ds:2": "DeepSpeed ZeRO-2", "ds:3": "DeepSpeed ZeRO-3",
          "ds:3+hpz": "DeepSpeed ZeRO++ hpZ", "fsdp2:full": "FSDP2 full shard", "fsdp2:hybrid": "FSDP2 HSDP (MiCS)",
          "compute": "compute only"}
REFERENCE_DEVICE = {"num_params": 65e9, "world_size": 32, "group_size": 8, "tight_gb": 80.0, "loose_gb": 192.0}


def family(config: str) -> str:
    """The baseline or PaRO strategy a configuration string belongs to (``ds:3|hpz=1|...`` -> ``ds:3+hpz``)."""
    head, *opts = config.split("|")
    if head.startswith("ds:3") and "hpz=1" in opts:
        return "ds:3+hpz"
    return head


def fit_sets(device_gb: float) -> tuple[list[str], list[str]]:
    """Which PaRO strategies `advise` finds fitting / not fitting for the reference job (a 65B model, n=32, m=8,
    mixed-precision AdamW) on devices of ``device_gb``."""
    r = REFERENCE_DEVICE
    t = advise(GuidelineInputs(num_params=r["num_params"], world_size=r["world_size"], group_size=r["group_size"],
                               bandwidth_intra_gbps=2000, bandwidth_inter_gbps=80, device_memory_gb=device_gb))
    return [x.strategy for x in t.rows if x.fits], [x.strategy for x in t.rows if not x.fits]


def budget_from(footprints: dict[str, int], device_gb: float) -> dict:
    """The budget rule: the per-rank budget of this benchmark's model that separates the strategies the reference
    job fits on ``device_gb`` devices from those it does not, on *measured* footprints: the geometric mean of the
    largest measured footprint among the fitting strategies and the smallest among the others."""
    fit, out = fit_sets(device_gb)
    fit, out = [s for s in fit if s in footprints], [s for s in out if s in footprints]
    if not fit or not out:
        raise RuntimeError(f"the budget rule needs footprints of strategies on both sides at {device_gb:g} GB; "
                           f"measured only {sorted(footprints)}")
    hi = max(footprints[s] for s in fit)
    lo = min(footprints[s] for s in out)
    consistent = hi < lo
    return {"device_gb": device_gb, "budget_bytes": (hi * lo) ** 0.5 if consistent else float(hi),
            "reference_fits": fit, "reference_does_not_fit": out, "largest_fitting_footprint": hi,
            "smallest_excluded_footprint": lo, "consistent": consistent,
            "rule": "sqrt(max measured footprint over the strategies advise fits for a 65B model (n=32, m=8, "
                    f"2/2/12 bytes) on {device_gb:g} GB x min measured footprint over those it does not fit)"}


def pick(rows: dict, budget: float, fam: str) -> str | None:
    """The fastest valid, timed configuration of family ``fam`` that fits ``budget``."""
    ok = [c for c, r in rows.items() if family(c) == fam and r.get("timed") and r.get("valid")
          and r["model_state_bytes"] <= budget]
    return max(ok, key=lambda c: rows[c]["tokens_per_s"]) if ok else None


def budget_table(rows: dict, budget: float, families: list[str]) -> dict:
    """Per family (baseline or PaRO strategy): its best configuration under ``budget`` and that configuration's
    figures, or the reason it has none (does not fit: smallest measured footprint; or not run / invalid)."""
    table = {}
    for fam in families:
        best = pick(rows, budget, fam)
        mine = {c: r for c, r in rows.items() if family(c) == fam}
        if best is not None:
            r = rows[best]
            table[fam] = {"fits": True, "config": best, "tokens_per_s": r["tokens_per_s"],
                          "median_step_s": r["median_step_s"], "model_state_mb": r["model_state_mb"],
                          "settings": r["settings"]}
        elif mine:
            fp = [r["model_state_bytes"] for r in mine.values() if "model_state_bytes" in r]
            table[fam] = {"fits": False, "smallest_footprint_mb": min(fp) / 1e6 if fp else None,
                          "reason": "over budget" if fp and min(fp) > budget else "no valid timed run"}
    return table


def print_table(title: str, table: dict, ref: str = "ds:3") -> None:
    base = table.get(ref, {}).get("tokens_per_s")
    print(title)
    for fam, r in sorted(table.items(), key=lambda kv: -kv[1].get("tokens_per_s", 0)):
        label = LABELS.get(fam, fam.replace("paro:", "PaRO "))
        if r["fits"]:
            vs = f"{r['tokens_per_s'] / base:6.2f}x" if base else "      -"
            print(f"  {label:<24} {r['tokens_per_s']:9.1f} tok/s {vs} ZeRO-3  {r['model_state_mb']:6.1f} MB  "
                  f"{r['config']}")
        else:
            print(f"  {label:<24} does not fit ({r['reason']}, smallest footprint {r['smallest_footprint_mb']} MB)")


def run_setting(cluster, args, key: str, ratio: float, accumulation: int, steps: int, configs: list[str],
                intra: float, loose: float, reference_cache: dict) -> dict:
    bw = set_ratio(cluster, ratio, intra)
    print(f"\n== {key}: 1:{ratio:g}, s={accumulation}, {steps} timed steps: inter {bw['inter_mb_s']:.1f} MB/s "
          f"({bw['inter_mbit']:.0f} mbit tbf), intra {bw['intra_mb_s']:.0f} MB/s, measured ratio "
          f"1:{bw['intra_over_inter']:.1f}; {len(configs)} configurations", flush=True)
    total = args.warmup + steps
    if (accumulation, total) not in reference_cache:
        reference_cache[(accumulation, total)] = reference_trajectory(args, accumulation, total)
    ref = reference_cache[(accumulation, total)]
    t0 = time.perf_counter()
    raw, model, calib = run_launch(cluster, configs, args, accumulation=accumulation, steps=steps, calibrate=True,
                                   budget_bytes=loose)
    tokens = 2 * args.procs_per_node * accumulation * args.micro_batch * args.seq_len
    rows = summarize(raw, tokens, ref, args.rtol)
    return {"ratio": ratio, "accumulation": accumulation, "steps": steps, "warmup": args.warmup,
            "tokens_per_global_step": tokens, "errors": raw.get("_errors", {}), "bandwidth": bw,
            "calibration": calib, "model": model, "reference_loss_trajectory": ref, "results": rows,
            "launch_wall_s": time.perf_counter() - t0}


def evaluate(entry: dict, budgets: dict, args, strategies: list[str]) -> None:
    """Per budget: the table of best fitting configurations and the guideline's check over the fitting PaRO
    strategies (each at its default settings, the engine the guideline models)."""
    rows = entry["results"]
    fams = list(SEARCH) + [f"paro:{s}" for s in strategies]
    entry["budgets"] = {}
    for bname, b in budgets.items():
        table = budget_table(rows, b["budget_bytes"], fams)
        e = {"budget_bytes": b["budget_bytes"], "table": table}
        # each strategy at its default settings where that ran (the main setting), else at its tuned pick
        row_of = {}
        for st in strategies:
            mine = [c for c in rows if family(c) == f"paro:{st}"]
            c = f"paro:{st}" if f"paro:{st}" in mine else (mine[0] if mine else None)
            if c and rows[c].get("timed") and rows[c].get("valid") and rows[c]["model_state_bytes"] <= b[
                    "budget_bytes"]:
                row_of[st] = c
        fit = list(row_of)
        if len(fit) >= 2 and "compute" in rows and rows["compute"].get("timed") and entry["calibration"]:
            nb = rows[row_of[fit[0]]].get("num_buckets") or 1
            g = guideline(entry["calibration"], rows["compute"], entry["model"], args, entry["accumulation"], nb,
                          fit)
            e["guideline"] = compare(g, {s: rows[row_of[s]]["tokens_per_s"] for s in fit}, args.tie)
            e["guideline"]["configs"] = row_of
            e["guideline"]["table"] = g.format()
        entry["budgets"][bname] = e
        print_table(f"-- {bname} budget {b['budget_bytes'] / 1e6:.2f} MB/rank ({entry['ratio']:g}, "
                    f"s={entry['accumulation']})", table)
        if "guideline" in e:
            gl = e["guideline"]
            print(f"  guideline {' > '.join(gl['predicted_order'])} | measured {' > '.join(gl['measured_order'])} | "
                  f"Kendall {gl['kendall_distance']:.3f}, top-1 regret {gl['top1_regret']:.1%}", flush=True)


def ratio_of(table: dict, a: str, b: str) -> float | None:
    ra, rb = table.get(a, {}), table.get(b, {})
    return ra["tokens_per_s"] / rb["tokens_per_s"] if ra.get("fits") and rb.get("fits") else None


def build_summary(report: dict) -> dict:
    """The `summary` object: the main setting under the 65B-like budget, plus the other settings' key ratios."""
    main = report["settings_runs"]["main"]
    tight = main["budgets"]["tight"]
    table = tight["table"]
    paro = {f: r for f, r in table.items() if f.startswith("paro:") and r["fits"]}
    base = {f: r for f, r in table.items() if not f.startswith("paro:") and f != "compute" and r["fits"]}
    bp = max(paro, key=lambda f: paro[f]["tokens_per_s"]) if paro else None
    bb = max(base, key=lambda f: base[f]["tokens_per_s"]) if base else None
    g = tight.get("guideline", {})
    hpz_any = [c for c, r in main["results"].items() if family(c) == "ds:3+hpz" and r.get("timed") and r.get("valid")]
    hpz_best = max(hpz_any, key=lambda c: main["results"][c]["tokens_per_s"]) if hpz_any else None
    iig = table.get("paro:IIG", {})
    summary = {
        "setting": {"ratio": main["ratio"], "accumulation": main["accumulation"],
                    "measured_ratio": main["bandwidth"]["intra_over_inter"]},
        "budget_bytes": tight["budget_bytes"], "loose_budget_bytes": main["budgets"]["loose"]["budget_bytes"],
        "budget_rule": report["budgets"]["tight"]["rule"],
        "fitting": sorted(f for f, r in table.items() if r["fits"]),
        "best_fit_strategy": {"name": bp, "config": paro[bp]["config"], "settings": paro[bp]["settings"]}
        if bp else None,
        "best_baseline": {"name": bb, "label": LABELS.get(bb), "config": base[bb]["config"],
                          "settings": base[bb]["settings"]} if bb else None,
        "best_fit_vs_best_baseline": paro[bp]["tokens_per_s"] / base[bb]["tokens_per_s"] if bp and bb else None,
        "iig_vs_zero3_tuned": ratio_of(table, "paro:IIG", "ds:3"),
        "iig_vs_hpz": (iig["tokens_per_s"] / main["results"][hpz_best]["tokens_per_s"]
                       if iig.get("fits") and hpz_best else None),
        "hpz_fits_budget": table.get("ds:3+hpz", {}).get("fits", False),
        "hpz_config_compared": hpz_best,
        "kendall_distance": g.get("kendall_distance"), "top1_regret": g.get("top1_regret"),
        "guideline_pairs": g.get("pairs"), "guideline_predicted": g.get("predicted_order"),
        "guideline_measured": g.get("measured_order"),
        "invalid_configs": sorted(c for run in report["settings_runs"].values() for c, r in run["results"].items()
                                  if r.get("timed") and not r.get("valid")),
    }
    loose = main["budgets"]["loose"]
    summary["loose"] = {"best_fit_vs_best_baseline": None, "kendall_distance": loose.get("guideline", {}).get(
        "kendall_distance"), "top1_regret": loose.get("guideline", {}).get("top1_regret")}
    lt = loose["table"]
    lp = [f for f, r in lt.items() if f.startswith("paro:") and r["fits"]]
    lb = [f for f, r in lt.items() if not f.startswith("paro:") and r["fits"]]
    if lp and lb:
        p_, b_ = (max(lp, key=lambda f: lt[f]["tokens_per_s"]), max(lb, key=lambda f: lt[f]["tokens_per_s"]))
        summary["loose"].update({"best_fit_strategy": p_, "best_baseline": b_,
                                 "best_fit_vs_best_baseline": lt[p_]["tokens_per_s"] / lt[b_]["tokens_per_s"],
                                 "iig_vs_zero3_tuned": ratio_of(lt, "paro:IIG", "ds:3"),
                                 "iii_vs_hsdp": ratio_of(lt, "paro:III", "fsdp2:hybrid")})
    summary["other_settings"] = {}
    for key, run in report["settings_runs"].items():
        t = run.get("budgets", {}).get("tight", {})
        tb = t.get("table", {})
        fp = [f for f, r in tb.items() if f.startswith("paro:") and r["fits"]]
        fb = [f for f, r in tb.items() if not f.startswith("paro:") and r["fits"]]
        o = {"ratio": run["ratio"], "accumulation": run["accumulation"],
             "measured_ratio": run["bandwidth"]["intra_over_inter"],
             "kendall_distance": t.get("guideline", {}).get("kendall_distance"),
             "top1_regret": t.get("guideline", {}).get("top1_regret"),
             "iig_vs_zero3_tuned": ratio_of(tb, "paro:IIG", "ds:3")}
        if fp and fb:
            p_, b_ = (max(fp, key=lambda f: tb[f]["tokens_per_s"]), max(fb, key=lambda f: tb[f]["tokens_per_s"]))
            o.update({"best_fit_strategy": p_, "best_baseline": b_,
                      "best_fit_vs_best_baseline": tb[p_]["tokens_per_s"] / tb[b_]["tokens_per_s"]})
        summary["other_settings"][key] = o
    tgt = {"best_fit_vs_best_baseline": (summary["best_fit_vs_best_baseline"], 1.3, ">="),
           "iig_vs_zero3_tuned": (summary["iig_vs_zero3_tuned"], 2.0, ">="),
           "kendall_distance": (summary["kendall_distance"], 0.2, "<="),
           "top1_regret": (summary["top1_regret"], 0.1, "<=")}
    summary["targets"] = {k: {"value": v, "target": f"{op} {t}",
                              "met": None if v is None else (v >= t if op == ">=" else v <= t)}
                          for k, (v, t, op) in tgt.items()}
    main_rows = main["results"]
    if "compute" in main_rows and main_rows["compute"].get("timed"):
        summary["time_breakdown"] = [breakdown(r["config"], main_rows[r["config"]], main_rows["compute"],
                                               main["bandwidth"]) for r in table.values() if r["fits"]]
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ratio", type=float, default=50.0, help="intra:inter bandwidth ratio of the main setting")
    p.add_argument("--accumulation", type=int, default=4, help="s of the main setting")
    p.add_argument("--other-accumulation", default="1,16", help="further s at the main ratio (tuned configs only)")
    p.add_argument("--other-ratios", default="10", help="further ratios at the main s (tuned configs only)")
    p.add_argument("--procs-per-node", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=192)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration (s <= 4)")
    p.add_argument("--steps-s16", type=int, default=1, help="timed steps per configuration at s > 4")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rtol", type=float, default=1e-4, help="loss-trajectory tolerance against one process")
    p.add_argument("--tie", type=float, default=0.05, help="relative throughput gap counted as a measurement tie")
    p.add_argument("--strategies", default=",".join(VALID_STRATEGY_NAMES), help="PaRO strategies")
    p.add_argument("--quick", action="store_true", help="development: defaults only (no settings search)")
    p.add_argument("--launch-timeout", type=float, default=1500.0, help="seconds per launch")
    p.add_argument("--chunk", type=int, default=8, help="configurations per launch")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "paro_cluster.json"))
    p.add_argument("--resummarize", metavar="JSON", help="recompute the summary of an existing result file and exit")
    args = p.parse_args(argv)
    if args.resummarize:
        report = json.loads(Path(args.resummarize).read_text())
        report["summary"] = build_summary(report)
        Path(args.resummarize).write_text(json.dumps(report, indent=1))
        print(json.dumps(report["summary"], indent=1))
        return 0
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    strategies = [s.strip().upper() for s in args.strategies.split(",") if s.strip()]
    report: dict = {"settings": vars(args), "load_avg_at_start": load_before, "settings_runs": {}}
    search = {k: v[:1] for k, v in SEARCH.items()} if args.quick else SEARCH
    paro_search = PARO_SEARCH[:1] if args.quick else PARO_SEARCH
    ref_cache: dict = {}
    with EmulatedCluster(nodes=2, procs_per_node=args.procs_per_node, inter_mbit=400) as cluster:
        # loopback throughput is CPU-bound and noisy on a busy machine: median of three probes
        intra = statistics.median(cluster.measure_bandwidth()["intra_mb_s"] for _ in range(3))
        print(f"intra-node bandwidth {intra:.0f} MB/s (TCP stream over loopback inside one node)", flush=True)
        # 1. footprints of every PaRO strategy (2 steps each, untimed) -> the two budgets
        raw, _, _ = run_launch(cluster, [f"paro:{s}" for s in strategies], args, accumulation=args.accumulation,
                               steps=1, probe_only=True)
        footprints = {c.split(":")[1]: r["model_state_bytes_max"] for c, r in raw.items()
                      if c != "_errors" and "model_state_bytes_max" in r}
        budgets = {"tight": budget_from(footprints, REFERENCE_DEVICE["tight_gb"]),
                   "loose": budget_from(footprints, REFERENCE_DEVICE["loose_gb"])}
        report["footprints_paro_bytes"] = footprints
        report["budgets"] = budgets
        for k, b in budgets.items():
            print(f"{k} budget: {b['budget_bytes'] / 1e6:.2f} MB/rank (fits at {b['device_gb']:g} GB: "
                  f"{','.join(b['reference_fits'])}; consistent={b['consistent']})", flush=True)
        loose = budgets["loose"]["budget_bytes"]
        fitting = [s for s in strategies if footprints.get(s, 1e30) <= loose]
        # 2. main setting: every fitting strategy with the PaRO search, every baseline with its search
        main_cfgs = ["compute"] + [f"paro:{s}{x}" for s in fitting
                                   for x in (paro_search if s in PARO_SEARCHED else paro_search[:1])]
        main_cfgs += [c for cands in search.values() for c in cands]
        key = f"1:{args.ratio:g} s={args.accumulation}"
        entry = run_setting(cluster, args, key, args.ratio, args.accumulation, args.steps, main_cfgs, intra, loose,
                            ref_cache)
        evaluate(entry, budgets, args, strategies)
        report["settings_runs"]["main"] = entry
        # the tuned picks, reused elsewhere: per family the best under the tight budget, else under the loose one
        rows = entry["results"]
        tuned = []
        for fam in list(search) + [f"paro:{s}" for s in fitting]:
            best = pick(rows, budgets["tight"]["budget_bytes"], fam) or pick(rows, loose, fam)
            if best is None:  # fits no budget: its fastest valid run, so the other settings still show it
                cands = [c for c, r in rows.items() if family(c) == fam and r.get("timed") and r.get("valid")]
                best = max(cands, key=lambda c: rows[c]["tokens_per_s"]) if cands else None
            if best:
                tuned.append(best)
        entry["tuned_picks"] = tuned
        # the other settings run a subset (runtime): the families whose pick fits the tight budget, plus the
        # loose budget's headline pair (PaRO III vs FSDP2 HSDP) and hpZ
        tb = budgets["tight"]["budget_bytes"]
        keep = {"paro:III", "fsdp2:hybrid", "ds:3+hpz"}
        subset = [c for c in tuned if rows[c]["model_state_bytes"] <= tb or family(c) in keep]
        entry["other_settings_configs"] = subset
        others = [(args.ratio, int(a)) for a in args.other_accumulation.split(",") if a.strip()]
        others += [(float(r), args.accumulation) for r in args.other_ratios.split(",") if r.strip()]
        for ratio, acc in others:
            steps = args.steps_s16 if acc > 4 else args.steps
            key = f"1:{ratio:g} s={acc}"
            e = run_setting(cluster, args, key, ratio, acc, steps, ["compute"] + subset, intra, loose, ref_cache)
            evaluate(e, budgets, args, strategies)
            report["settings_runs"][key] = e
    import deepspeed
    import torch
    import transformers

    report["summary"] = build_summary(report)
    report["summary"]["load_avg"] = {"start": load_before, "end": os.getloadavg()}
    report["notes"] = {
        "secondary_settings": "settings other than the main one run only the tuned picks (chosen at the main "
                              "setting) of the families that fit the tight budget, plus PaRO III, FSDP2 HSDP and "
                              "hpZ (settings_runs.main.other_settings_configs), with 1 timed step at s > 4",
        "footprint": "model-state bytes per rank (max over ranks): distinct tensor storages reachable from the "
                     "model/optimizer/engine, probed at the end of the last micro-step's forward and after its "
                     "backward in the second step (largest kept); persistent communication buffers that an "
                     "engine allocates (DeepSpeed's reduce buckets) count, transient per-layer gathers do not",
        "budget": "configurations above the loose budget stop after the probe and are not timed; a table per "
                  "budget lists each family's best configuration whose footprint fits",
    }
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         "load_avg_at_start": load_before, "load_avg_at_end": os.getloadavg(),
                         "note": "2-core machine, 4 ranks; shared with other jobs unless rerun on an idle machine"}
    report["versions"] = {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                          "transformers": transformers.__version__}
    report["wall_s"] = time.perf_counter() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nsummary: {json.dumps({k: v for k, v in report['summary'].items() if k != 'time_breakdown'})}")
    print(f"wrote {args.out} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
