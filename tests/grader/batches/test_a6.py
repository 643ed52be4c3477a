"""``python -m grader grade a6_inference``: the example students and the stub, graded in one batch.

The graded tests are the hidden tests with their points; the grader's int8 and NF4
(``grader/a6_inference/reference.py``) agree with the library's tested ``minidist.quant``, and its
attention and decoder (recomputed over the whole sequence) with torch's fused attention and with
the solution; the checks refuse reports that cheat (extra bytes, a view of a larger buffer, the
original weights back from a round trip, projections of the whole sequence); the intake check
and the run time guard refuse the library's and torch's quantization and attention; and the
example students of ``grader/examples/a6_inference/make.py`` (correct, two partial ones, packing
the wrong way round, recomputing instead of caching, the library's NF4; and the red team's
cheats: fp32 weights kept in the object, in a larger storage behind the packed view, float
"codes", frame walking, torch's fused attention; and the second red team's: fused attention as
``torch.ops.aten`` or flex_attention, numel that lies under a mode, vmap or a tensor subclass, the
weights read back through autograd or a trace, the token log rewritten through the projection's
closure) and the released stub get exactly their expected
scores on a six-test subset of the hidden tests that tells them apart (one batch, ``--jobs 2``,
a fixed seed key; about a minute on 2 busy cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader
from grader import similarity
from grader.examples.a6_inference import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart (glob patterns: "[[]" is a literal "["): int8 codes
#: (int8_float), packing (dave), NF4 codes (dave, bob), NF4 memory (fp32_inside, hidden_storage),
#: attention (bob) and the use of the cache (carol, erin); six, to keep the run short
SUBSET = (
    "test_int8_quantize[[]3d-float64]",
    "test_pack_4bit",
    "test_nf4_quantize[[]block-6-zeros]",
    "test_nf4_memory[[]block-64]",
    "test_attention_step[[]one-token-batch-3]",
    "test_generate_uses_the_cache",
)

SUBSET_NAMES = [pattern.replace("[[]", "[") for pattern in SUBSET]


def grade(submissions: Path, out: Path, *extra: str) -> str:
    return run_grader("a6_inference", submissions, out, *extra, timeout=500)


@pytest.mark.timeout(500)
def test_the_examples_and_the_stub_get_their_scores(tmp_path):
    submissions = tmp_path / "subs"
    make.write(submissions, make.build_dict())
    (submissions / "stub").mkdir()
    for name in make.FILES:
        (submissions / "stub" / name).write_bytes((make.STUB_FOLDER / name).read_bytes())
    out = tmp_path / "out"
    selection = [arg for pattern in SUBSET for arg in ("--tests", pattern)]
    grade(submissions, out, "--jobs", "2", "--test-timeout", "30", "--seed-key", "k", *selection)
    book = gradebook(out)
    assert (
        book["alice"]["score"]
        == book["alice"]["max_score"]
        == f"{make.expected_score('alice', SUBSET_NAMES):g}"
    )
    for student, (status, _) in make.LOST.items():
        score = make.expected_score(student, SUBSET_NAMES)
        assert (book[student]["status"], float(book[student]["score"])) == (status, score), book[student]
    assert book["stub"]["score"] == "0" and book["stub"]["status"] == "ok"
    stub = json.loads((out / "stub" / "results.json").read_text())
    assert all("NotImplementedError" in t["output"] and "TODO(task" in t["output"] for t in stub["tests"])
    assert "high four bits" in (out / "dave" / "feedback.md").read_text()
    assert "projection saw" in (out / "erin" / "feedback.md").read_text()
    assert "minidist.quant" in book["frank"]["reason"]
    # the red team's, closed (the scores: ``make.LOST``)
    for cheat in ("fp32_inside", "hidden_storage"):
        feedback = (out / cheat / "feedback.md").read_text()
        assert "storage" in feedback and "the format" in feedback, cheat
    assert "dtype" in (out / "int8_float" / "feedback.md").read_text()
    assert "tb_frame" in book["frame_walk"]["reason"]
    assert "scaled_dot_product_attention" in book["fused_attention"]["reason"]
    # the second red team's, closed (``make.LOST``)
    assert "scaled_dot_product_attention" in book["ops_attention"]["reason"]
    assert "minidist.models.checkpointing" in book["library_core"]["reason"]
    assert "torch.nn.attention" in book["flex_attention"]["reason"]
    assert "torch.overrides" in book["mode_numel"]["reason"]
    assert "vmap" in book["vmap_rows"]["reason"]
    assert "OneRow" in book["subclass_numel"]["reason"] and "run time" in book["subclass_numel"]["reason"]
    assert "torch.jit" in book["traced_weights"]["reason"]
    assert "getattr" in book["closure_log"]["reason"]
    assert "does not require grad" in (out / "autograd_weights" / "feedback.md").read_text()
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT
