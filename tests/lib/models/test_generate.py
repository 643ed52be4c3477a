"""KV-cached decoding (``minidist.models.generate``) against the full forward of ``DecoderLM``.

The reference is the model itself run on the whole sequence: logits of every position, and
greedy tokens of generation without a cache. Byte counts are checked against the tensors held.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minidist import quant
from minidist.models import generate
from minidist.models.decoder import CONFIGS, DecoderLM
from minidist.models.score_bias import attention_bias
from minidist.models.transformer import TransformerBlock, TransformerConfig


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: on busy shared cores, waking extra intra-op threads costs more than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(position: str = "learned", **overrides) -> TransformerConfig:
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        n_layers=2,
        n_heads=4,
        max_positions=24,
        position=position,
        causal=True,
        pre_ln=True,
        embedding_layernorm=position == "alibi",  # BLOOM has one, OPT does not
        layer_norm_eps=1e-5,
        init_std=0.3,  # at 0.02 a random decoder repeats one token; larger weights give varied text
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_model(position: str = "learned", seed: int = 0, **overrides) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(tiny_config(position, **overrides))
    # Non-zero biases and LayerNorm parameters, so a step that dropped one would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def random_ids(batch: int, length: int, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def cached_logits(
    model: DecoderLM, ids: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, generate.KVCache]:
    """The prompt in one step, then one token per step; logits of every position concatenated."""
    cache = generate.KVCache(model.cfg.n_layers)
    with torch.no_grad():
        pieces = [generate.decoder_step(model, ids[:, :prompt_len], cache)]
        for t in range(prompt_len, ids.shape[1]):
            pieces.append(generate.decoder_step(model, ids[:, t : t + 1], cache))
    return torch.cat(pieces, dim=1), cache


# --- step logits equal the full forward --------------------------------------------------------


@pytest.mark.parametrize("position", ["learned", "alibi"])
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_cached_steps_equal_full_forward_at_every_position(position, prompt_len):
    model = tiny_model(position)
    ids = random_ids(2, 12)
    with torch.no_grad():
        reference = model(ids).logits
    logits, cache = cached_logits(model, ids, prompt_len)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    assert cache.length == 12
    assert cache[0][0].shape == (2, 4, 12, 8)  # (B, H, T, d_head)


def test_post_ln_blocks_step_like_their_forward():
    """block_step follows both layouts of TransformerBlock (BERT's post-LN too)."""
    cfg = tiny_config(pre_ln=False)
    torch.manual_seed(0)
    block = TransformerBlock(cfg).eval()
    x = torch.randn(2, 6, cfg.hidden_size)
    with torch.no_grad():
        reference = block(x, attention_bias(cfg, 6, None, x.dtype, x.device))
        first, kv = generate.block_step(block, x[:, :4], None, generate.step_bias(cfg, 0, 4, x.dtype, "cpu"))
        rest, kv = generate.block_step(block, x[:, 4:], kv, generate.step_bias(cfg, 4, 2, x.dtype, "cpu"))
    torch.testing.assert_close(torch.cat([first, rest], dim=1), reference, rtol=0, atol=1e-5)
    assert kv[0].shape[2] == 6


@pytest.mark.parametrize("position", ["learned", "alibi"])
@pytest.mark.parametrize("past_len,new_len", [(0, 5), (4, 1), (3, 4)])
def test_step_bias_is_rows_of_the_full_bias(position, past_len, new_len):
    cfg = tiny_config(position)
    total = past_len + new_len
    full = attention_bias(cfg, total, None, torch.float32, torch.device("cpu"))
    rows = generate.step_bias(cfg, past_len, new_len, torch.float32, "cpu")
    assert torch.equal(rows, full[..., past_len:total, :])


def test_embed_uses_positions_after_the_past():
    model = tiny_model("learned")
    ids = random_ids(2, 9)
    with torch.no_grad():
        full = model.transformer.embeddings(ids)
        assert torch.equal(generate.embed(model, ids[:, 6:], past_len=6), full[:, 6:])


# --- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["learned", "alibi"])
@pytest.mark.parametrize("prompt_len", [1, 4])
def test_generate_with_and_without_cache_give_the_same_tokens(position, prompt_len):
    model = tiny_model(position)
    prompt = random_ids(2, prompt_len)
    with_cache = generate.generate(model, prompt, 12, use_cache=True)
    without = generate.generate(model, prompt, 12, use_cache=False)
    assert with_cache.shape == (2, prompt_len + 12)
    assert torch.equal(with_cache[:, :prompt_len], prompt)
    assert torch.equal(with_cache, without)


def test_generate_is_greedy_against_the_full_forward():
    """Every appended token is the argmax of the full model's last logits on the prefix."""
    model = tiny_model("learned")
    out = generate.generate(model, random_ids(2, 3), 6)
    with torch.no_grad():
        for t in range(3, out.shape[1]):
            assert torch.equal(out[:, t], model(out[:, :t]).logits[:, -1].argmax(-1))


@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_turns_dropout_off_and_restores_the_mode(use_cache):
    """A model left in training mode with dropout: generate decodes as in eval mode, every time."""
    model = tiny_model("learned", dropout=0.5)
    prompt = random_ids(2, 3)
    expected = generate.generate(model, prompt, 8, use_cache=use_cache)  # tiny_model is in eval mode
    # reference: the full forward in eval mode, argmax appended by hand
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(expected, ids)
    model.train()
    for seed in range(3):  # dropout would draw different masks for different seeds
        torch.manual_seed(seed)
        assert torch.equal(generate.generate(model, prompt, 8, use_cache=use_cache), expected)
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize("which", [2, 0])
def test_generate_stops_after_eos_for_every_sequence(which):
    """Reference: the free-running tokens, with everything after a sequence's first eos set to eos,
    cut after the step where the last sequence produced it."""
    model = tiny_model("learned")
    prompt = random_ids(2, 3)
    free = generate.generate(model, prompt, 12)
    eos = int(free[0, 3 + which])  # a token sequence 0 produces
    expected = free.clone()
    firsts = []
    for row in expected:
        hits = (row[3:] == eos).nonzero()
        if len(hits):
            firsts.append(3 + int(hits[0]))
            row[firsts[-1] :] = eos
    if len(firsts) == len(expected):
        expected = expected[:, : max(firsts) + 1]
    out = generate.generate(model, prompt, 12, eos_id=eos)
    assert torch.equal(out, expected)
    assert torch.equal(out, generate.generate(model, prompt, 12, use_cache=False, eos_id=eos))


# --- spans (what a swarm server runs) -------------------------------------------------------------


def test_two_spans_equal_one_span():
    model = tiny_model("alibi", n_layers=4)
    cfg, blocks = model.cfg, model.transformer.blocks
    ids = random_ids(2, 7)
    whole = [None] * 4
    first, second = [None, None], [None, None]
    with torch.no_grad():
        for start, stop in [(0, 4), (4, 5), (5, 6), (6, 7)]:
            x = generate.embed(model, ids[:, start:stop], start)
            one = generate.span_step(list(blocks), cfg, x, whole, start)
            two = generate.span_step(
                list(blocks[2:]),
                cfg,
                generate.span_step(list(blocks[:2]), cfg, x, first, start),
                second,
                start,
            )
            torch.testing.assert_close(two, one, rtol=0, atol=1e-6)
    for a, b in zip(first + second, whole):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)


