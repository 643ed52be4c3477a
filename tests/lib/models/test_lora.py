"""LoRA and prompt tuning (``minidist.models.lora``).

References: the dense update W + s·B A formed explicitly, ``F.linear``, the unadapted model,
parameter counts of the built modules against the formula, the plain decoder fed real tokens
(for a prompt equal to their embeddings), and hand-computed BLOOM-176B byte counts.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiny
from minidist import quant
from minidist.models import lora
from minidist.models.decoder import CONFIGS, DecoderLM, parameter_count
from minidist.models.transformer import TransformerConfig
from tiny import tiny_config

TINY = tiny_config(causal=True, pre_ln=True, embedding_layernorm=False, layer_norm_eps=1e-5)


def tiny_decoder(seed: int = 0, cfg: TransformerConfig = TINY) -> DecoderLM:
    return tiny.tiny_decoder(seed, cfg)


def ids(batch: int = 3, seq: int = 12, seed: int = 1, vocab: int = TINY.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model: nn.Module, seed: int = 5) -> None:
    """Give every B a non-zero value (as after training), so the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALinear):
                m.B.copy_(torch.randn(m.B.shape, generator=g) * 0.1)


# ------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------


def test_lora_delta_equals_the_dense_low_rank_update():
    g = torch.Generator().manual_seed(0)
    x, A, B = (
        torch.randn(2, 5, 16, generator=g),
        torch.randn(4, 16, generator=g),
        torch.randn(24, 4, generator=g),
    )
    dense = 0.5 * (B @ A)  # (out, in), formed explicitly
    torch.testing.assert_close(lora.lora_delta(x, A, B, 0.5), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_lora_delta_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="same rank"):
        lora.lora_delta(torch.randn(2, 16), torch.randn(4, 16), torch.randn(24, 3), 1.0)
    with pytest.raises(ValueError, match="features"):
        lora.lora_delta(torch.randn(2, 15), torch.randn(4, 16), torch.randn(24, 4), 1.0)


