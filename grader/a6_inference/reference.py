"""The trusted side of assignment 6's hidden tests: the formats and the decoder computed again, and
the checks.

Nothing here runs next to student code, and nothing here uses the library's quantization or
generation (``minidist.quant``, ``minidist.models.generate``) or the solution: int8 and NF4 are
written again from their definitions (``tests/grader/test_grade_a6.py`` checks them against
``minidist.quant``, the library's tested implementation), and attention is recomputed over the
whole sequence every time -- no cache -- so that a bug in a cache is never graded as right.

Each ``*_check`` returns a function of the worker's report (read back as data) that raises
``AssertionError`` with a message a student may read: it names what differs and by how much,
never the expected value.
"""

from __future__ import annotations

import functools
import math
import threading

import torch
from torch import nn
from torch.nn import functional as F

from . import workers

#: the 16 NF4 values (QLoRA's table, float32), written out again here
NF4 = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ]
)
TIE = 1e-5  # a weight this close to the middle of two codes (or of two int8 steps) may take either


# --- helpers -------------------------------------------------------------------------------------
def _tensor(what: str, got, dtype: torch.dtype | None = None, shape=None) -> torch.Tensor:
    if not torch.is_tensor(got):
        raise AssertionError(
            f"{what}: got {got if isinstance(got, str) else type(got).__name__}, not a tensor"
        )
    if dtype is not None and got.dtype != dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, should be {dtype}")
    if shape is not None and tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, should be {tuple(shape)}")
    return got


def _close(what: str, got, want: torch.Tensor, atol: float, rtol: float) -> None:
    got = _tensor(what, got, shape=want.shape).to(want.dtype)
    if not torch.allclose(got, want, atol=atol, rtol=rtol):
        bad = ~torch.isclose(got, want, atol=atol, rtol=rtol)
        diff = float((got - want).abs().nan_to_num(float("inf")).max())
        raise AssertionError(
            f"{what}: differs from the reference by up to {diff:.3g} "
            f"({int(bad.sum())} of {want.numel()} elements differ)"
        )


# --- int8 ------------------------------------------------------------------------------------------
def int8_reference(w: torch.Tensor):
    """Codes, scales (float32, per row) and where a code may be one off (a half step, rounding)."""
    w = w.float()
    scale = w.abs().amax(dim=-1, keepdim=True) / 127
    ratio = w.double() / torch.where(scale == 0, torch.ones_like(scale), scale).double()
    codes = torch.round(ratio).clamp(-127, 127)
    tie = ((ratio - ratio.floor()) - 0.5).abs() < TIE
    return codes.to(torch.int8), scale, tie


def int8_quantize_check(what: str, spec: dict):
    def check(report: dict) -> None:
        w = workers.weights(spec)
        codes, scale, tie = int8_reference(w)
        got = _tensor(f"{what}: the codes", report["codes"], torch.int8, w.shape).long()
        got_scale = _tensor(f"{what}: the scale", report["scale"], torch.float32, scale.shape)
        _close(f"{what}: the scale (one per row, max |w| / 127)", got_scale, scale, atol=1e-12, rtol=1e-6)
        wrong = (got != codes.long()) & ~(tie & ((got - codes.long()).abs() == 1))
        if wrong.any():
            raise AssertionError(
                f"{what}: {int(wrong.sum())} of {w.numel()} codes differ from round(w / scale), "
                f"clamped to [-127, 127] (by up to {int((got - codes.long()).abs().max())})"
            )

    return check


def int8_memory_check(what: str, spec: dict):
    def check(report: dict) -> None:
        shape = spec["shape"]
        rows = math.prod(shape[:-1])
        want = math.prod(shape) + 4 * rows
        _memory(what, report["stored"], want, f"{math.prod(shape)} int8 codes + {rows} float32 scales")

    return check


def _memory(what: str, stored: dict, want: int, layout: str) -> None:
    if stored["bytes"] != want:
        found = ", ".join(
            f"{path} ({dtype}, {numel} elements, {nbytes} bytes of storage)"
            for path, dtype, numel, nbytes in stored["tensors"]
        )
        raise AssertionError(
            f"{what}: the quantized tensor holds {stored['bytes']} bytes, the format {want} "
            f"({layout}); found {found or 'no tensor'}"
        )


