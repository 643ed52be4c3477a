"""``python -m grader grade a6_inference``: assignment 6 goes through the same pipeline as a1-a5.

The graded tests are the hidden tests with their points; the grader's int8 and NF4
(``grader/a6_inference/reference.py``) agree with the library's tested ``minidist.quant``, and its
attention and decoder (recomputed over the whole sequence) with torch's fused attention and with
the solution; the measured check rebuilds a format from its fields alone as the library's NF4
would be read, counts its bits, and bounds the perplexity on the course's decoder; the checks
refuse reports that cheat (extra bytes, a view of a larger buffer, the
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

Fast: the grading batch of the examples is ``tests/grader/batches/test_a6.py``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from grader import forbidden, guard, similarity
from grader.a6_inference import cases as table
from grader.a6_inference import reference, workers
from grader.a6_inference.grading import ASSIGNMENT as assignment
from minidist import quant

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solutions" / "a6_inference" / "inference.py"


def solution():
    spec = importlib.util.spec_from_file_location("a6_solution_inference", SOLUTION)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_the_case_table_holds_the_tests_this_file_grades():
    graded = assignment.graded_tests(seed=12345)
    names = [t.name for t in graded]
    assert len(names) >= 15
    assert 55 <= sum(t.points for t in graded) <= 65


def test_hidden_shapes_are_the_hard_ones():
    for seed in range(5):
        for test in assignment.graded_tests(seed):
            spec = test.job.args[0]
            if "block" in spec:  # NF4: the last block is cut short
                assert math.prod(spec["shape"]) % spec["block"], test.name
            if "prompt" in spec and "prompt-1" in test.name:
                assert spec["prompt"] == 1 and spec["batch"] == 1
            if "heads" in spec:
                assert spec["heads"] >= 2 and spec["d"] % spec["heads"] == 0


# --- the grader's formats against the library's tested implementation -------------------------------
def test_reference_int8_equals_the_library():
    spec = table.int8_spec(3, 10, [4, 3], "float64")
    w = workers.weights(spec)
    codes, scale, _ = reference.int8_reference(w)
    want_codes, want_scale = quant.quantize_absmax_int8(w.float(), dim=-1)
    assert torch.equal(codes, want_codes) and torch.allclose(scale, want_scale, rtol=1e-7, atol=0)
    assert (scale.reshape(-1) == 0).any()  # the row of zeros is there, and gives codes 0
    assert int(codes.abs().max()) == 127


def test_reference_nf4_equals_the_library():
    assert torch.allclose(reference.NF4, quant.nf4_code_values(), atol=1e-6, rtol=0)
    torch.testing.assert_close(reference.NF4, torch.tensor(solution().NF4_VALUES), rtol=0, atol=0)
    for block, zero in ((64, False), (6, True), (16, False)):
        spec = table.nf4_spec(7, 30, block, zero)
        w = workers.weights(spec)
        nearest, either, absmax = reference.nf4_reference(w, block)
        q = quant.quantize_nf4(w, block=block, double_quant=False)
        assert torch.equal(absmax, q.absmax)
        library = quant.unpack_4bit(q.packed).long()
        assert ((library == nearest) | (library == either)).all()
        assert torch.equal(reference.pack(nearest), quant.pack_4bit(nearest))  # high four bits first
        back = reference.dequantize(nearest, absmax, block, w.numel()).reshape(w.shape)
        assert torch.allclose(back, quant.dequantize_nf4(q), atol=1e-6)
        if zero:
            assert (nearest[:block] == 7).all()  # a block of zeros: code 7, the value 0


def test_reference_attention_equals_torchs_fused_attention():
    spec = table.attention_spec(0, 99, 2, 3, 4)
    w, x = workers.decoder_weights(spec), workers.attention_input(spec)
    out, k, v = reference.causal_attention(x, w, 0, spec["heads"])
    q = reference.split_heads(F.linear(x, w["0.q.weight"], w["0.q.bias"]), spec["heads"])
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
    assert torch.allclose(out, F.linear(fused, w["0.o.weight"], w["0.o.bias"]), atol=1e-10)
    past = workers.past_kv(spec, w, x)
    assert torch.allclose(past[0], k[:, :, :3], atol=1e-12) and torch.allclose(
        past[1], v[:, :, :3], atol=1e-12
    )


def test_reference_decoder_equals_the_solution_on_the_graders_decoder():
    module = solution()
    spec = table.generation_spec(0, 72, 3, 5, use_cache=True)
    seen: list = []
    model = workers.decoder(spec, seen)
    ids = workers.prompt(spec)
    with torch.no_grad():
        got, _ = module.decoder_step(model, ids)
    assert torch.allclose(got, reference.logits(spec, workers.decoder_weights(spec), ids), atol=1e-10)
    assert torch.equal(module.generate(model, ids, spec["new_tokens"]), reference.greedy(spec))
    assert not hasattr(model.blocks[0].k, "weight") and not list(model.blocks[0].k.parameters())


# --- the checks that cheats met --------------------------------------------------------------------
def _spec(name: str) -> dict:
    return next(t for t in assignment.graded_tests(0) if t.name == name).job.args[0]


def test_memory_is_measured_from_storages_not_numel():
    w = torch.randn(10, 7)
    packed = torch.arange(20, dtype=torch.uint8)
    honest = workers.stored(make_nf4(packed, torch.ones(3)))
    assert honest["bytes"] == 20 + 12 and len(honest["tensors"]) == 2
    buffer = torch.cat([packed, w.reshape(-1).view(torch.uint8)])
    viewed = workers.stored(make_nf4(buffer[:20], torch.ones(3)))
    assert viewed["bytes"] == 20 + 4 * 70 + 12
    extra = make_nf4(packed, torch.ones(3))
    extra.original = w  # an attribute the format does not have
    assert workers.stored(extra)["bytes"] == 32 + 280
    tagged = make_nf4(packed.clone(), torch.ones(3))
    tagged.packed.copy = w  # an attribute on a tensor
    assert workers.stored(tagged)["bytes"] == 32 + 280


def make_nf4(packed, scales):
    return solution().NF4Weight(packed, scales, (5, 8), 8)


def test_the_nf4_checks_refuse_low_first_packing_extra_bytes_and_the_original_back():
    spec = _spec("test_nf4_quantize[block-64]")
    w = workers.weights(spec)
    nearest, _, absmax = reference.nf4_reference(w, spec["block"])
    report = {
        "type": "NF4Weight",
        "packed": reference.pack(nearest),
        "scales": absmax,
        "shape": list(spec["shape"]),
        "block": spec["block"],
    }
    reference.nf4_quantize_check("q", spec)(report)
    low_first = (nearest[0::2] + 16 * nearest[1::2]).to(torch.uint8)
    with pytest.raises(AssertionError, match="high four bits"):
        reference.nf4_quantize_check("q", spec)({**report, "packed": low_first})
    blocks = -(-w.numel() // spec["block"])
    right = {"bytes": blocks * spec["block"] // 2 + 4 * blocks, "tensors": []}
    reference.nf4_memory_check("m", spec)({"stored": right})
    with pytest.raises(AssertionError, match="holds"):
        reference.nf4_memory_check("m", spec)({"stored": {**right, "bytes": right["bytes"] + 4 * w.numel()}})
    trip = _spec("test_nf4_round_trip")
    w = workers.weights(trip)
    nearest, _, absmax = reference.nf4_reference(w, trip["block"])
    honest = reference.dequantize(nearest, absmax, trip["block"], w.numel()).reshape(w.shape)
    reference.nf4_round_trip_check("r", trip)({"out": honest})
    with pytest.raises(AssertionError, match="values the 4-bit codes hold"):
        reference.nf4_round_trip_check("r", trip)({"out": w.clone()})


def test_the_int8_checks_refuse_float_codes():
    spec = _spec("test_int8_quantize[3d-float64]")
    codes, scale, _ = reference.int8_reference(workers.weights(spec))
    reference.int8_quantize_check("i", spec)({"codes": codes, "scale": scale})
    with pytest.raises(AssertionError, match="dtype"):
        reference.int8_quantize_check("i", spec)({"codes": workers.weights(spec).float(), "scale": scale})
    with pytest.raises(AssertionError, match="codes differ"):
        reference.int8_quantize_check("i", spec)(
            {"codes": (codes.long() // 2).to(torch.int8), "scale": scale}
        )


def test_the_cache_checks_count_the_tokens_each_projection_saw():
    spec = _spec("test_generate_uses_the_cache")
    ids, b, n, t0 = reference.greedy(spec), spec["batch"], spec["new_tokens"], spec["prompt"]

    def log(rows_per_step):
        return [[layer, name, rows] for rows in rows_per_step for layer in range(2) for name in "qkvo"]

    reference.cache_use_check("c", spec)({"ids": ids, "seen": log([b * t0] + [b] * (n - 1))})
    recomputed = log([b * (t0 + step) for step in range(n)])
    with pytest.raises(AssertionError, match="projection saw"):
        reference.cache_use_check("c", spec)({"ids": ids, "seen": recomputed})
    with pytest.raises(AssertionError, match="tokens differ"):
        reference.cache_use_check("c", spec)({"ids": ids.flip(1), "seen": log([b * t0] + [b] * (n - 1))})
    attention = _spec("test_attention_cache_grows")
    w, x = workers.decoder_weights(attention), workers.attention_input(attention)
    _, k, v = reference.causal_attention(x, w, 0, attention["heads"])
    past, p = workers.past_kv(attention, w, x), attention["past"]
    k, v = torch.cat([past[0], k[:, :, p:]], 2), torch.cat([past[1], v[:, :, p:]], 2)  # the past as given
    new = attention["batch"] * attention["new"]
    report = {"k": k, "v": v, "seen": [[0, name, new] for name in "qkvo"]}
    reference.attention_cache_check("a", attention)(report)
    whole = attention["batch"] * (attention["past"] + attention["new"])
    with pytest.raises(AssertionError, match="called on"):
        reference.attention_cache_check("a", attention)({**report, "seen": [[0, nm, whole] for nm in "qkvo"]})
    with pytest.raises(AssertionError, match="must grow"):
        reference.attention_cache_check("a", attention)({**report, "k": k[:, :, -1:]})


def test_feedback_names_what_differs_not_the_expected_value():
    spec = _spec("test_int8_dequantize")
    codes, scale = workers.int8_codes(spec)
    want = codes.float() * scale
    with pytest.raises(AssertionError) as caught:
        reference.int8_dequantize_check("d", spec)({"out": want + 1.0})
    message = assignment.redact(str(caught.value))
    assert "differs from the reference by up to 1" in message
    assert f"{float(want.flatten()[0]):.4f}" not in message


def test_the_solution_is_not_flagged_as_similar_to_the_library():
    paths = [path for pattern in assignment.similar_to for path in ROOT.glob(pattern)]
    library = similarity.library_functions(paths, ROOT)
    match = similarity.best_match(SOLUTION.read_text(), library, assignment.given_functions)
    assert match.score < similarity.FLAG_AT, match
    assert match.function not in assignment.given_functions


def test_given_functions_name_functions_of_the_solution():
    names = set(similarity.functions(SOLUTION.read_text()))
    assert set(assignment.given_functions) <= names, set(assignment.given_functions) - names


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace, tried on purpose
def test_the_projections_refuse_what_intercepts_them_and_keep_no_graph():
    """A mode, a subclass, vmap or a trace would make numel lie or hand over the weight; a
    graph would give it back through gradients (``examples/a6_inference/make.py``)."""
    from torch.overrides import TorchFunctionMode

    seen: list = []
    weight, bias = torch.randn(6, 6), torch.randn(6)
    projection = workers.projection(weight, bias, seen, 0, "k")
    x = torch.randn(2, 3, 6, requires_grad=True)
    out = projection(x)
    assert torch.allclose(out, F.linear(x, weight, bias)) and seen == [[0, "k", 6]]
    assert out.grad_fn is None and not out.requires_grad  # no way back to the weight

    class Sub(torch.Tensor):
        pass

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def under_mode():
        with Mode():
            projection(x.detach())

    for attempt in (
        lambda: projection(x.detach().as_subclass(Sub)),
        under_mode,
        lambda: torch.vmap(projection, in_dims=1)(x.detach()),
        lambda: torch.jit.trace(projection, x.detach(), check_trace=False),
    ):
        with pytest.raises(PermissionError, match=guard.MARKER):
            attempt()
    assert len(seen) == 1  # none of them was counted
    stolen: list = []
    library = torch.library.Library("aten", "IMPL")  # a kernel over aten's own

    def addmm(bias, x, weight_t, beta=1, alpha=1):
        stolen.append(weight_t)
        return torch.ops.aten.add(torch.ops.aten.mm(x, weight_t), bias)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        library.impl("addmm", addmm, "CPU")
    try:
        assert torch.allclose(projection(x), out) and stolen == []  # numpy: no aten op sees the weight
    finally:
        library._destroy()


def test_the_worker_refuses_a_mode_left_active_and_walks_slots():
    from torch.overrides import TorchFunctionMode

    def left():
        with TorchFunctionMode():
            yield

    workers.untouched("nothing")
    generator = left()
    next(generator)
    try:
        with pytest.raises(PermissionError, match="still active after quantize_int8"):
            workers.untouched("quantize_int8")
    finally:
        generator.close()
    workers.untouched("nothing")

    class Slots:
        __slots__ = ("packed", "scales", "original")

    q = Slots()
    q.packed, q.scales, q.original = torch.zeros(4, dtype=torch.uint8), torch.ones(1), torch.ones(8)
    assert workers.stored(q)["bytes"] == 4 + 4 + 32  # a slot is no hiding place
    with pytest.raises(TypeError, match="plain tensors"):
        workers.stored([torch.zeros(3).as_subclass(type("Sub", (torch.Tensor,), {}))])


# --- intake and run time ---------------------------------------------------------------------------
def test_the_intake_check_accepts_the_solution_and_refuses_the_library():
    rules = assignment.forbidden
    assert forbidden.check(SOLUTION.read_text(), rules) is None
    for code in (
        "from minidist import quant",
        "from minidist.quant import quantize_nf4",
        "import minidist.quant as q",
        "from minidist.models import generate",
        "from minidist.models.generate import attention_step",
        "from minidist.serve import swarm",
        "from minidist.models.transformer import MultiHeadSelfAttention",
        "import torch.nn.functional as F\nF.scaled_dot_product_attention(q, k, v)",
        "from torch.nn.functional import scaled_dot_product_attention",
        "from torch import nn\nnn.MultiheadAttention(8, 2)",
        "import torch\ntorch.quantize_per_tensor(x, 0.1, 0, torch.qint8)",
        "import torch\ntorch.quantize_per_channel(x, s, z, 0, torch.qint8)",
        "from torch.ao.quantization import quantize_dynamic",
        "import torch.quantization",
        "import bitsandbytes as bnb",
        "from transformers import DynamicCache",
        "import sys\nframe = sys.exc_info()[2].tb_frame.f_back",
        "import subprocess\nsubprocess.run(['cp', 'a', 'b'])",
        # the second red team's: fused attention and quantization under other names, and the
        # tools that intercept the grader's projections or read their weights
        "import torch\ntorch.ops.aten.scaled_dot_product_attention(q, k, v)",
        "import torch\ntorch.ops.aten.quantize_per_tensor(x, 0.1, 0, torch.qint8)",
        "from torch.nn.modules import activation\nactivation.F.scaled_dot_product_attention(q, k, v)",
        "from torch._C._nn import scaled_dot_product_attention",
        "import torch.utils._python_dispatch",
        "from torch.nn.attention.flex_attention import flex_attention",
        "from torch.overrides import TorchFunctionMode",
        "import torch\nclass M(torch.overrides.TorchFunctionMode): pass",
        "import torch\ntorch.vmap(f)(x)",
        "from torch.nn import functional as F\nF.torch.func.vmap(f)",
        "import torch\ntorch.autograd.functional.jacobian(f, x)",
        "import torch\ntorch.jit.trace(f, x)",
        "import torch\ntorch.compile(f)",
        "import torch.fx",
        "import torch\ntorch.library.Library('aten', 'IMPL')",
        "from torch.nn import functional as F\nF.torch.library.Library('aten', 'IMPL')",
        "from torch.nn import functional as F\nF.torch.jit.trace(f, x)",
        # doors to the grader's closures and modules by a string or another path
        "look = getattr\nlook(f, '__clo' + 'sure__')",
        "import functools\nfunctools.reduce(getattr, ['x'], f)",
        "cell.cell_contents",
        "import os\nos.sys.modules['gc']",
        "import string\nstring.Formatter().get_field('0.x', [f], {})",
        "import pickle\npickle.loads(b'cgc\\nget_objects\\n)R.')",
        "import pydoc\npydoc.locate('gc.get_objects')",
        "import logging.config",
        "from unittest import mock",
        "import typing\ntyping.get_type_hints(f)",
        "from functools import singledispatch",
        "import functools\nfunctools.update_wrapper(grab, f, assigned=('__clo' + 'sure__',))",
        "import numpy as np\nnp.ctypeslib.ctypes",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import torch\ntorch.load(f, weights_only=False)",
        "from minidist.models.checkpointing import attention_core",
        "from minidist.models import transformer\ntransformer.attention_bias(cfg, 4, None, d, 'cpu')",
    ):
        assert forbidden.check(code, rules) is not None, code
    for code in (  # what a correct submission writes stays allowed
        "import torch\ntorch.softmax(x, dim=-1)",
        "from __future__ import annotations",
        "from torch.nn import functional as F\nF.torch.softmax(x, -1)",
        "x = getattr(q, 'packed', None)",
        "import torch\nwith torch.no_grad():\n    y = x @ w",
    ):
        assert forbidden.check(code, rules) is None, code


GUARD_PROBE = """
import importlib

