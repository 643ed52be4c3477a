"""How ``python -m grader grade`` runs assignment 5: the hidden tests as jobs plus trusted checks.

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
    "copy_to_tensor_parallel": "f and g: x reaches every rank's shard, so who holds the pieces of dL/dx? "
    "g sums partial outputs: what is the gradient of a sum with respect to one term? Which of the two "
    "communicates in the forward, which in the backward -- once each?",
    "reduce_from_tensor_parallel": "g: what is the gradient of a sum with respect to one of its terms, "
    "and which rank already has it?",
    "ColumnParallelLinear": "Which rows of W and b does rank r hold, and does its layer compute with the "
    "parameters it exposes? What must wrap x so that the backward returns the whole dL/dx?",
    "RowParallelLinear": "Which columns of W does rank r hold? What does each rank have after its partial "
    "product, and how many times is a bias added before the sum?",
    "ParallelMLP": "Which cut of up lets the GELU run on each rank's slice alone, and which cut of down "
    "takes that slice as it is? Is there any collective besides the two the layers make?",
    "one_f_one_b": "How many microbatches may stage r hold, and does it run a forward whenever it holds "
    "fewer (and otherwise its next backward)? Lecture 7, section 4.",
    "fast_schedule": "Which part of a backward does the stage before wait for, and which part could wait? "
    "What fills stage 0's idle time while the first gradient comes back, and the last stages' at the "
    "end? Draw it with a5_run.timeline; the cap is p held per stage.",
    "run_stage": "Does every forward go through stage(x), and every message go once per microbatch and "
    "direction? For a split backward, what does B ask autograd for (inputs=...), what must stay until W, "
    "and does stage 0's input require a gradient? Is what you count held until the backward is done?",
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
