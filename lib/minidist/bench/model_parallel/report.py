"""The model-parallel bench's tables: time and traffic, memory, bubble; measured next to the formulas.

``run(bench)`` launches everything (``measure._measure``), puts each measurement beside its
formula (``tensor.tp_traffic_formula``, ``pipeline.pp_traffic_formula``, ``zero.traffic_formula``,
``memory.estimate``, ``pipeline.bubble_formula``), prints three tables and saves the JSON.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict

from minidist import memory
from minidist.models.zero_training import make_model, model_config
from minidist.parallel import zero
from minidist.parallel.pipeline import pp_traffic_formula
from minidist.parallel.tensor import allreduce_bytes, tp_traffic_formula

from .measure import ModelParallelBench, _measure


def run(bench: ModelParallelBench, out: str | None = None) -> dict:
    """Run every variant, print three tables (time and traffic, memory, bubble), save JSON."""
    from minidist.parallel import pipeline as pp

    from .._util import out_dir, print_table, save_json

    p, m = bench.world_size, bench.microbatches
    if p != 2:
        raise ValueError(f"this bench runs 2 ranks (TP-2, 2 stages, ZeRO over 2), got world_size={p}")
    global_batch = p * bench.batch
    if global_batch % m:
        raise ValueError(
            f"the global batch {global_batch} (= {p} x batch {bench.batch}) does not split into "
            f"{m} microbatches; pick a microbatch count that divides it"
        )
    cfg = bench.run_config()
    mcfg = model_config(cfg)
    load_before = os.getloadavg()
    par, zero_runs, bubbles = _measure(bench)
    load_after = os.getloadavg()

    # ---- time and traffic ---------------------------------------------------------------------
    numel = sum(p_.numel() for p_ in make_model(cfg).parameters())
    formulas = {
        "DP (our DDP)": allreduce_bytes(numel * 4, p),
        "TP-2": tp_traffic_formula(mcfg, global_batch, bench.seq, p)["bytes"],
        "PP GPipe": pp_traffic_formula(mcfg, global_batch, bench.seq, m),
        "PP 1F1B": pp_traffic_formula(mcfg, global_batch, bench.seq, m),
    }
    for stage in (1, 2, 3):
        formulas[f"ZeRO-{stage}"] = zero.traffic_formula(stage, par[0][f"ZeRO-{stage}"]["padded_numel"], p, 4)
    rows: dict[str, dict] = {}
    for name in formulas:
        per_rank = [r[name] for r in par]
        step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank)))
        rows[name] = {
            "step_s": step,
            "bytes_sent": [r["bytes_sent"] for r in per_rank],
            "formula": formulas[name],
            "loss": statistics.fmean(r["loss"] for r in per_rank if r["loss"] is not None),
            "held": [r["held"] for r in per_rank] if per_rank[0]["held"] else None,
        }
    tp_counts = par[0]["TP-2"]["collectives"]
    tp_want = tp_traffic_formula(mcfg, global_batch, bench.seq, p)
    rows["TP-2"]["collectives"] = tp_counts
    for name in ("PP GPipe", "PP 1F1B"):
        fn = pp.gpipe if name == "PP GPipe" else pp.one_f_one_b
        tl = pp.timeline_of([r[name]["pipeline"] for r in par])
        rows[name]["peak_in_flight"] = [r[name]["peak_in_flight"] for r in par]
        rows[name]["peak_in_flight_schedule"] = pp.peak_in_flight(fn(p, m))
        rows[name]["bubble_measured"] = tl.bubble_fraction
    for stage in (1, 2, 3):  # memory from the run alone
        outs = zero_runs[f"ZeRO-{stage}"]
        rows[f"ZeRO-{stage}"]["held"] = [
            sum(o["held"][k] for k in ("params", "grads", "optimizer")) for o in outs
        ]
        rows[f"ZeRO-{stage}"]["peak_rss_growth"] = [o["peak_rss_growth"] for o in outs]
    if "FSDP2" in zero_runs:
        outs = zero_runs["FSDP2"]
        timed = zero_runs["FSDP2 interleaved"]
        for name in ("ZeRO-3 (gloo)", "FSDP2 (torch, gloo)"):
            rows[name] = {
                "step_s": statistics.median(max(ts) for ts in zip(*(r[name]["times"] for r in timed))),
                "loss": statistics.fmean(r[name]["loss"] for r in timed),
            }
        rows["ZeRO-3 (gloo)"].update(
            bytes_sent=[o["ours_bytes_sent"] for o in outs],
            formula=zero.traffic_formula(3, outs[0]["padded_numel"], p, 4),
            held=[sum(o["ours_held"][k] for k in ("params", "grads", "optimizer")) for o in outs],
            peak_rss_growth=[o["ours_peak_rss_growth"] for o in outs],
        )
        rows["FSDP2 (torch, gloo)"]["peak_rss_growth"] = [o["fsdp2_peak_rss_growth"] for o in outs]
    dp_step = rows["DP (our DDP)"]["step_s"]
    mib = 1 / (1 << 20)
    table = []
    for name, r in rows.items():
        sent = r.get("bytes_sent")
        formula = r.get("formula")
        table.append([
            name, r["step_s"] * 1e3, r["step_s"] / dp_step,
            f"{max(sent) * mib:.3f}" if sent else "-",
            f"{formula * mib:.3f}" if formula else "-",
            max(sent) / formula if sent and formula else math.nan,
            r["loss"],
        ])  # fmt: skip
    title = (
        f"decoder vocab {bench.vocab}, d {bench.hidden}, {bench.layers} layers, {bench.heads} heads, "
        f"seq {bench.seq}; {p} ranks, global batch {global_batch} per step; median of {bench.steps} "
        f"steps after {bench.warmup}, slowest rank; x DP = step time / the DP row's (rows down to ZeRO-3: "
        "one launch, steps interleaved; the two gloo rows: their own launch, interleaved with each "
        "other: compare them with each other); MiB sent = payload bytes per rank "
        "per step (the more of the two ranks); loss = last step's, mean of ranks (all rows train the same)"
    )
    print()
    text = print_table(
        ["variant", "step ms", "x DP", "MiB sent/rank", "formula MiB", "sent/formula", "loss"], table, title
    )
    print(
        f"TP-2 collectives per step: forward {tp_counts['forward']['allreduce']} allreduces "
        f"(formula {tp_want['forward']}), backward {tp_counts['backward']['allreduce']} "
        f"(formula {tp_want['backward']})"
    )
    for name in ("PP GPipe", "PP 1F1B"):
        r = rows[name]
        print(
            f"{name}, m={m}: peak microbatches in flight per stage {r['peak_in_flight']} "
            f"(schedule: {r['peak_in_flight_schedule']}); bubble on the decoder {r['bubble_measured']:.1%} "
            f"(balanced-stage formula {pp.bubble_formula(p, m):.1%}; stage 1 also computes the "
            f"{bench.vocab}-word head)"
        )

    # ---- memory -------------------------------------------------------------------------------
    def calc(name: str, rank: int) -> dict:
        kw = dict(batch=bench.batch, seq=bench.seq, precision="fp32")
        if name == "DP (our DDP)":
            return memory.estimate(mcfg, dp=p, activations="minidist", **kw)
        if name == "TP-2":
            return memory.estimate(mcfg, **{**kw, "batch": global_batch}, tp=p)
        if name.startswith("PP"):
            return memory.estimate(mcfg, **{**kw, "batch": global_batch // m}, pp=p, stage=rank)
        stage = 3 if name.startswith(("ZeRO-3", "FSDP2")) else int(name[-1])
        return memory.estimate(mcfg, zero_stage=stage, dp=p, activations="minidist", **kw)

    mem_table = []
    for name, r in rows.items():
        ests = [calc(name, rank) for rank in range(p)]
        states = [e["params"] + e["grads"] + e["optimizer"] for e in ests]
        r["calculator"] = ests
        held = r.get("held")
        growth = r.get("peak_rss_growth")
        acts = ests[0]["activations"] if name.startswith(("DP", "ZeRO", "FSDP2")) else math.nan
        mem_table.append([
            name,
            " / ".join(f"{h * mib:.1f}" for h in held) if held else "-",
            " / ".join(f"{s * mib:.1f}" for s in states),
            max(held) / max(states) if held else math.nan,
            " / ".join(f"{g * mib:.1f}" for g in growth) if growth else "-",
            acts * mib,
        ])  # fmt: skip
    print()
    mem_text = print_table(
        [
            "variant",
            "held MiB r0 / r1",
            "calculator MiB",
            "held/calc",
            "peak RSS growth MiB r0 / r1",
            "calc activations MiB",
        ],
        mem_table,
        "model states held after the optimizer step (parameters + gradients + AdamW state, counted from "
        "storages) vs memory.estimate(precision='fp32', dp/tp/pp, zero_stage, stage=rank); peak RSS growth "
        "= peak resident memory during the steps after the first, above the RSS after it (activations, "
        "fresh gradients, gathered units), next to the calculator's activations (activations='minidist', "
        "our DecoderLM exactly; DP/ZeRO rows)",
    )
    if "FSDP2 (torch, gloo)" in rows:
        ours, theirs = rows["ZeRO-3 (gloo)"], rows["FSDP2 (torch, gloo)"]
        print(
            f"ours ZeRO-3 / FSDP2 (gloo, interleaved): step time {ours['step_s'] / theirs['step_s']:.2f}x, "
            f"peak RSS growth {max(ours['peak_rss_growth']) / max(theirs['peak_rss_growth']):.2f}x"
        )

    # ---- bubble -------------------------------------------------------------------------------
    bubble_table = [
        [
            name,
            mb,
            b["measured"],
            b["formula"],
            b["simulated"],
            b["measured"] / b["formula"],
            b["wall_s"] * 1e3,
        ]
        for (name, mb), b in bubbles.items()
    ]
    print()
    bubble_text = print_table(
        ["schedule", "m", "measured", "formula", "simulated", "measured/formula", "makespan ms"],
        bubble_table,
        f"pipeline bubble, 2 stages, sleep-timed (t_F = {bench.t_forward * 1e3:g} ms, t_B = "
        f"{bench.t_backward * 1e3:g} ms): measured 1 - busy / (p x makespan) vs (p-1)/(m+p-1)",
    )
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    directory = out_dir(out)
    save_json(
        directory,
        "model_parallel",
        {
            "config": asdict(bench),
            "load": [load_before, load_after],
            "rows": rows,
            "bubble": [{"schedule": n, "m": mb, **b} for (n, mb), b in bubbles.items()],
            "tables": [text, mem_text, bubble_text],
        },
    )
    return {"rows": rows, "bubble": bubbles}