import torch
from torch.nn import functional as F

from grader import guard
from grader.a6_inference import rules

guard.install_rules(rules)
refused = []
for name, attribute, args in (
    ("minidist.quant", "quantize_nf4", (torch.ones(8),)),
    ("minidist.quant", "quantize_absmax_int8", (torch.ones(2, 2),)),
    ("minidist.quant", "pack_4bit", (torch.zeros(2, dtype=torch.long),)),
    ("minidist.models.checkpointing", "attention_core", (*[torch.ones(1, 1, 2, 2)] * 3, None, None)),
    ("minidist.models.transformer", "attention_bias", (None, 2, None, torch.float32, "cpu")),
):
    try:
        getattr(importlib.import_module(name), attribute)(*args)
    except (PermissionError, ImportError) as error:
        refused.append(guard.MARKER in str(error))
    else:
        refused.append(False)
from minidist.models.transformer import MultiHeadSelfAttention, TransformerConfig  # noqa: E402

attention = MultiHeadSelfAttention(TransformerConfig(11, 8, 1, 2, 8, causal=True))
try:
    attention(torch.ones(1, 3, 8))
except PermissionError as error:
    refused.append(guard.MARKER in str(error))
assert refused == [True] * 6, refused
assert F.linear(torch.ones(2, 3), torch.ones(4, 3)).shape == (2, 4)  # plain torch stays
print("ok")
"""


def test_the_run_time_guard_refuses_the_library_and_leaves_plain_torch_alone(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(GUARD_PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# --- the whole pipeline ---------------------------------------------------------------------------------


# --- task 4: the format is rebuilt and counted on the trusted side ----------------------------------
def _fields(codes, bits, values, scales, block, shape):
    return {
        "type": "Quantized",
        "codes": codes,
        "bits": bits,
        "values": values,
        "scales": scales,
        "block": block,
        "shape": list(shape),
    }


def test_rebuild_reads_nf4_as_the_library_writes_it_and_counts_its_bits():
    w = torch.randn(5, 37, generator=torch.Generator().manual_seed(7))
    q = quant.quantize_nf4(w, block=16, double_quant=False)
    codes = quant.unpack_4bit(q.packed)
    values = quant.nf4_code_values().half()
    rebuilt, bits = reference.rebuild("w", _fields(codes, 4, values, q.absmax, 16, w.shape), tuple(w.shape))
    want = values.float()[codes.long()].reshape(-1, 16) * q.absmax[:, None]
    assert torch.equal(rebuilt, want.reshape(-1)[: w.numel()].reshape(w.shape))
    assert bits == 4 * codes.numel() + 16 * 16 + 32 * q.absmax.numel()
    # double quantization: the scales as 8-bit integers (no codebook) times a float16 step
    step = q.absmax.max() / 127
    scale_codes = (torch.round(q.absmax / step) + 127).to(torch.uint8)
    nested = _fields(scale_codes, 8, None, step.reshape(1).half(), q.absmax.numel(), q.absmax.shape)
    rebuilt, bits = reference.rebuild("w", _fields(codes, 4, values, nested, 16, w.shape), tuple(w.shape))
    scales = (scale_codes.double() - 127) * step.half().double()
    want = values.double()[codes.long()].reshape(-1, 16) * scales[:, None]
    assert torch.allclose(rebuilt, want.reshape(-1)[: w.numel()].reshape(w.shape).float())
    assert bits == 4 * codes.numel() + 16 * 16 + 8 * q.absmax.numel() + 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bits": 3}, "does not fit in 3 bits"),
        ({"values": torch.zeros(16)}, "dtype torch.float32, should be torch.float16"),
        ({"scales": torch.ones(12, dtype=torch.float64)}, "should be float16 or float32"),
        ({"block": 14}, "shape (192,), should be (196,)"),
        ({"shape": [5, 36]}, "should be [5, 37]"),
        ({"scales": "missing"}, "missing"),
    ],
)
def test_rebuild_refuses_what_the_format_does_not_say(change, message):
    codes = torch.full((12 * 16,), 15, dtype=torch.uint8)
    fields = {
        **_fields(codes, 4, torch.zeros(16, dtype=torch.float16), torch.ones(12), 16, (5, 37)),
        **change,
    }
    with pytest.raises(AssertionError, match=re.escape(message)):
        reference.rebuild("w", fields, (5, 37))


def test_the_measured_check_counts_bits_and_bounds_the_perplexity():
    """On the course's decoder: the solution's format is within the bound at 3.883 bits; two bits
    everywhere is not; a name left out fails."""
    inference = solution()
    weights = workers.linear_weights()
    check = reference.quantizer_check("quantize_model")

    def report(formats):
        return {"formats": {name: workers._format(q) for name, q in formats.items()}}

    formats = inference.quantize_model({name: w.clone() for name, w in weights.items()})
    assert check(report(formats)) == 3.8828125  # 3,053,568 bits / 786,432 weights
    assert table.QUANTIZER_TIERS.outcome(3.8828125, 8).fraction == 1.0
    two_bits = {}
    for name, w in weights.items():
        blocks = w.reshape(-1, 64)
        scale = blocks.abs().amax(dim=1)
        codes = torch.round(blocks / scale[:, None] * 1.5 + 1.5).clamp(0, 3).to(torch.uint8)
        values = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0]).half()
        two_bits[name] = inference.Quantized(codes.reshape(-1), 2, values, scale.half(), 64, tuple(w.shape))
    with pytest.raises(AssertionError, match="the bound is \\+1%"):
        check(report(two_bits))
    formats.pop(next(iter(formats)))
    with pytest.raises(AssertionError, match="missing"):
        check(report(formats))