def int8_dequantize_check(what: str, spec: dict):
    def check(report: dict) -> None:
        codes, scale = workers.int8_codes(spec)
        out = _tensor(f"{what}: the output", report["out"], torch.float32, codes.shape)
        _close(f"{what}: codes * scale", out, codes.float() * scale, atol=1e-9, rtol=1e-6)

    return check


# --- 4-bit packing ---------------------------------------------------------------------------------
def pack(codes: torch.Tensor) -> torch.Tensor:
    """Code 2i in the high four bits of byte i, code 2i+1 in the low four."""
    flat = codes.reshape(-1).long()
    return (flat[0::2] * 16 + flat[1::2]).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1).long()
    return torch.stack([flat // 16, flat % 16], dim=1).reshape(-1)


def pack_check(what: str, spec: dict):
    def check(report: dict) -> None:
        codes = workers.nibble_codes(spec)
        packed = _tensor(f"{what}: pack_4bit's output", report["packed"], torch.uint8)
        if packed.numel() != spec["n"] // 2:
            raise AssertionError(f"{what}: pack_4bit gave {packed.numel()} bytes for {spec['n']} codes")
        if not torch.equal(packed.reshape(-1), pack(codes)):
            wrong = int((packed.reshape(-1) != pack(codes)).sum())
            raise AssertionError(
                f"{what}: {wrong} of {packed.numel()} bytes differ "
                "(code 2i goes in the high four bits of byte i)"
            )
        unpacked = _tensor(f"{what}: unpack_4bit's output", report["unpacked"])
        want = unpack(workers.random_bytes(spec, spec["n"] // 2))
        if unpacked.numel() != want.numel() or unpacked.is_floating_point():
            raise AssertionError(
                f"{what}: unpack_4bit gave {unpacked.numel()} {unpacked.dtype} values "
                f"for {want.numel()} codes"
            )
        if not torch.equal(unpacked.reshape(-1).long(), want):
            wrong = int((unpacked.reshape(-1).long() != want).sum())
            raise AssertionError(f"{what}: unpack_4bit: {wrong} of {want.numel()} codes differ")

    return check


# --- NF4 -----------------------------------------------------------------------------------------------
def nf4_reference(w: torch.Tensor, block: int):
    """Per weight (padded to whole blocks): the nearest code, the second nearest where the two are
    within ``TIE`` of each other (else the same), and the block absmax (float32)."""
    flat = w.reshape(-1).float()
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)])
    blocks = flat.reshape(-1, block)
    absmax = blocks.abs().amax(dim=1)
    normed = (
        blocks.double() / torch.where(absmax == 0, torch.ones_like(absmax), absmax).double()[:, None]
    ).reshape(-1)
    distance = (normed[:, None] - NF4.double()[None]).abs()
    order = distance.argsort(dim=1)
    nearest, second = order[:, 0], order[:, 1]
    tie = (distance.gather(1, second[:, None]) - distance.gather(1, nearest[:, None]))[:, 0] < TIE
    return nearest, torch.where(tie, second, nearest), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, block: int, n: int) -> torch.Tensor:
    return (NF4[codes.long()].reshape(-1, block) * absmax.float()[:, None]).reshape(-1)[:n]