def test_lora_linear_starts_as_the_base_and_computes_w_plus_sba():
    torch.manual_seed(0)
    base = nn.Linear(16, 24)
    layer = lora.LoRALinear(base, rank=4, alpha=8.0)
    x = torch.randn(3, 7, 16)
    assert torch.equal(layer(x), base(x))  # B = 0: exactly the base, not just close
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert layer.A.requires_grad and layer.B.requires_grad and layer.scale == 2.0
    # A ~ N(0, 1/in): its empirical variance times in is near 1 (64 samples; loose bound).
    assert 0.4 < layer.A.var().item() * 16 < 2.0
    with torch.no_grad():
        layer.B.normal_()
    expected = F.linear(x, base.weight + 2.0 * layer.B @ layer.A, base.bias)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_lora_linear_refuses_bad_rank_and_non_linear():
    with pytest.raises(ValueError, match="rank"):
        lora.LoRALinear(nn.Linear(16, 8), rank=9)
    with pytest.raises(TypeError, match="nn.Linear"):
        lora.LoRALinear(nn.Conv1d(4, 4, 1))


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_lora_trains_through_a_quantized_base(fmt):
    torch.manual_seed(0)
    q = quant.QuantizedLinear(nn.Linear(64, 32), fmt)
    frozen = {n: b.clone() for n, b in q.named_buffers()}
    layer = lora.LoRALinear(q, rank=4)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(5, 64, requires_grad=True)
    y = layer(x)
    # the frozen base's output plus the update s·BA as a dense matrix (not via lora_delta); the
    # base stays a separate term because int8 also quantizes x, so it is not F.linear(x, W)
    delta = layer.scale * layer.B.detach() @ layer.A.detach()
    torch.testing.assert_close(y, q(x) + F.linear(x, delta), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert layer.A.grad is not None and layer.B.grad is not None and x.grad is not None
    assert layer.A.grad.abs().sum() > 0 and layer.B.grad.abs().sum() > 0
    assert all(torch.equal(b, frozen[n]) for n, b in q.named_buffers())
    assert not any(p.requires_grad for p in q.parameters())


# ------------------------------------------------------------------------------------------
# A model
# ------------------------------------------------------------------------------------------


def test_apply_lora_replaces_every_target_freezes_the_rest_and_starts_unchanged():
    model = tiny_decoder()
    x = ids()
    before = model(x).logits
    names = lora.apply_lora(model, targets=("query", "value"), rank=4, alpha=8.0)
    expected = [
        f"transformer.blocks.{i}.attention.{t}" for i in range(TINY.n_layers) for t in ("query", "value")
    ]
    assert names == expected
    assert all(isinstance(model.get_submodule(n), lora.LoRALinear) for n in names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{n}.{ab}" for n in names for ab in ("A", "B")]
    assert torch.equal(model(x).logits, before)


@pytest.mark.parametrize(
    "targets, rank", [(("query", "value"), 4), (("query", "key", "value", "output"), 2), (("up", "down"), 8)]
)
def test_lora_parameter_count_formula_matches_the_built_model(targets, rank):
    model = tiny_decoder()
    lora.apply_lora(model, targets=targets, rank=rank)
    trainable, total = lora.parameter_counts(model)
    n = lora.lora_parameter_count(TINY, rank, targets)
    assert trainable == n
    assert total == parameter_count(TINY) + n
    assert lora.trainable_fraction(model) == pytest.approx(n / (parameter_count(TINY) + n))


def test_lora_parameter_count_of_bloom_on_the_meta_device():
    cfg = CONFIGS["bloom-176b"]
    with torch.device("meta"):
        model = DecoderLM(cfg)
    lora.apply_lora(model, rank=8)
    trainable, total = lora.parameter_counts(model)
    assert trainable == lora.lora_parameter_count(cfg, 8) == 70 * 2 * 8 * (14336 + 14336)
    assert total - trainable == 176_247_271_424


def test_trainable_fraction_counts_quantized_weights():
    model = tiny_decoder()
    quant.quantize_linear_weights(model, "nf4")
    lora.apply_lora(model, rank=4)
    n = lora.lora_parameter_count(TINY, 4)
    assert lora.parameter_counts(model) == (n, parameter_count(TINY) + n)


def test_apply_lora_refuses_unknown_targets_and_a_second_application():
    model = tiny_decoder()
    with pytest.raises(ValueError, match="named"):
        lora.apply_lora(model, targets=("q_proj",))
    assert all(p.requires_grad for p in model.parameters())  # nothing frozen by a failed call
    lora.apply_lora(model)
    with pytest.raises(ValueError, match="merge_lora"):
        lora.apply_lora(model)
    with pytest.raises(ValueError, match="unknown targets"):
        lora.lora_parameter_count(TINY, 8, ("q_proj",))


def test_merge_lora_gives_the_adapted_output_with_the_original_modules():
    model = tiny_decoder()
    keys = list(model.state_dict())
    lora.apply_lora(model, targets=("query", "value", "up"), rank=4)
    randomize_adapters(model)
    x = ids()
    adapted = model(x).logits
    merged_names = lora.merge_lora(model)
    assert len(merged_names) == 3 * TINY.n_layers
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(model(x).logits, adapted, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(x).logits, tiny_decoder()(x).logits, atol=1e-3)  # the update is there


def test_merge_lora_refuses_a_quantized_base_and_changes_nothing():
    model = tiny_decoder()
    quant.quantize_linear_weights(model, "int8")
    lora.apply_lora(model)
    with pytest.raises(ValueError, match="quantized"):
        lora.merge_lora(model)
    assert sum(isinstance(m, lora.LoRALinear) for m in model.modules()) == 2 * TINY.n_layers
    with pytest.raises(ValueError, match="apply_lora"):
        lora.merge_lora(tiny_decoder())


# ------------------------------------------------------------------------------------------
# Prompt tuning
# ------------------------------------------------------------------------------------------


def test_prompt_tuning_shapes_labels_and_mask():
    prompt = lora.PromptTuning(3, 8)
    out = prompt(torch.zeros(2, 5, 8))
    assert out.shape == (2, 8, 8)
    assert torch.equal(out[0, :3], prompt.prompts.detach()) and torch.equal(out[:, 3:], torch.zeros(2, 5, 8))
    labels = torch.arange(10).view(2, 5)
    assert prompt.extend_labels(labels).tolist() == [
        [-100] * 3 + list(range(5)),
        [-100] * 3 + list(range(5, 10)),
    ]
    assert prompt.extend_attention_mask(torch.tensor([[1, 1, 0]])).tolist() == [[1, 1, 1, 1, 1, 0]]
    with pytest.raises(ValueError, match="embedded input"):
        prompt(torch.zeros(2, 5, 7))


@pytest.mark.parametrize("alibi", [False, True])
def test_a_prompt_of_real_token_embeddings_equals_feeding_those_tokens(alibi):
    cfg = (
        TINY
        if not alibi
        else TransformerConfig(**{**TINY.__dict__, "position": "alibi", "embedding_layernorm": True})
    )
    model = tiny_decoder(cfg=cfg)
    prefix, x = ids(1, 4, seed=7)[0], ids()
    prompt = lora.PromptTuning(4, cfg.hidden_size, init_from=model.word_embeddings[prefix])
    out = lora.prompt_forward(model, prompt, x, labels=x)
    full = torch.cat([prefix.expand(x.shape[0], -1), x], dim=1)
    labels = torch.cat([torch.full((x.shape[0], 4), -100), x], dim=1)
    ref = model(full, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


def copy_task(n_batches: int = 4, batch: int = 8, half: int = 6, seed: int = 3) -> list:
    """Sequences "a b c ... | a b c ..." over a 16-token sub-vocabulary; only the second half is scored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        first = torch.randint(0, 16, (batch, half), generator=g)
        input_ids = torch.cat([first, first], dim=1)
        labels = input_ids.clone()
        labels[:, :half] = -100
        out.append((input_ids, labels))
    return out


# A random base with init_std 0.02 has word vectors too short for any adapter to move its (tied,
# frozen) output logits far from uniform; 0.2 stands in for a pretrained model's larger weights.
TRAINABLE = TransformerConfig(**{**TINY.__dict__, "init_std": 0.2})


def frozen_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {n: t.clone() for n, t in state.items() if not n.endswith((".A", ".B"))}


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_lora_finetune_lowers_the_loss_and_leaves_the_base_bit_identical(fmt):
    model = tiny_decoder(cfg=TRAINABLE)
    if fmt:
        quant.quantize_linear_weights(model, fmt)
    lora.apply_lora(model, targets=("query", "value", "up", "down"), rank=4)
    before = frozen_snapshot(model)
    torch.manual_seed(0)
    losses = lora.finetune(model, copy_task(), steps=40, lr=1e-2)
    assert len(losses) == 40 and all(math.isfinite(v) for v in losses)
    # ln 16 = 2.77 is the best loss without copying (16 equally likely tokens): going below it
    # means the adapters learned to look back at the first half.
    assert sum(losses[-4:]) / 4 < min(0.8 * sum(losses[:4]) / 4, math.log(16))
    after = frozen_snapshot(model)
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


def test_prompt_tuning_lowers_the_loss_and_leaves_the_model_bit_identical():
    model = tiny_decoder(cfg=TRAINABLE)
    model.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(0)
    prompt = lora.PromptTuning(8, TINY.hidden_size)
    start = prompt.prompts.detach().clone()
    losses = lora.finetune(model, copy_task(), steps=40, lr=3e-2, prompt=prompt)
    # Means over one pass through the 4 batches (they differ in difficulty).
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4
    assert not torch.equal(prompt.prompts, start)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_finetune_refuses_nothing_to_train():
    model = tiny_decoder()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="apply_lora"):
        lora.finetune(model, copy_task(1), steps=1)


# ------------------------------------------------------------------------------------------
# Memory arithmetic for BLOOM-176B
# ------------------------------------------------------------------------------------------


def test_memory_table_bloom_matches_hand_computed_bytes():
    n = 176_247_271_424  # BLOOM-176B's published parameter count
    r = 70 * 2 * 8 * (14336 + 14336)  # 70 layers x (query, value) x rank 8 x (in + out) = 32,112,640
    rows = {row["format"]: row for row in lora.memory_table(CONFIGS["bloom-176b"], 8, ("query", "value"))}
    assert list(rows) == ["full", "fp16", "int8", "nf4"]
    assert rows["full"]["total_bytes"] == 16 * n  # 2 + 2 + 12 bytes per parameter
    assert rows["full"]["gpus"] == math.ceil(16 * n / 80e9) == 36
    assert rows["fp16"]["base_bytes"] == 2 * n
    assert rows["int8"]["base_bytes"] == pytest.approx(
        n + n * 4 / 14336
    )  # 1 byte + a 4-byte scale per row of d
    # NF4: 4 bits + an 8-bit scale per 64 weights + a 32-bit scale per 256 of those.
    assert rows["nf4"]["base_bytes"] == pytest.approx(n * (4 + 8 / 64 + 32 / (64 * 256)) / 8)
    for fmt in ("fp16", "int8", "nf4"):
        row = rows[fmt]
        assert row["lora_params"] == r
        assert (row["lora_bytes"], row["grad_bytes"], row["adam_bytes"]) == (4 * r, 4 * r, 8 * r)
        assert row["total_bytes"] == pytest.approx(row["base_bytes"] + 16 * r)
    assert rows["nf4"]["total_bytes"] / 1e9 == pytest.approx(91.4, abs=0.05)
    assert rows["nf4"]["gpus"] == 2 and rows["fp16"]["gpus"] == 5
    text = lora.format_memory_table(list(rows.values()))
    assert "LoRA, nf4" in text and "32,112,640" in text


def test_adapters_of_and_load_adapters_round_trip_in_the_swarm_format():
    model = tiny_decoder()
    lora.apply_lora(model, rank=4, alpha=8.0)
    randomize_adapters(model)
    adapters = lora.adapters_of(model, clone=True)
    assert adapters["scale"] == 2.0 and sorted(k for k in adapters if k != "scale") == [0, 1]
    assert adapters[1]["value"][1].is_leaf and adapters[1]["value"][1].requires_grad
    assert torch.equal(adapters[1]["value"][1], model.transformer.blocks[1].attention.value.B)
    x = ids()
    expected = model(x).logits
    other = tiny_decoder()
    torch.manual_seed(9)
    lora.apply_lora(other, rank=4, alpha=8.0)
    lora.load_adapters(other, adapters)
    assert torch.equal(other(x).logits, expected)
    with pytest.raises(ValueError, match="same targets"):
        lora.load_adapters(other, {0: adapters[0], "scale": 2.0})
    mismatched = tiny_decoder()
    lora.apply_lora(mismatched, targets=("query",), rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="same targets"):
        lora.load_adapters(mismatched, adapters)
    rank_one = tiny_decoder()
    lora.apply_lora(rank_one, rank=1, alpha=2.0)  # same scale (alpha / rank = 2), rank 1 not 4
    with pytest.raises(ValueError, match=r"shape \(4, 32\), the model's LoRA \(1, 32\).*rank"):
        lora.load_adapters(rank_one, adapters)
    narrow = lora.adapters_of(rank_one, clone=True)  # and rank-1 adapters into a rank-4 model
    with pytest.raises(ValueError, match=r"shape \(1, 32\), the model's LoRA \(4, 32\)"):
        lora.load_adapters(other, narrow)


def test_adapt_to_text_lowers_held_out_loss_and_keeps_the_base():
    # A "narrow text": one 12-token phrase over and over, with every 7th token replaced at random.
    g = torch.Generator().manual_seed(4)
    phrase = torch.randint(0, TINY.vocab_size, (12,), generator=g)
    stream = phrase.repeat(40)
    noisy = torch.arange(len(stream)) % 7 == 0
    stream[noisy] = torch.randint(0, TINY.vocab_size, (int(noisy.sum()),), generator=g)
    model = tiny_decoder(cfg=TRAINABLE)
    result = lora.adapt_to_text(model, stream, seq_len=16, steps=30, lr=1e-2, rank=4, batch_size=4)
    assert (result["train_blocks"], result["heldout_blocks"]) == (24, 6)  # 480 tokens = 30 blocks
    assert result["heldout_after"] < 0.8 * result["heldout_before"]
    assert result["base_unchanged"]
    n = lora.lora_parameter_count(TRAINABLE, 4)
    assert (result["trainable"], result["total"]) == (n, parameter_count(TRAINABLE) + n)
    with pytest.raises(ValueError, match="too few"):
        lora.adapt_to_text(tiny_decoder(), stream[:20], seq_len=16)
