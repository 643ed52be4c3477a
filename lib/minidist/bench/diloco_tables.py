"""``python -m minidist.bench diloco``'s arithmetic and tables: bytes against the formulas, the
two targets, time to each on the emulated clock (``local_sgd.time_to_target``) and the check of
the overlap model against the measured run. The runs themselves are in ``bench.diloco``.
"""

from __future__ import annotations

from dataclasses import asdict

from ..collectives import cost_model
from ..parallel import local_sgd
from ..transport.emulated import ETHERNET_10G
from ._util import human_bytes, print_table
from .diloco import GBIT, DilocoBench, Variant, _key, variants


def summarise(cfg: DilocoBench, outs: list[dict]) -> dict:
    """Rows per variant: held-out loss, bytes (counted, formula), time to two targets per link."""
    p, numel = len(outs), outs[0]["numel"]
    tokens = cfg.steps * p * cfg.batch * cfg.seq
    flops_per_s = cfg.gpu_tflops * 1e12 * cfg.mfu
    compute_s = local_sgd.step_compute_s(numel, cfg.batch * cfg.seq, flops_per_s)
    alpha = ETHERNET_10G.alpha_s
    sync_s, predicted = {}, {}
    for q in [None, *cfg.quantized]:  # the slowest rank's median; the alpha-beta prediction
        sync_s[_key(q)] = {g: max(o["sync_s"][_key(q)][g] for o in outs) for g in cfg.links_gbit}
        predicted[_key(q)] = {  # ring allreduce, or two ring allgathers (codes, scales): 2(p-1) messages
            g: cost_model.predict("ring", p, 4 * numel, cost_model.AlphaBeta(alpha, 1 / (g * GBIT), 0.0))
            if q is None else (p - 1) * (2 * alpha + local_sgd.payload_bytes(numel, q) / (g * GBIT))
            for g in cfg.links_gbit
        }  # fmt: skip
    runs = outs[0]["runs"]
    ddp_curve = runs["DDP"]["curve"]
    targets = {
        "worst final": max(run["curve"][-1][1] for run in runs.values()),  # every variant gets there
        "DDP at half": [loss for step, loss in ddp_curve if step <= cfg.steps // 2][-1],
    }
    rows = []
    for v in variants(cfg):
        run, ex = runs[v.label], runs[v.label]["exchanges"]
        formula = [sum(c * local_sgd.sync_bytes(n, p, r, v.quantize) for c, n in ex) for r in range(p)]
        peak = [max(local_sgd.sync_bytes(n, p, r, v.quantize) for _, n in ex) for r in range(p)]
        row = dict(v._asdict(), final_loss=run["curve"][-1][1], syncs=sum(c for c, _ in ex),
                   bytes_sent=[o["runs"][v.label]["bytes_sent"] for o in outs], formula_bytes=formula,
                   peak_bytes=[o["runs"][v.label]["peak_bytes"] for o in outs], peak_formula=peak,
                   bytes_per_token=formula[0] / tokens, curve=run["curve"])  # fmt: skip
        for name, target in targets.items():
            row[f"steps to {name}"] = local_sgd.steps_to_target(run["curve"], target)
            for g in cfg.links_gbit:
                row[f"time {name} {g:g}G"] = local_sgd.time_to_target(
                    run["curve"],
                    target,
                    compute_s,
                    sync_s[_key(v.quantize)][g],
                    v.h or 1,
                    v.fragments,
                    v.delay,
                )
        rows.append(row)
    check = []
    if cfg.streaming:
        g = min(cfg.links_gbit)
        check_s = local_sgd.step_compute_s(numel, cfg.check_tokens, flops_per_s)
        for v in (Variant("DiLoCo", cfg.streaming[0]), variants(cfg)[-1]):
            steps = 2 * v.h + v.delay
            sync = sync_s["fp32"][g]
            model = local_sgd.time_to_target([(steps, 0.0)], 0.0, check_s, sync, v.h, v.fragments, v.delay)
            measured = max(o["check"][v.label]["link"] for o in outs)
            free = max(o["check"][v.label]["no link"] for o in outs)
            check.append(dict(label=v.label, steps=steps, link_gbit=g, compute_s=check_s, model_s=model,
                              measured_s=measured, no_link_s=free))  # fmt: skip
    return dict(config=asdict(cfg), workers=p, numel=numel, tokens=tokens, compute_s=compute_s,
                targets=targets, sync_s=sync_s, predicted_sync_s=predicted, rows=rows,
                check=check)  # fmt: skip


def _time(value) -> str | float:
    return "not reached" if value is None else value


def _ratio(ddp, value) -> str | float:
    return "-" if ddp is None or value is None else ddp / value


def print_tables(result: dict) -> None:
    rows, links = result["rows"], result["config"]["links_gbit"]
    ddp = rows[0]
    (loose, loose_at), (strict, strict_at) = result["targets"].items()
    print_table(
        ["variant", "held-out loss", "vs DDP", "syncs", "bytes/token", "peak bytes (1 exchange)",
         "counted = formula", "steps to target"]
        + [f"time {g:g} Gbit/s" for g in links] + [f"DDP / this {g:g}G" for g in links],
        [[r["label"], r["final_loss"], f"{100 * (r['final_loss'] / ddp['final_loss'] - 1):+.1f}%", r["syncs"],
          human_bytes(int(r["bytes_per_token"])), human_bytes(r["peak_bytes"][0]),
          str(r["bytes_sent"] == r["formula_bytes"] and r["peak_bytes"] == r["peak_formula"]),
          _time(r[f"steps to {loose}"])]
         + [_time(r[f"time {loose} {g:g}G"]) for g in links]
         + [_ratio(ddp[f"time {loose} {g:g}G"], r[f"time {loose} {g:g}G"]) for g in links]
         for r in rows],
        title=f"{result['workers']} workers, {result['numel']:,} parameters, "
        f"{result['tokens']:,} tokens each; target = the worst final held-out loss ({loose_at:.3f}); "
        f"compute {result['compute_s'] * 1e6:.1f} us a step",
    )  # fmt: skip
    print_table(
        ["variant", "steps to target"] + [f"time {g:g} Gbit/s" for g in links]
        + [f"DDP / this {g:g}G" for g in links],
        [[r["label"], _time(r[f"steps to {strict}"])] + [_time(r[f"time {strict} {g:g}G"]) for g in links]
         + [_ratio(ddp[f"time {strict} {g:g}G"], r[f"time {strict} {g:g}G"]) for g in links] for r in rows],
        title=f"the stricter target: DDP's held-out loss at half the run ({strict_at:.3f})",
    )  # fmt: skip
    print_table(
        ["payload", "link", "sync measured (s)", "predicted (s)", "measured / predicted"],
        [[q, f"{g:g} Gbit/s", result["sync_s"][q][g], result["predicted_sync_s"][q][g],
          result["sync_s"][q][g] / result["predicted_sync_s"][q][g]]
         for q in result["sync_s"] for g in links],
        title="one average of the model's pseudo-gradient over the emulated link (slowest rank, median; "
        "fp32: the ring allreduce, DDP's too)",
    )  # fmt: skip
    if result["check"]:
        c0 = result["check"][0]
        print_table(
            ["variant", "steps", "model (s)", "measured (s)", "measured / model", "no link (s)"],
            [[c["label"], c["steps"], c["model_s"], c["measured_s"], c["measured_s"] / c["model_s"],
              c["no_link_s"]] for c in result["check"]],
            title=f"the overlap model, checked: fp32 over the emulated {c0['link_gbit']:g} Gbit/s link, "
            f"{c0['compute_s'] * 1e3:.1f} ms of compute a step on the clock (slowest rank); no link: "
            "the same steps on the plain transport",
        )  # fmt: skip