def nf4_sizes(spec: dict) -> tuple[int, int]:
    n = math.prod(spec["shape"])
    return n, -(-n // spec["block"])


def nf4_quantize_check(what: str, spec: dict):
    def check(report: dict) -> None:
        n, blocks = nf4_sizes(spec)
        block = spec["block"]
        if report["shape"] != list(spec["shape"]) or report["block"] != block:
            raise AssertionError(
                f"{what}: the NF4Weight says shape {report['shape']}, block {report['block']}; "
                f"the tensor had shape {tuple(spec['shape'])}, block {block}"
            )
        nearest, either, absmax = nf4_reference(workers.weights(spec), block)
        scales = _tensor(f"{what}: the scales", report["scales"], torch.float32)
        if scales.numel() != blocks:
            raise AssertionError(f"{what}: {scales.numel()} scales for {blocks} blocks of {block}")
        _close(f"{what}: the scales (max |w| per block)", scales.reshape(-1), absmax, atol=1e-12, rtol=1e-6)
        packed = _tensor(f"{what}: the packed codes", report["packed"], torch.uint8)
        if packed.numel() != blocks * block // 2:
            raise AssertionError(
                f"{what}: {packed.numel()} packed bytes for {n} weights in {blocks} blocks of {block}"
            )
        got = unpack(packed)[:n]
        wrong = (got != nearest[:n]) & (got != either[:n])
        if wrong.any():
            raise AssertionError(
                f"{what}: {int(wrong.sum())} of {n} codes (unpacked with code 2i in the high four "
                "bits of byte i) are not the nearest NF4 value to w / absmax"
            )

    return check


def nf4_memory_check(what: str, spec: dict):
    def check(report: dict) -> None:
        n, blocks = nf4_sizes(spec)
        want = blocks * spec["block"] // 2 + 4 * blocks
        codes = want - 4 * blocks
        layout = f"{blocks} blocks of {spec['block']}: {codes} bytes of codes + {blocks} float32 scales"
        _memory(what, report["stored"], want, layout)

    return check


def nf4_dequantize_check(what: str, spec: dict):
    def check(report: dict) -> None:
        packed, scales = workers.nf4_stored(spec)
        n = math.prod(spec["shape"])
        want = dequantize(unpack(packed), scales, spec["block"], n).reshape(spec["shape"])
        out = _tensor(f"{what}: the output", report["out"], torch.float32, want.shape)
        _close(f"{what}: NF4_VALUES[code] * scale", out, want, atol=1e-7, rtol=1e-6)

    return check


def nf4_round_trip_check(what: str, spec: dict):
    def check(report: dict) -> None:
        w = workers.weights(spec)
        n, block = w.numel(), spec["block"]
        nearest, either, absmax = nf4_reference(w, block)
        one, other = dequantize(nearest, absmax, block, n), dequantize(either, absmax, block, n)
        out = _tensor(f"{what}: the output", report["out"], torch.float32, w.shape).reshape(-1)
        fine = torch.isclose(out, one, atol=1e-7, rtol=1e-6) | torch.isclose(out, other, atol=1e-7, rtol=1e-6)
        if not fine.all():
            raise AssertionError(
                f"{what}: dequantize_nf4(quantize_nf4(w)) differs from the values the 4-bit codes hold "
                f"in {int((~fine).sum())} of {n} weights (by up to {float((out - one).abs().max()):.3g}); "
                f"its error from w is {float((out - w.reshape(-1)).abs().max()):.3g}, NF4's "
                f"{float((one - w.reshape(-1)).abs().max()):.3g}"
            )

    return check


# --- attention and the decoder, recomputed over the whole sequence -----------------------------------
def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = t.shape
    return t.reshape(b, n, heads, d // heads).transpose(1, 2)


def causal_attention(x: torch.Tensor, w: dict, layer: int, heads: int):
    """Attention over every token of x (B, T, d) at once: output, keys and values."""
    q, k, v = (
        split_heads(F.linear(x, w[f"{layer}.{n}.weight"], w[f"{layer}.{n}.bias"]), heads) for n in "qkv"
    )
    t = x.shape[1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    mixed = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(x.shape)
    return F.linear(mixed, w[f"{layer}.o.weight"], w[f"{layer}.o.bias"]), k, v


def logits(spec: dict, w: dict, ids: torch.Tensor) -> torch.Tensor:
    """The decoder on the whole sequence ``ids`` (B, T): logits (B, T, vocab)."""
    d = spec["d"]
    x = w["word"][ids] + w["position"][: ids.shape[1]][None]
    for i in range(spec["layers"]):
        h = F.layer_norm(x, (d,), w[f"{i}.norm1.weight"], w[f"{i}.norm1.bias"])
        x = x + causal_attention(h, w, i, spec["heads"])[0]
        h = F.layer_norm(x, (d,), w[f"{i}.norm2.weight"], w[f"{i}.norm2.bias"])
        h = F.gelu(F.linear(h, w[f"{i}.up.weight"], w[f"{i}.up.bias"]))
        x = x + F.linear(h, w[f"{i}.down.weight"], w[f"{i}.down.bias"])
    x = F.layer_norm(x, (d,), w["norm.weight"], w["norm.bias"])
    return F.linear(x, w["head.weight"], w["head.bias"])


def greedy(spec: dict) -> torch.Tensor:
    """Greedy generation, the whole sequence recomputed at every step."""
    w, ids = workers.decoder_weights(spec), workers.prompt(spec)
    for _ in range(spec["new_tokens"]):
        ids = torch.cat([ids, logits(spec, w, ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def attention_check(what: str, spec: dict):
    def check(report: dict) -> None:
        w, x, p = workers.decoder_weights(spec), workers.attention_input(spec), spec["past"]
        out, k, v = causal_attention(x, w, 0, spec["heads"])
        _close(f"{what}: the output for the new tokens", report["out"], out[:, p:], atol=1e-9, rtol=1e-7)
        _close(f"{what}: the keys returned (past ++ new)", report["k"], k, atol=1e-9, rtol=1e-7)
        _close(f"{what}: the values returned (past ++ new)", report["v"], v, atol=1e-9, rtol=1e-7)

    return check


def attention_cache_check(what: str, spec: dict):
    """The projections saw the new tokens only (once each), and the past keys and values come back
    first, unchanged."""

    def check(report: dict) -> None:
        new = spec["batch"] * spec["new"]
        for name in workers.PROJECTIONS:
            calls = [rows for _, n, rows in report["seen"] if n == name]
            if calls != [new]:
                raise AssertionError(
                    f"{what}: the {name} projection was called on {calls} tokens; with a cache it "
                    f"gets the {spec['batch']} x {spec['new']} new tokens once"
                )
        w, x, p = workers.decoder_weights(spec), workers.attention_input(spec), spec["past"]
        past = workers.past_kv(spec, w, x)
        for index, name in enumerate(("keys", "values")):
            got = _tensor(f"{what}: the {name}", report[("k", "v")[index]])
            if got.dim() != 4 or got.shape[2] != p + spec["new"]:
                raise AssertionError(
                    f"{what}: the {name} returned have shape {tuple(got.shape)}: "
                    "the cache must grow by the new tokens"
                )
            _close(
                f"{what}: the past {name} at the front of the cache",
                got[:, :, :p],
                past[index],
                atol=1e-12,
                rtol=0,
            )

    return check


def generate_check(what: str, spec: dict):
    def check(report: dict) -> None:
        want = greedy(spec)
        got = _tensor(f"{what}: the tokens", report["ids"], shape=want.shape)
        if got.is_floating_point() or not torch.equal(got.long(), want):
            first = int((got.long() != want).any(0).nonzero()[0]) if not got.is_floating_point() else 0
            raise AssertionError(
                f"{what}: the tokens differ from greedy decoding of the whole sequence, "
                f"first at position {first}"
            )

    return check


def cache_use_check(what: str, spec: dict):
    """Right tokens, and every projection of every layer saw the prompt once and then one token per
    sequence per step: O(1) projections per new token, not the whole sequence again."""

    def check(report: dict) -> None:
        generate_check(what, spec)(report)
        b, n = spec["batch"], spec["new_tokens"]
        for layer in range(spec["layers"]):
            for name in workers.PROJECTIONS:
                calls = [rows for i, nm, rows in report["seen"] if i == layer and nm == name]
                ok = len(calls) in (n, n + 1) and calls[:1] == [b * spec["prompt"]] and set(calls[1:]) <= {b}
                if not ok:
                    shown = calls if len(calls) <= 12 else calls[:12] + ["..."]
                    raise AssertionError(
                        f"{what}: layer {layer}'s {name} projection saw {shown} tokens per call; with a "
                        f"cache it sees the prompt ({b} x {spec['prompt']}) once, then {b} (one new token "
                        f"per sequence) at each of the {n - 1} later steps"
                    )

    return check


# --- task 4: the student's format on the course's decoder ------------------------------------------
#: held-out text: the first blocks of the course's eval split (lecture 9 section 2), 128 tokens each
EVAL_BLOCKS, SEQ_LEN = 16, 128
#: the bound on the perplexity, relative to the decoder with its linear weights in fp16
PERPLEXITY_BOUND = 0.01
SCALE_DTYPES = {torch.float16: 16, torch.float32: 32}
#: the grader checks submissions in threads (``grade.py``): one decoder, its weights set per check
DECODER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def course_decoder():
    """The shipped decoder, its held-out blocks and its perplexity with fp16 linear weights."""
    from minidist import data
    from minidist.models import pretrained

    torch.manual_seed(0)
    model, tok = pretrained.load("course")
    blocks = data.lm_dataset(tok, SEQ_LEN, "eval")[:EVAL_BLOCKS].clone()
    linears = {
        f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, nn.Linear)
    }
    originals = {name: module.weight.detach().clone() for name, module in linears.items()}
    fp16 = perplexity_with(model, linears, {name: w.half().float() for name, w in originals.items()}, blocks)
    return model, linears, originals, blocks, fp16


@torch.no_grad()
def perplexity_with(model, linears: dict, weights: dict, blocks: torch.Tensor) -> float:
    from minidist.models import pretrained

    for name, module in linears.items():
        module.weight.copy_(weights[name])
    return pretrained.perplexity(model, blocks=blocks)


def rebuild(what: str, fields, shape: tuple[int, ...], depth: int = 0) -> tuple[torch.Tensor, int]:
    """The weights of one ``Quantized`` (float32, ``shape``) rebuilt by the grader from its fields,
    and the bits they take: codes x bits, 16 per code value, the scales' (recursively)."""
    if not isinstance(fields, dict):
        raise AssertionError(f"{what}: {fields if isinstance(fields, str) else type(fields).__name__}")
    for name in ("bits", "block"):
        if not isinstance(fields.get(name), int):
            raise AssertionError(f"{what}.{name}: {fields.get(name)}")
    bits, block = fields["bits"], fields["block"]
    if not 1 <= bits <= 8 or block < 1:
        raise AssertionError(f"{what}: bits {bits} (1 to 8) and block {block} (at least 1)")
    if fields.get("shape") != list(shape):
        raise AssertionError(f"{what}.shape: {fields.get('shape')}, should be {list(shape)}")
    n = math.prod(shape)
    blocks = -(-n // block)
    codes = _tensor(f"{what}.codes", fields.get("codes"), torch.uint8, (blocks * block,)).long()
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise AssertionError(f"{what}.codes: a code of {int(codes.max())} does not fit in {bits} bits")
    if fields.get("values") is None:
        values, stored = codes.double() - (2 ** (bits - 1) - 1), bits * codes.numel()
    else:
        table = _tensor(f"{what}.values", fields["values"], torch.float16, (2**bits,)).double()
        values, stored = table[codes], bits * codes.numel() + 16 * table.numel()
    scales = fields.get("scales")
    if torch.is_tensor(scales):
        if scales.dtype not in SCALE_DTYPES:
            raise AssertionError(f"{what}.scales: dtype {scales.dtype}, should be float16 or float32")
        scale = _tensor(f"{what}.scales", scales, shape=(blocks,)).double()
        stored += SCALE_DTYPES[scales.dtype] * blocks
    elif depth >= 3:
        raise AssertionError(f"{what}.scales: nested more than 3 deep")
    else:
        scale, scale_bits = rebuild(f"{what}.scales", scales, (blocks,), depth + 1)
        stored += scale_bits
    out = (values.reshape(blocks, block) * scale.double()[:, None]).reshape(-1)[:n].reshape(shape)
    if not torch.isfinite(out).all():
        raise AssertionError(f"{what}: the rebuilt weights are not all finite")
    return out.float(), stored


def quantizer_check(what: str):
    """Bits per weight of the student's format, if the decoder rebuilt from it stays within
    ``PERPLEXITY_BOUND`` of fp16's perplexity on the held-out blocks (else a failure)."""

    def check(report: dict) -> float:
        with DECODER_LOCK:
            return measure(report)

    def measure(report: dict) -> float:
        model, linears, originals, blocks, fp16 = course_decoder()
        formats = report.get("formats")
        if not isinstance(formats, dict):
            raise AssertionError(f"{what}: returned {formats}")
        if set(formats) != set(originals):
            missing, extra = sorted(set(originals) - set(formats)), sorted(set(formats) - set(originals))
            raise AssertionError(
                f"{what}: the names differ from the weights given: missing {missing}, extra {extra}"
            )
        weights, bits = {}, 0
        for name, w in originals.items():
            weights[name], stored = rebuild(f"{what}[{name!r}]", formats[name], tuple(w.shape))
            bits += stored
        per_weight = bits / sum(w.numel() for w in originals.values())
        quantized = perplexity_with(model, linears, weights, blocks)
        increase = quantized / fp16 - 1
        if not increase <= PERPLEXITY_BOUND:
            raise AssertionError(
                f"{what}: held-out perplexity {quantized:.3f}, {100 * increase:+.2f}% over fp16's "
                f"{fp16:.3f} (at {per_weight:.3f} bits a weight); the bound is +{100 * PERPLEXITY_BOUND:.0f}%"
            )
        return per_weight

    return check
