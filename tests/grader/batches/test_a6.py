"""``python -m grader grade a6_inference``: the example students, graded once.

One batch on a subset of the hidden tests that tells the examples of
``grader/examples/a6_inference/make.py`` apart, both red teams' cheats included (``--jobs 2``, a
fixed seed key). The grader's int8, NF4, attention and decoder, and the checks that cheats met:
``tests/grader/test_grade_a6.py``.
The solution and the stub on every hidden test: ``test_solutions_and_stubs.py``. The measured
test (task 4) once more, alone, on the copy of the library's quantizer: the second tier.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from grade_helpers import (
    check_expected_scores,
    grade_examples,
    gradebook,
    run_grader,
)
from grader import grade, similarity
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


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a6_inference").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(500)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples(
        "a6_inference", make, SUBSET, tmp_path, "--test-timeout", "30", "--seed-key", "k"
    )
    check_expected_scores(book, make, SUBSET_NAMES)
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


@pytest.mark.timeout(300)
def test_a_copy_of_the_library_does_not_reach_the_top_tier(tmp_path):
    """library_nf4 stores every matrix as the library's NF4 with double-quantized scales: within
    the perplexity bound at 4.135 bits a weight, the second tier (``make.PARTIAL``), on the
    leaderboard with that value; the feedback names what full points need. (The solution's top
    tier, 3.883 bits: ``test_solutions_and_stubs.py``; the bits are counted from the fields and
    the perplexity is the grader's, so two gradings give the same.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, {"library_nf4": make.build_dict()["library_nf4"]})
    run_grader("a6_inference", submissions, out, "--tests", glob.escape(make.MEASURED), timeout=240)
    copy = gradebook(out)["library_nf4"]
    assert (copy["status"], float(copy["score"])) == (
        "ok",
        make.expected_score("library_nf4", [make.MEASURED]),
    )
    value = json.loads((out / "library_nf4" / "results.json").read_text())["extra_data"]["measured"][
        make.MEASURED
    ]
    assert value == 4.134765625, value  # 3,251,712 bits / 786,432 weights
    board = next((out / "leaderboard").iterdir()).read_text()
    assert "\n1,library_nf4," in board, board
    assert "full points need at most 4 bits" in (out / "library_nf4" / "feedback.md").read_text()