def test_span_step_is_differentiable_like_the_blocks():
    """Training through a swarm backpropagates through span_step: same gradient as the blocks' forward."""
    model = tiny_model("learned")
    cfg, blocks = model.cfg, list(model.transformer.blocks)
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    x_ref, x_step = x.clone().requires_grad_(), x.clone().requires_grad_()
    h = x_ref
    for block in blocks:
        h = block(h, attention_bias(cfg, 5, None, x.dtype, x.device))
    h.square().sum().backward()
    generate.span_step(blocks, cfg, x_step, [None, None], 0).square().sum().backward()
    torch.testing.assert_close(x_step.grad, x_ref.grad, rtol=0, atol=1e-5)


# --- quantized weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_cache_works_on_a_quantized_model(fmt):
    model = quant.quantize_linear_weights(tiny_model("learned"), fmt)
    assert isinstance(model.transformer.blocks[0].attention.query, quant.QuantizedLinear)
    ids = random_ids(2, 10)
    with torch.no_grad():
        reference = model(ids).logits
    logits, _ = cached_logits(model, ids, 3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    prompt = ids[:, :3]
    assert torch.equal(
        generate.generate(model, prompt, 8), generate.generate(model, prompt, 8, use_cache=False)
    )


# --- memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_equals_the_filled_cache(dtype):
    model = tiny_model("learned").to(dtype)
    _, cache = cached_logits(model, random_ids(3, 11), 4)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert cache.nbytes == generate.kv_cache_bytes(model.cfg, batch=3, seq=11, bytes_per_value=itemsize)
    held = sum(t.untyped_storage().nbytes() for kv in cache for t in kv)
    assert cache.nbytes == held


def test_kv_cache_bytes_of_the_175b_models_match_the_docstring_table():
    """The docstring of ``generate.cost`` quotes these; the formula is 2 · layers · T · d · 2 bytes."""
    opt = generate.kv_cache_bytes(CONFIGS["opt-175b"], batch=1, seq=2048)
    bloom = generate.kv_cache_bytes(CONFIGS["bloom-176b"], batch=1, seq=2048)
    assert opt == 2 * 96 * 2048 * 12288 * 2
    assert bloom == 2 * 70 * 2048 * 14336 * 2
    assert f"{opt:,}" in generate.cost.__doc__ and f"{bloom:,}" in generate.cost.__doc__


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("position,prompt_len", [("learned", 1), ("alibi", 5)])
def test_generation_flops_equal_torch_flop_counter(use_cache, position, prompt_len):
    """torch's FlopCounterMode counts every matrix product the run actually executes."""
    model = tiny_model(position)
    with FlopCounterMode(display=False) as counter:
        generate.generate(model, random_ids(2, prompt_len), 7, use_cache=use_cache)
    expected = generate.generation_flops(model.cfg, prompt_len, 7, use_cache, batch=2)
    assert counter.get_total_flops() == expected


# --- errors ---------------------------------------------------------------------------------------


def test_positions_beyond_the_table_are_refused():
    model = tiny_model("learned")  # 24 positions
    cache = generate.KVCache(2)
    with torch.no_grad():
        generate.decoder_step(model, random_ids(1, 20), cache)
        with pytest.raises(ValueError, match="20 cached \\+ 5 new tokens = 25 positions"):
            generate.decoder_step(model, random_ids(1, 5), cache)
    with pytest.raises(ValueError, match="at most 14 new tokens"):
        generate.generate(model, random_ids(1, 10), 15)


def test_alibi_has_no_position_limit():
    model = tiny_model("alibi", max_positions=8)
    prompt = random_ids(1, 4)
    assert torch.equal(
        generate.generate(model, prompt, 10), generate.generate(model, prompt, 10, use_cache=False)
    )


def test_shape_mismatches_are_refused():
    model = tiny_model("learned")
    cache = generate.KVCache(2)
    with torch.no_grad():
        generate.decoder_step(model, random_ids(2, 4), cache)
        with pytest.raises(ValueError, match="cache holds 2 sequences, new_ids has 3"):
            generate.decoder_step(model, random_ids(3, 1), cache)
        with pytest.raises(ValueError, match="cache has 3 layers, the model 2"):
            generate.decoder_step(model, random_ids(2, 1), generate.KVCache(3))
        blocks = list(model.transformer.blocks)
        hidden = torch.zeros(2, 1, 32)
        with pytest.raises(ValueError, match="cache entry 0 holds 4 positions but past_len is 3"):
            generate.span_step(blocks, model.cfg, hidden, cache, past_len=3)
        with pytest.raises(ValueError, match="2 blocks but 1 cache entries"):
            generate.span_step(blocks, model.cfg, hidden, [None], past_len=0)
        with pytest.raises(ValueError, match="hidden must be"):
            generate.span_step(blocks, model.cfg, torch.zeros(2, 1, 16), [None, None], past_len=0)
        wrong_heads = (torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 4, 16))
        with pytest.raises(ValueError, match="cached keys have shape"):
            generate.attention_step(blocks[0].attention, hidden, wrong_heads)
        keys = torch.zeros(2, 4, 3, 8)
        with pytest.raises(ValueError, match=r"values \(2, 4, 2, 8\)"):
            generate.attention_step(blocks[0].attention, hidden, (keys, torch.zeros(2, 4, 2, 8)))
        with pytest.raises(ValueError, match="cached keys have shape"):
            generate.attention_step(blocks[0].attention, hidden, (keys[0], keys[0]))
    with pytest.raises(ValueError, match="input_ids must be"):
        generate.generate(model, torch.zeros(4, dtype=torch.long), 2)


