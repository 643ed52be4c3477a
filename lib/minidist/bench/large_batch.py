"""``python -m minidist.bench large_batch``: batches B, 4B, 16B, 64B -- Adam linear/sqrt scaling vs LAMB.

Runs ``minidist.optim.large_batch.run_experiment`` (one torch thread by default; well under a
minute on the course machine) and prints, per method and batch size, the learning rate, the
number of steps and the held-out loss and accuracy after the same number of samples; saves
``large_batch.json`` and ``large_batch.png`` (loss vs samples and vs steps).

``--amp`` adds the mixed-precision measurements of ``minidist.optim.amp``: BERT step time in
fp32 vs bf16 autocast on the CPU (a ratio measured in the same run), bytes of parameters,
gradients and optimiser state per precision, and the bf16-vs-fp32 loss curves.
"""

from __future__ import annotations

import argparse
import dataclasses

from minidist.optim import amp
from minidist.optim import large_batch as lb

from ..models.bert_experiments import bert_batches, bert_factory
from ._util import new_figure, out_dir, print_table, save_json


def run(cfg: lb.LargeBatchConfig, threads: int | None, out: str | None, plot: bool) -> list[lb.RunResult]:
    results = lb.run_experiment(cfg, threads=threads)
    rows = [
        [
            r.method,
            r.batch,
            f"{r.lr:.4g}",
            r.steps,
            f"{r.final_loss:.3f}",
            f"{r.eval_accuracy[-1]:.3f}",
            r.seconds,
        ]
        for r in results
    ]
    print_table(
        ["method", "batch", "lr", "steps", "held-out loss", "accuracy", "seconds"],
        rows,
        title=f"same {cfg.samples} samples per run, base batch {cfg.base_batch}",
    )
    total = sum(r.seconds for r in results)
    print(f"training time of all runs: {total:.1f} s", flush=True)
    directory = out_dir(out)
    save_json(
        directory,
        "large_batch",
        {"config": dataclasses.asdict(cfg), "runs": [dataclasses.asdict(r) for r in results]},
    )
    if plot:
        fig, axes = new_figure(2, figsize=(11, 4))
        lb.plot(results, axes)
        path = directory / "large_batch.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        print(f"plot saved to {path}")
    return results


def run_amp(model: str, batch: int, seq: int, steps: int, out: str | None) -> dict:
    """BERT ``model``: step time per precision, state bytes per precision, bf16 vs fp32 loss curves."""
    make = bert_factory(model)
    batches = bert_batches(batch, seq, steps)
    speed = amp.step_time(make, batches[0], steps=steps)
    print_table(
        ["precision", "seconds / step", "vs fp32"],
        [[name, f"{s:.4f}", f"{s / speed['fp32']:.2f}x"] for name, s in speed.items()],
        title=f"BERT {model} training step on the CPU, batch {batch} x {seq} tokens (fastest of {steps})",
    )
    memory = amp.state_bytes(make, batches[0])
    print_table(
        ["precision", "params", "grads", "optimizer", "total"],
        [[name, *(f"{v / 2**20:.2f} MiB" for v in parts.values())] for name, parts in memory.items()],
        title=f"bytes held by the BERT {model} training state (AdamW), measured from the tensors",
    )
    curves = amp.loss_curves(make, batches, precisions=("fp32", "bf16", "fp16"))
    for name in ("bf16", "fp16"):
        gap = max(abs(a - b) for a, b in zip(curves["fp32"], curves[name]))
        print(f"{name} vs fp32 loss over {steps} steps: largest gap {gap:.4f}", flush=True)
    result = {"step_seconds": speed, "state_bytes": memory, "loss_curves": curves}
    save_json(out_dir(out), "mixed_precision", result)
    return result


def main(argv=None) -> None:
    defaults = lb.LargeBatchConfig()
    parser = argparse.ArgumentParser(prog="python -m minidist.bench large_batch", description=__doc__)
    parser.add_argument("--base-batch", type=int, default=defaults.base_batch)
    parser.add_argument("--samples", type=int, default=defaults.samples, help="samples per run")
    parser.add_argument("--multipliers", type=int, nargs="+", default=list(defaults.multipliers))
    parser.add_argument(
        "--warmup", type=float, default=defaults.warmup_fraction, help="warm-up share of samples"
    )
    parser.add_argument("--methods", nargs="+", default=list(defaults.methods), choices=lb.METHODS)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: leave as is)")
    parser.add_argument("--amp", action="store_true", help="also measure bf16/fp16 mixed precision on BERT")
    parser.add_argument("--amp-model", default="tiny", help="BERT config for --amp (default tiny)")
    parser.add_argument("--amp-steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for JSON and plot (default bench-results/)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(
        defaults,
        base_batch=args.base_batch,
        samples=args.samples,
        methods=tuple(args.methods),
        multipliers=tuple(args.multipliers),
        warmup_fraction=args.warmup,
    )
    run(cfg, args.threads or None, args.out, not args.no_plot)
    if args.amp:
        run_amp(args.amp_model, batch=8, seq=32, steps=args.amp_steps, out=args.out)
