"""Quantization (``minidist.quant``): absmax int8, LLM.int8() decomposition, NF4, memory per format.

References: hand-computed codes, the NF4 table QLoRA/bitsandbytes publish, error bounds derived
from the scales, fp32 matmuls, and byte counts of the stored tensors (``memory.tensor_bytes``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minidist import memory, quant
from minidist.models.decoder import CONFIGS, DecoderLM, parameter_count
from minidist.models.transformer import TransformerConfig

# QLoRA, Appendix E / bitsandbytes' NF4 table (the published float32 values).
PUBLISHED_NF4 = [
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


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# absmax int8
# ---------------------------------------------------------------------------------------------


def test_int8_known_values_per_row_and_per_column():
    codes, scale = quant.quantize_absmax_int8(torch.tensor([[0.5, -2.54, 1.0]]), dim=-1)
    assert torch.allclose(scale, torch.tensor([[0.02]]))
    assert codes.dtype == torch.int8 and codes.tolist() == [[25, -127, 50]]

    m = torch.tensor([[1.5, -4.0], [2.0, 0.5]])
    codes, scale = quant.quantize_absmax_int8(m, dim=0)  # one scale per column: 2/127, 4/127
    assert torch.allclose(scale, torch.tensor([[2 / 127, 4 / 127]]))
    # 1.5 * 127/2 = 95.25 -> 95;  0.5 * 127/4 = 15.875 -> 16
    assert codes.tolist() == [[95, -127], [127, 16]]
    assert torch.allclose(
        quant.dequantize_absmax_int8(codes, scale), torch.tensor([[95 * 2 / 127, -4.0], [2.0, 16 * 4 / 127]])
    )


@pytest.mark.parametrize("dim", [0, -1])
def test_int8_round_trip_within_half_a_step(dim):
    w = torch.randn(16, 24, generator=generator(1)) * torch.rand(16, 1, generator=generator(2)) * 5
    codes, scale = quant.quantize_absmax_int8(w, dim=dim)
    err = (quant.dequantize_absmax_int8(codes, scale) - w).abs()
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert codes.abs().max() == 127  # the absmax of every slice lands on ±127
    neg_codes, _ = quant.quantize_absmax_int8(-w, dim=dim)
    assert torch.equal(neg_codes, -codes)  # symmetric: -128 never used


def test_int8_zero_row_gets_zero_scale():
    w = torch.zeros(2, 3)
    w[1] = torch.tensor([1.0, -2.0, 0.5])
    codes, scale = quant.quantize_absmax_int8(w, dim=-1)
    assert scale[0].item() == 0 and codes[0].abs().sum() == 0
    assert torch.allclose(quant.dequantize_absmax_int8(codes, scale)[0], torch.zeros(3))


def test_int8_matmul_within_bound_from_scales():
    x = torch.randn(6, 40, generator=generator(3))
    w = torch.randn(40, 10, generator=generator(4))
    y = quant.int8_matmul(x, w)
    exact = x.double() @ w.double()
    # independent reference: the dequantized operands multiplied in float64 (integer sums exact)
    xq, sx = quant.quantize_absmax_int8(x, dim=-1)
    wq, sw = quant.quantize_absmax_int8(w, dim=0)
    assert torch.allclose(y.double(), (xq.double() * sx) @ (wq.double() * sw), rtol=1e-5, atol=1e-5)
    # bound: x = xq sx + ex (|ex| <= sx/2), w = wq sw + ew (|ew| <= sw/2)
    #   |x w - xq sx wq sw| <= sx/2 * sum|w| + sw/2 * sum(|x| + sx/2)
    bound = sx / 2 * w.abs().sum(0, keepdim=True) + sw / 2 * (x.abs() + sx / 2).sum(1, keepdim=True)
    err = (y.double() - exact).abs()
    assert (err <= bound.double() + 1e-5).all()
    assert err.max() > 0  # it is an approximation, not fp32 itself
    # 3-d inputs: leading dims are kept
    assert torch.allclose(quant.int8_matmul(x.reshape(2, 3, 40), w), y.reshape(2, 3, 10))


def test_mixed_decomposition_rescues_outlier_features():
    x = torch.randn(32, 64, generator=generator(5))
    w = torch.randn(64, 16, generator=generator(6)) / 8
    planted = [7, 41]
    x[:, planted] *= 40  # systematic outlier features, as in LLM.int8()'s large models
    assert quant.outlier_columns(x, threshold=6.0).tolist() == planted
    exact = x @ w
    err_int8 = (quant.int8_matmul(x, w) - exact).abs().mean()
    err_mixed = (quant.mixed_int8_matmul(x, w, threshold=6.0) - exact).abs().mean()
    assert err_mixed < err_int8 / 10
    # bf16 outlier part: still far better than plain int8
    err_bf16 = (quant.mixed_int8_matmul(x, w, outlier_dtype=torch.bfloat16) - exact).abs().mean()
    assert err_bf16 < err_int8 / 5
    # without outliers the decomposition is plain int8
    clean = torch.randn(8, 64, generator=generator(7))
    assert torch.equal(quant.mixed_int8_matmul(clean, w), quant.int8_matmul(clean, w))


# ---------------------------------------------------------------------------------------------
# NF4
# ---------------------------------------------------------------------------------------------


def test_nf4_values_match_published_table():
    values = quant.nf4_code_values()
    assert values.shape == (16,) and torch.all(values[1:] > values[:-1])
    assert values[7] == 0 and values[0] == -1 and values[15] == 1
    assert (values > 0).sum() == 8 and (values < 0).sum() == 7
    assert torch.allclose(values, torch.tensor(PUBLISHED_NF4), atol=1e-6, rtol=0)


def test_pack_4bit_order():
    codes = torch.tensor([3, 12, 7, 0])
    packed = quant.pack_4bit(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x3C, 0x70]  # first code: high nibble
    assert quant.unpack_4bit(packed).tolist() == [3, 12, 7, 0]
    with pytest.raises(ValueError, match="even"):
        quant.pack_4bit(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="0, 15"):
        quant.pack_4bit(torch.tensor([1, 16]))


def test_nf4_known_block():
    w = torch.tensor([0.2, -0.8, 0.4, 0.05])
    q = quant.quantize_nf4(w, block=4, double_quant=False)
    # by hand: w / 0.8 = [0.25, -1, 0.5, 0.0625]; nearest NF4 values 0.2461 (10), -1 (0),
    # 0.4407 (12; 0.5 is below the midpoint 0.5017 with 0.5626), 0.0796 (8; above 0.0398)
    assert quant.unpack_4bit(q.packed).tolist() == [10, 0, 12, 8]
    assert q.packed.tolist() == [10 << 4 | 0, 12 << 4 | 8]
    assert torch.allclose(q.absmax, torch.tensor([0.8]))
    expected = torch.tensor([PUBLISHED_NF4[i] * 0.8 for i in (10, 0, 12, 8)])
    assert torch.allclose(quant.dequantize_nf4(q), expected, atol=1e-6)


def _max_half_gap() -> float:
    v = torch.tensor(PUBLISHED_NF4)
    return float((v[1:] - v[:-1]).max() / 2)  # (1 - 0.7230) / 2


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_round_trip_within_half_the_largest_gap(double_quant):
    w = torch.randn(12, 64, generator=generator(8)) * torch.linspace(0.01, 3, 12)[:, None]
    q = quant.quantize_nf4(w, block=64, double_quant=double_quant)
    back = quant.dequantize_nf4(q)
    assert back.shape == w.shape and back.dtype == w.dtype
    absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    bound = _max_half_gap() * absmax
    if double_quant:  # plus the error of the 8-bit block scale itself
        bound = bound + (quant.nf4_block_scales(q)[:, None] - absmax).abs()
        # QLoRA: the block scales are centred on their mean before the 8-bit step, so the step
        # is set by their spread, not by their size
        assert torch.allclose(q.absmax_mean, absmax.mean())
        spread = (absmax - absmax.mean()).abs().max()
        assert (quant.nf4_block_scales(q) - absmax.flatten()).abs().max() <= spread / 127 / 2 + 1e-6
    err = (back - w).reshape(-1, 64).abs()
    assert (err <= bound + 1e-6).all()


def test_nf4_pads_blocks_that_do_not_divide():
    w = torch.randn(3, 50, generator=generator(9), dtype=torch.bfloat16)
    q = quant.quantize_nf4(w, block=64)
    assert q.packed.numel() == 192 // 2  # 150 values padded to 3 blocks of 64
    back = quant.dequantize_nf4(q)
    assert back.shape == (3, 50) and back.dtype == torch.bfloat16
    blocks = torch.nn.functional.pad(w.float().flatten(), (0, 42)).reshape(3, 64)
    scales = quant.nf4_block_scales(q)
    bound = _max_half_gap() * blocks.abs().amax(1) + (scales - blocks.abs().amax(1)).abs()
    err = torch.nn.functional.pad((back.float() - w.float()).flatten(), (0, 42)).reshape(3, 64).abs()
    assert (err <= bound[:, None] + 0.01 * blocks.abs().amax(1)[:, None]).all()  # + bf16 rounding


def test_bad_input_errors():
    with pytest.raises(TypeError, match="floating-point"):
        quant.quantize_absmax_int8(torch.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        quant.quantize_nf4(torch.ones(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        quant.quantize_nf4(torch.ones(8), block=7)
    with pytest.raises(ValueError, match=r"\(4, 5\) and \(6, 2\)"):
        quant.int8_matmul(torch.ones(4, 5), torch.ones(6, 2))
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        quant.quantize_linear_weights(nn.Sequential(nn.Linear(4, 4)), "int4")
    with pytest.raises(ValueError, match="QuantizedLinear"):
        quant.quantize_linear_weights(nn.Linear(4, 4), "int8")
    with pytest.raises(TypeError, match="int8"):
        quant.dequantize_absmax_int8(torch.ones(3), torch.ones(1))


# ---------------------------------------------------------------------------------------------
# memory per format
# ---------------------------------------------------------------------------------------------


def test_bits_per_param_measured_from_stored_tensors():
    w = torch.randn(256, 256, generator=generator(10))
    plain = quant.quantize_nf4(w, double_quant=False)
    double = quant.quantize_nf4(w, double_quant=True)
    assert plain.nbytes == 256 * 256 // 2 + 1024 * 4  # codes + fp32 scale per 64 values
    assert plain.bits_per_param == pytest.approx(4.5)  # QLoRA: 4 + 32/64
    assert double.bits_per_param == pytest.approx(4.127, abs=1e-3)  # QLoRA: 4 + 8/64 + 32/(64*256)
    assert double.bits_per_param == pytest.approx(quant.bits_per_param("nf4"), abs=1e-3)
    assert plain.bits_per_param == pytest.approx(quant.bits_per_param("nf4", double_quant=False))

    linear = nn.Linear(256, 64, bias=False)
    held = {fmt: quant.QuantizedLinear(linear, fmt).weight_nbytes for fmt in ("fp32", "bf16", "int8", "nf4")}
    n = 256 * 64
    assert held["fp32"] == 4 * n and held["bf16"] == 2 * n
    assert held["int8"] == n + 64 * 4  # one fp32 scale per output row
    assert 8 * held["int8"] / n == pytest.approx(quant.bits_per_param("int8", row_length=256))
    assert 8 * held["nf4"] / n == pytest.approx(quant.bits_per_param("nf4"), abs=5e-3)


def test_bytes_for_176b():
    n = 176e9
    assert quant.bytes_for(n, "fp16") == pytest.approx(352e9)
    assert quant.bytes_for(n, "bf16") == pytest.approx(352e9)
    assert quant.bytes_for(n, "int8") == pytest.approx(176e9)
    assert quant.bytes_for(n, "nf4") == pytest.approx(88e9)
    assert quant.bytes_for(n, "nf4", with_scales=True) == pytest.approx(n * 4.127 / 8, rel=1e-3)
    assert quant.bytes_for(n, "nf4", with_scales=True, double_quant=False) == pytest.approx(n * 4.5 / 8)
    bloom = parameter_count(CONFIGS["bloom-176b"])
    assert round(quant.bytes_for(bloom, "fp16") / 1e9) == 352


# ---------------------------------------------------------------------------------------------
# quantized models
# ---------------------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_quantized_mlp_errors_ordered_and_bytes_drop():
    x = torch.randn(16, 64, generator=generator(11))
    reference = _mlp()(x)
    errors, held = {}, {}
    for fmt in ("fp32", "bf16", "int8", "nf4"):
        model = quant.quantize_linear_weights(_mlp(), fmt)
        assert all(not isinstance(m, nn.Linear) for m in model.modules())
        with torch.no_grad():
            errors[fmt] = _rel_err(model(x), reference)
        held[fmt] = memory.tensor_bytes(model)
    assert errors["fp32"] == 0
    assert 0 < errors["bf16"] < errors["int8"] < errors["nf4"]
    assert errors["bf16"] < 1e-2 and errors["int8"] < 3e-2 and errors["nf4"] < 0.15
    n_weights, n_bias = 64 * 128 + 128 * 32, 128 + 32
    assert held["fp32"] == 4 * (n_weights + n_bias)
    assert held["bf16"] == 2 * n_weights + 4 * n_bias
    assert held["int8"] == n_weights + 4 * (128 + 32) + 4 * n_bias  # + fp32 scale per output row
    nf4_weight_bytes = sum(m.weight_nbytes for m in model.modules() if isinstance(m, quant.QuantizedLinear))
    assert held["nf4"] == nf4_weight_bytes + 4 * n_bias
    # per weight: n/2 code bytes, the block scales as int8 padded to whole blocks of 256 (one
    # such block here), one fp32 scale per 256 block scales, one fp32 mean
    assert nf4_weight_bytes == sum(n // 2 + 256 + 4 + 4 for n in (64 * 128, 128 * 32))


def test_quantized_linear_int8_mixed_with_outlier_inputs():
    x = torch.randn(16, 64, generator=generator(12))
    x[:, [3, 30]] *= 40
    linear = _mlp()[0]
    plain_layer, mixed_layer = (
        quant.QuantizedLinear(linear, "int8"),
        quant.QuantizedLinear(linear, "int8-mixed"),
    )
    with torch.no_grad():
        reference = linear(x)
        plain, mixed = plain_layer(x), mixed_layer(x)
        # the same int8 weight, x kept in fp32: what is left is the error of quantizing x
        weight_only = nn.functional.linear(x, mixed_layer.dequantized_weight(), linear.bias)
    assert _rel_err(mixed, weight_only) < _rel_err(plain, weight_only) / 10
    assert _rel_err(mixed, reference) < _rel_err(plain, reference) / 3


def _reference_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The stored weight of each format, rebuilt here from its definition (not via quant)."""
    if fmt == "bf16":
        return w.to(torch.bfloat16).float()
    if fmt in ("int8", "int8-mixed"):  # absmax per output row, 127 steps each side
        step = w.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(w / step) * step
    assert fmt == "nf4"  # blocks of 64 (row-major), nearest published NF4 value times the block absmax
    table = torch.tensor(PUBLISHED_NF4)
    blocks = w.reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    nearest = (blocks / absmax)[..., None].sub(table).abs().argmin(dim=-1)
    return (table[nearest] * absmax).reshape(w.shape)


