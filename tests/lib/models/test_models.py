"""minidist.models: the shared transformer, BERT for MLM and the decoder LM.

References: torch's scaled_dot_product_attention for attention, published parameter counts and
the closed-form formula for sizes, the definition of causality (a past output must not change
when a future token does).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minidist.models import bert, decoder, score_bias, transformer
from minidist.models.transformer import MultiHeadSelfAttention, TransformerConfig
from tiny import tiny_config


def _small_cfg(**overrides) -> TransformerConfig:
    return tiny_config(**{"vocab_size": 50, "max_positions": 16, **overrides})


def _bert(name: str = "tiny", seed: int = 0) -> bert.BertForMLM:
    torch.manual_seed(seed)
    return bert.BertForMLM(bert.CONFIGS[name])


def _decoder(name: str = "tiny", seed: int = 0) -> decoder.DecoderLM:
    torch.manual_seed(seed)
    return decoder.DecoderLM(decoder.CONFIGS[name])


def test_shapes():
    ids = torch.randint(0, 8192, (3, 20), generator=torch.Generator().manual_seed(1))
    out = _bert()(ids)
    assert out.loss is None and out.logits.shape == (3, 20, 8192)
    out = _decoder()(ids)
    assert out.loss is None and out.logits.shape == (3, 20, 8192)


def _reference_attention(
    attn: MultiHeadSelfAttention, x: torch.Tensor, mask: torch.Tensor | None, causal: bool
):
    """The same projections through torch's fused attention kernel."""
    batch, seq_len, d = x.shape
    heads = attn.n_heads

    def split(t):
        return t.view(batch, seq_len, heads, d // heads).transpose(1, 2)

    q, k, v = split(attn.query(x)), split(attn.key(x)), split(attn.value(x))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return attn.output(out.transpose(1, 2).reshape(batch, seq_len, d))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_scaled_dot_product_attention(causal):
    torch.manual_seed(0)
    cfg = _small_cfg(causal=causal)
    attn = MultiHeadSelfAttention(cfg)
    x = torch.randn(2, 9, cfg.hidden_size)
    bias = transformer.attention_bias(cfg, 9, None, x.dtype, x.device)
    torch.testing.assert_close(attn(x, bias), _reference_attention(attn, x, None, causal))


def test_attention_with_padding_matches_reference_boolean_mask():
    torch.manual_seed(0)
    cfg = _small_cfg()
    attn = MultiHeadSelfAttention(cfg)
    x = torch.randn(2, 7, cfg.hidden_size)
    keep = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    bias = transformer.attention_bias(cfg, 7, keep, x.dtype, x.device)
    reference_mask = keep.bool()[:, None, None, :]  # True = attend
    torch.testing.assert_close(attn(x, bias), _reference_attention(attn, x, reference_mask, False))


def test_alibi_attention_matches_reference_float_mask():
    torch.manual_seed(0)
    cfg = _small_cfg(position="alibi", causal=True, pre_ln=True, n_heads=4)
    attn = MultiHeadSelfAttention(cfg)
    seq_len = 6
    x = torch.randn(2, seq_len, cfg.hidden_size)
    bias = transformer.attention_bias(cfg, seq_len, None, x.dtype, x.device)
    # Built independently: slopes 2^-2 .. 2^-8 for 4 heads; -slope * distance; -inf above the diagonal.
    slopes = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    reference = -slopes[:, None, None] * (i - j).float()
    reference = reference.masked_fill(j > i, float("-inf"))
    torch.testing.assert_close(attn(x, bias), _reference_attention(attn, x, reference, False))


def test_alibi_slopes_follow_the_paper_for_non_power_of_two_heads():
    def powers(n):  # the paper's closed form: start = 2^(-8/n), slopes start^1 .. start^n
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start**h for h in range(1, n + 1)]

    reference = powers(64) + powers(128)[0::2][:48]
    torch.testing.assert_close(score_bias.alibi_slopes(112), torch.tensor(reference))
    torch.testing.assert_close(score_bias.alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))


@pytest.mark.parametrize("name", ["tiny", "bloom-like"])
def test_decoder_is_causal(name):
    if name == "tiny":
        model = _decoder()
        vocab = model.cfg.vocab_size
    else:
        torch.manual_seed(0)
        model = decoder.DecoderLM(
            _small_cfg(
                position="alibi",
                causal=True,
                pre_ln=True,
                embedding_layernorm=True,
                n_heads=3,
                hidden_size=24,
            )
        )
        vocab = 50
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, vocab, (2, 5), generator=gen)
    before, after = model(ids).logits, model(changed).logits
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 7:], after[:, 7:])


