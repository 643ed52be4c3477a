"""How ``python -m grader grade`` runs assignment 4: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the dense model and
the schedules (``reference.py``) are recomputed here from the same arguments. The sandbox gets ``workers.py``
and ``rules.py`` only: never ``cases.py``, ``reference.py``, the expected values or the
points.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = ("lib/minidist/parallel/tensor/*.py", "lib/minidist/parallel/pipeline/*.py")
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = (
    "shard_range",
    "_GatherLastDim.forward",
    "_GatherLastDim.backward",
    "_ScatterLastDim.forward",
    "_ScatterLastDim.backward",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "_check_sizes",
    "gpipe",
) + (
    # not given, but not compared either: their docstrings dictate a few lines that every correct
    # answer writes alike (the library's versions, written from the same specification, are the
    # same tokens: 0.87-1.0 for the solution); a copy shows in the functions that are left
    "ColumnParallelLinear.forward",
    "RowParallelLinear.forward",
    "ParallelMLP.load_dense",
    "one_f_one_b",
)

HINTS = {
    "copy_to_tensor_parallel": "f: forward returns x.clone() (no communication); backward returns "
    "md.allreduce(ctx.comm, grad.clone()), None. g is the mirror image.",
    "reduce_from_tensor_parallel": "g: forward returns md.allreduce(comm, x.clone()); "
    "backward returns grad, None.",
    "ColumnParallelLinear": "Rank r keeps rows [r d_out/p, (r+1) d_out/p) of W and b; forward: "
    "F.linear(f(x), W_r, b_r), gathered only if gather_output.",
    "RowParallelLinear": "Rank r keeps columns [r d_in/p, (r+1) d_in/p) of W and the whole bias; forward: "
    "g(F.linear(x_r, W_r)) + b -- the bias after the sum, once.",
    "ParallelMLP": "up: ColumnParallelLinear(d, ffn) without gather; exact F.gelu; "
    "down: RowParallelLinear(ffn, d) "
    "with a parallel input. No other allreduce: one forward (g), one backward (f).",
    "one_f_one_b": "Stage r: w = min(p - 1 - r, m) forwards; then m - w pairs (F w+i, B i); then the last w "
    "backwards. It holds at most p - r microbatches (GPipe holds m).",
    "run_stage": "F: input (inputs[j] or recv from r-1, requires_grad_), out = stage(x), send to r+1 or "
    "the loss; B: (loss/m).backward() or recv the gradient from r+1 and out.backward(grad); "
    "send x.grad to r-1. One message per microbatch and direction; count what is kept.",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=60,
    student_code="tp_layers.py or schedule.py",
    deadlock_hint=(
        "Every send needs its recv on the other rank, in the same order, and every rank must take "
        "part in each collective."
    ),
    import_marker="import_module(name)",
)