# How far grad_x = grad_y W_stored may be from grad_y W (relative norm), per format. nn.Linear's
# weights are uniform in [-a, a] (rms a/sqrt(3)):
#   int8  rounding to steps of absmax/127 leaves errors uniform in +-step/2 (rms step/sqrt(12)),
#         relative to the weights 1/(2*127) = 0.0039 (measured 0.0040): bound 0.008
#   bf16  8 significant bits: each weight within 2^-9 of itself, relatively (measured 0.0014)
#   nf4   16 levels per block of 64, at most 0.139 * absmax off (measured 0.091): bound 0.12
GRAD_BOUND = {"int8": 0.008, "int8-mixed": 0.008, "bf16": 2**-9, "nf4": 0.12}


@pytest.mark.parametrize("fmt", ["int8", "int8-mixed", "nf4", "bf16"])
def test_gradient_flows_to_the_input_through_frozen_quantized_weights(fmt):
    # adapters trained on top of a quantized model (QLoRA, Petals) need grad_x = grad_y W
    linear = _mlp()[0]
    layer = quant.QuantizedLinear(linear, fmt)
    x = torch.randn(8, 64, generator=generator(16))
    x[:, 5] *= 30
    x.requires_grad_(True)
    grad_y = torch.randn(8, 128, generator=generator(17))
    layer(x).backward(grad_y)
    w = linear.weight.detach()
    expected = grad_y @ _reference_weight(w, fmt)
    # int8 and bf16 are rebuilt exactly; NF4's block scales are themselves quantized to 8 bits
    # (double quantization), which the reference leaves out: a relative 1e-3 of slack
    assert _rel_err(x.grad, expected) < (1e-3 if fmt == "nf4" else 1e-6)
    assert _rel_err(x.grad, grad_y @ w) < GRAD_BOUND[fmt]
    assert all(not t.requires_grad for t in layer.parameters())