def test_bert_is_bidirectional_and_ignores_padding():
    model = _bert()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 8192, (2, 10), generator=gen)
    changed = ids.clone()
    changed[:, 7:] = torch.randint(5, 8192, (2, 3), generator=gen)
    # Without a mask, a later token changes earlier outputs (attention looks both ways) ...
    assert not torch.allclose(model(ids).logits[:, :7], model(changed).logits[:, :7])
    # ... with the later tokens masked as padding, it does not.
    keep = torch.ones_like(ids)
    keep[:, 7:] = 0
    torch.testing.assert_close(
        model(ids, keep).logits[:, :7], model(changed, keep).logits[:, :7], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("make", [_bert, _decoder])
def test_output_matrix_is_the_word_embedding_parameter(make):
    model = make()
    embedding = model.transformer.embeddings.word.weight
    assert model.word_embeddings is embedding
    # Only one (V, d) matrix exists among the parameters: the head did not make its own copy.
    big = [n for n, p in model.named_parameters() if p.shape == embedding.shape]
    assert big == ["transformer.embeddings.word.weight"]
    # Gradient reaches it from the output side too: a token that is never input still gets one.
    ids = torch.full((1, 4), 7)
    labels = torch.full((1, 4), 11)
    model(ids, labels=labels).loss.backward()
    assert embedding.grad[11].abs().sum() > 0 and embedding.grad[7].abs().sum() > 0


@pytest.mark.parametrize("name", ["tiny", "mini", "small"])
def test_parameter_counts_match_formula(name):
    assert sum(p.numel() for p in _bert(name).parameters()) == bert.mlm_parameter_count(bert.CONFIGS[name])
    assert sum(p.numel() for p in _decoder(name).parameters()) == decoder.parameter_count(
        decoder.CONFIGS[name]
    )


def test_bert_base_matches_published_count():
    cfg = bert.CONFIGS["base"]
    with torch.device("meta"):
        model = bert.BertForMLM(cfg)
    body = sum(p.numel() for p in model.transformer.parameters())
    # bert-base-uncased's BertModel (embeddings, 12 layers and a d x d pooler we do not have): 109,482,240.
    pooler = 768 * 768 + 768
    assert body + pooler == 109_482_240
    assert sum(p.numel() for p in model.parameters()) == bert.mlm_parameter_count(cfg)
    assert 109e6 < bert.mlm_parameter_count(cfg) < 111e6  # "110M"


@pytest.mark.parametrize("name", ["opt-175b", "bloom-176b", "gpt3-175b"])
def test_big_decoders_build_on_meta_and_match_formula(name):
    cfg = decoder.CONFIGS[name]
    with torch.device("meta"):
        model = decoder.DecoderLM(cfg)
    assert all(p.is_meta for p in model.parameters())
    counted = sum(p.numel() for p in model.parameters())
    d, layers = cfg.hidden_size, cfg.n_layers
    # Written out for a pre-LN decoder with a 4d MLP: embeddings, 12d^2 + 13d per layer, final LN.
    positions = cfg.max_positions * d if cfg.position == "learned" else 0
    embedding_norm = 2 * d if cfg.embedding_layernorm else 0
    formula = cfg.vocab_size * d + positions + embedding_norm + layers * (12 * d * d + 13 * d) + 2 * d
    assert counted == formula == decoder.parameter_count(cfg)
    if name == "bloom-176b":
        assert counted == 176_247_271_424  # BLOOM's published exact count
        assert model.transformer.embeddings.position is None
    else:
        assert 174e9 < counted < 176e9


@pytest.fixture
def one_thread():
    # On a shared 2-core machine, two torch threads per process wait on each other: one is faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(model, ids, labels, steps, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_lowers_loss_on_a_fixed_batch(one_thread):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 8192, (4, 16), generator=gen)
    labels = torch.full_like(ids, bert.IGNORE_INDEX)
    masked = torch.rand(ids.shape, generator=gen) < 0.3
    labels[masked] = ids[masked]
    inputs = ids.masked_fill(masked, 4)
    losses = _train(_bert(), inputs, labels, steps=15)
    assert losses[0] > math.log(8192) - 1.0  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]
    losses = _train(_decoder(), ids, ids, steps=15)
    assert losses[-1] < 0.5 * losses[0]


def test_deterministic_with_seed(one_thread):
    ids = torch.randint(5, 8192, (2, 8), generator=torch.Generator().manual_seed(0))
    runs = [_train(_decoder(seed=5), ids, ids, steps=3) for _ in range(2)]
    assert runs[0] == runs[1]
    assert _train(_decoder(seed=6), ids, ids, steps=1)[0] != runs[0][0]


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        _small_cfg(hidden_size=30, n_heads=4)
    model = _bert()
    with pytest.raises(ValueError, match="max_positions"):
        model(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="one label per token"):
        model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="causal"):
        decoder.DecoderLM(bert.CONFIGS["tiny"])


def test_cuda_forward_and_backward_match_cpu():
    cpu_model = _bert()
    cuda_model = _bert().cuda()
    ids = torch.randint(5, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    cpu_out = cpu_model(ids, labels=labels)
    cuda_out = cuda_model(ids.cuda(), labels=labels.cuda())
    torch.testing.assert_close(cuda_out.logits.cpu(), cpu_out.logits, rtol=1e-3, atol=1e-3)
    cpu_out.loss.backward()
    cuda_out.loss.backward()
    torch.testing.assert_close(
        cuda_model.word_embeddings.grad.cpu(), cpu_model.word_embeddings.grad, rtol=1e-3, atol=1e-4
    )
    with torch.device("cuda"):
        lm = decoder.DecoderLM(_small_cfg(position="alibi", causal=True, pre_ln=True))
    assert lm(torch.zeros(1, 8, dtype=torch.long, device="cuda")).logits.device.type == "cuda"