def test_a_cache_with_uneven_layers_is_refused():
    cache = generate.KVCache(2)
    cache[0] = (torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8))
    cache[1] = (torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"different lengths \[2, 3\]"):
        _ = cache.length
    with pytest.raises(ValueError, match="n_layers must be positive"):
        generate.KVCache(0)


def test_measure_tokens_per_s_restores_threads_and_checks_its_input():
    model = tiny_model("learned")
    before = torch.get_num_threads()
    rate = generate.measure_tokens_per_s(
        model, prompt_len=4, new_tokens=4, use_cache=True, repeats=1, threads=1
    )
    assert rate > 0 and torch.get_num_threads() == before
    with pytest.raises(ValueError, match="new_tokens 0"):
        generate.measure_tokens_per_s(model, prompt_len=4, new_tokens=0, use_cache=False)


# --- CUDA -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_cache_on_cuda_equals_full_forward(position):
    model = tiny_model(position).to("cuda")
    ids = random_ids(2, 12).to("cuda")
    with torch.no_grad():
        reference = model(ids).logits
    logits, cache = cached_logits(model, ids, 4)
    assert all(t.is_cuda for kv in cache for t in kv)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)
    prompt = ids[:, :4]
    assert torch.equal(
        generate.generate(model, prompt, 8), generate.generate(model, prompt, 8, use_cache=False)
    )