def test_every_input_feature_an_outlier():
    # a low threshold makes every column of x an outlier: no int8 part is left to compute
    x = torch.randn(4, 8, generator=generator(18)) * 10
    w = torch.randn(8, 3, generator=generator(19))
    assert len(quant.outlier_columns(x, threshold=1.0)) == 8
    y = quant.mixed_int8_matmul(x, w, threshold=1.0)  # all in x's precision: x @ w
    assert torch.allclose(y, x @ w, rtol=1e-5, atol=1e-4)
    linear = nn.Linear(8, 3)
    layer = quant.QuantizedLinear(linear, "int8-mixed", threshold=1.0)
    with torch.no_grad():
        expected = nn.functional.linear(x, _reference_weight(linear.weight, "int8"), linear.bias)
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_quantized_decoder_close_to_fp32():
    cfg = TransformerConfig(
        vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, max_positions=16, causal=True, pre_ln=True
    )
    torch.manual_seed(0)
    dense = DecoderLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 12), generator=generator(13))
    with torch.no_grad():
        reference = dense(ids).logits
    errors = {}
    for fmt in ("bf16", "int8", "nf4"):
        torch.manual_seed(0)
        model = quant.quantize_linear_weights(DecoderLM(cfg).eval(), fmt)
        with torch.no_grad():
            errors[fmt] = _rel_err(model(ids).logits, reference)
        assert memory.tensor_bytes(model) < memory.tensor_bytes(dense)
    assert errors["bf16"] < errors["int8"] < errors["nf4"] < 0.2


def test_cuda_tensors_match_cpu():
    w = torch.randn(64, 128, generator=generator(14))
    x = torch.randn(8, 128, generator=generator(15))
    q_cpu, q_gpu = quant.quantize_nf4(w), quant.quantize_nf4(w.cuda())
    assert torch.equal(q_gpu.packed.cpu(), q_cpu.packed)
    assert torch.allclose(quant.dequantize_nf4(q_gpu).cpu(), quant.dequantize_nf4(q_cpu))
    assert torch.allclose(quant.int8_matmul(x.cuda(), w.T.cuda()).cpu(), quant.int8_matmul(x, w.T), atol=1e-5)
    layer = quant.QuantizedLinear(nn.Linear(128, 64), "int8-mixed").cuda()
    assert layer(x.cuda()).device.type == "cuda"
