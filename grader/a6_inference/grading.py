"""How ``python -m grader grade`` runs assignment 6: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, one
process, JSON arguments with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the report read back as JSON and ``.npy``: the formats and the decoder
(``reference.py``) are recomputed here from the same arguments. The sandbox gets ``workers.py``
and ``rules.py`` only: never ``test_hidden.py``, ``reference.py``, the expected values or the
points.
"""

from __future__ import annotations

from grader.forbidden import Rules
from grader.plan import (
    GradedTest,
    graded_tests_from_cases,
    import_failure_of,
    redact_expected,
)

from . import STUDENT_FILES, rules
from . import test_hidden as hidden

__all__ = [
    "STUDENT_FILES",
    "SANDBOX_FILES",
    "FORBIDDEN",
    "SIMILAR_TO",
    "GIVEN_FUNCTIONS",
    "graded_tests",
    "failure_message",
    "import_failure",
    "redact",
    "HINTS",
]

#: files of this folder the sandbox needs (workers, and the rules their guard enforces); never test_hidden.py
SANDBOX_FILES = ("workers.py", "rules.py")
#: what a submission may not use (``rules.py``): refused at intake and, in the sandbox, at run time
FORBIDDEN = Rules.of(rules)
#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = ("lib/minidist/quant.py", "lib/minidist/models/generate.py")
#: functions the stub gives (every submission has them), and the canonical one-liners: not compared
GIVEN_FUNCTIONS = (
    "NF4Weight.nbytes",
    "NF4Weight.numel",
    "DecoderBlock.__init__",
    "TinyDecoder.__init__",
    # not given, but not compared either: their docstrings dictate the one line every correct
    # answer writes alike (the library's versions are the same tokens)
    "dequantize_int8",
    "unpack_4bit",
)
WORKERS_MODULE = "workers"

HINTS = {
    "quantize_int8": "Per row (last dimension), in float32: scale = amax(|w|) / 127 (keepdim); codes = "
    "round(w / scale) clamped to [-127, 127], as int8; a zero row gets scale 0 and codes 0.",
    "dequantize_int8": "codes.float() * scale.",
    "pack_4bit": "Flatten; byte i = 16 * code[2i] + code[2i+1] (the first code in the high four bits), "
    "uint8; "
    "unpack_4bit gives (byte // 16, byte % 16) per byte, in that order.",
    "quantize_nf4": "Pad the flattened float32 weights with zeros to whole blocks; per block absmax; code = "
    "the index of the NF4 value nearest to w / absmax; store only pack_4bit(codes) and the float32 absmax.",
    "dequantize_nf4": "NF4_VALUES[unpacked code] * the scale of its block, padding dropped, reshaped; the "
    "values the codes hold, not the original weights.",
    "attention_step": "Project only x_new; split heads (B, T, H, h) -> (B, H, T, h); cat the past k, v in "
    "front (dim 2); new token i at position T_past + i sees keys 0..T_past + i; softmax; o_proj.",
    "generate": "Greedy: argmax of the last position's logits. With the cache: the prompt once, then only "
    "the newest token with the past the previous step returned.",
}


def _first(check):
    """The case checks one process's report; md.launch returns the list of the ranks' reports."""

    def on_reports(outs):
        if not isinstance(outs, list) or len(outs) != 1 or not isinstance(outs[0], dict):
            raise AssertionError("the job did not return one report")
        check(outs[0])

    return on_reports


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    return graded_tests_from_cases(hidden.cases(seed), WORKERS_MODULE, wrap=_first)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    text = str(error.get("text", ""))
    if error.get("kind") == "timeout":
        return hidden.timeout_failure(test.function, seconds, text)
    if error.get("kind") == "worker":
        exc_type, summary = str(error.get("exc_type", "")), str(error.get("summary", ""))
        return hidden.worker_failure(test.function, exc_type, summary, text)
    return f"{test.function}: the test harness failed: {text}"


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because the student's module could not be imported."""
    return import_failure_of(error, "import_module(")


#: what a student may see: the wrong value, not the expected one
redact = redact_expected
