"""``python -m minidist.bench model_parallel``: tensor, pipeline and ZeRO/FSDP on one decoder, 2 ranks.

Every row trains the same ``DecoderLM`` (default vocab 8192, d 256, 4 layers, 4 heads, seq 64) from
the same weights on the same global batch of 2 x ``batch`` sequences per step with AdamW, so the
last-step losses printed agree and the step times compare "one global batch" each:

* ``DP (our DDP)`` -- the reference line: ``parallel.ddp.DistributedDataParallel``, ``batch`` rows
  per rank, gradients allreduced (2 (p-1)/p x gradient bytes per rank);
* ``TP-2`` -- ``TensorParallelDecoderLM.from_dense``: both ranks see all rows, each holds half of
  every big matrix; bytes per rank vs ``tensor.tp_traffic_formula`` (2 allreduces of b s d per layer
  forward, 2 backward, plus the embedding's, the logits' f and the cross-entropy's two small ones),
  and ``tensor.count_collectives`` vs the same counts;
* ``PP GPipe``, ``PP 1F1B`` -- ``models.stages.split_decoder`` into 2 stages, ``microbatches``
  microbatches, ``pipeline.run_pipeline`` + ``stages.sync_tied_gradients``: bytes vs
  ``pipeline.pp_traffic_formula`` (activations forward, their gradients back, the tied table's gradient
  swap), microbatches in flight vs ``pipeline.peak_in_flight`` of the schedule, and the bubble of
  the real (unbalanced) stages from ``pipeline.timeline_of``;
* ``ZeRO-1/2/3`` -- ``zero.ZeroOptimizer`` (stages 1, 2) and ``zero.FullyShardedModule`` (3), as
  in ``models.zero_training.train_zero``: bytes vs ``zero.traffic_formula``;
* ``ZeRO-3 (gloo)`` and ``FSDP2 (torch, gloo)`` -- ``models.zero_training.compare_with_fsdp2``: ours
  and torch's ``fully_shard`` in one launch on a gloo group, the ours / FSDP2 ratios of step time
  and peak RSS.

The rows down to ZeRO-3 run in ONE launch, interleaved (one step of each per round, a barrier
before each step) so that load drifting on a shared machine slows them alike; for their memory
the ZeRO stages run again alone (``train_zero``, 3 steps: a peak RSS of their own).

A second table puts the model states each rank holds after the step (parameters + gradients +
AdamW state, ``memory.tensor_bytes``) next to ``memory.estimate(precision="fp32", dp/tp/pp,
zero_stage, stage=rank)``, and the peak RSS growth of the ZeRO/FSDP2 steps next to the
calculator's activations. A third measures the pipeline bubble with sleep-timed stages
(``pipeline.measure_bubble``: sleeping takes no CPU, so 2 busy cores still show the schedule)
against ``(p - 1) / (m + p - 1)``. Results: bench-results/model_parallel.json.

The formulas live beside the code they describe (``parallel.tensor.traffic``,
``parallel.pipeline.executor``, ``parallel.zero``) and the ZeRO and FSDP2 runs in
``minidist.models.zero_training``. This package only launches, measures and prints:
``measure`` runs the launches and returns what each rank measured, ``report`` turns that into
the three tables and the JSON.
"""

from __future__ import annotations

from .measure import ModelParallelBench
from .report import run

__all__ = ["ModelParallelBench", "add_parser", "main", "run"]


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "model_parallel", help="TP, PP (GPipe, 1F1B), ZeRO-1/2/3 and FSDP2 on one decoder, 2 ranks"
    )
    d = ModelParallelBench()
    for name in ("vocab", "hidden", "layers", "heads", "seq", "batch", "steps", "warmup", "microbatches"):
        parser.add_argument(
            f"--{name}", type=int, default=getattr(d, name), help=f"default {getattr(d, name)}"
        )
    parser.add_argument("--bubble-microbatches", type=int, nargs="+", default=list(d.bubble_microbatches))
    parser.add_argument("--t-forward", type=float, default=d.t_forward, help="seconds, sleep-timed stages")
    parser.add_argument("--t-backward", type=float, default=d.t_backward)
    parser.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 comparison (gloo)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    bench = ModelParallelBench(
        vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
        batch=args.batch, steps=args.steps, warmup=args.warmup, microbatches=args.microbatches,
        bubble_microbatches=tuple(args.bubble_microbatches), t_forward=args.t_forward,
        t_backward=args.t_backward, fsdp2=not args.no_fsdp2,
    )  # fmt: skip
    run(bench, args.out)
