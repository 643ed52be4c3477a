"""minidist.memory: measured bytes (storages, saved-for-backward tensors, RSS) and the calculator.

Every formula is checked against an independent reference: bytes torch really holds
(``tensor_bytes`` over storages), tensors autograd really saves (saved-tensor hooks), a paper's
table (ZeRO, Table 1), published parameter counts, or a published FLOP count.
"""

from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn

from minidist import memory
from minidist.models import bert, decoder, transformer

pytestmark = pytest.mark.timeout(120)


# --- measurement ------------------------------------------------------------------------------
def test_tensor_bytes_counts_each_storage_once():
    x = torch.zeros(10, 20)  # 800 bytes
    assert memory.tensor_bytes(x) == 800
    # views share the storage; a list holding the tensor twice and a view counts it once
    assert memory.tensor_bytes([x, x[0], x.t(), {"again": x}]) == 800
    # a small view keeps the whole buffer: counted in full
    assert memory.tensor_bytes(x[:1, :1]) == 800
    y = torch.zeros(5, dtype=torch.float64)
    assert memory.tensor_bytes((x, y)) == 800 + 40


def test_tensor_bytes_of_module_grads_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    model[2].weight = nn.Parameter(torch.randn(8, 16))
    n_params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert memory.tensor_bytes(model) == 4 * n_params + buffers
    model(torch.randn(4, 8)).sum().backward()
    assert memory.tensor_bytes(model) == 8 * n_params + buffers
    opt = torch.optim.AdamW(model.parameters())
    assert memory.tensor_bytes(opt) == 0  # no state before the first step
    opt.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert memory.tensor_bytes(opt) == 8 * n_params + steps


def test_tensor_bytes_of_an_optimizer_like_wrapper():
    class Wrapper:  # like minidist.parallel.zero.ZeroOptimizer: not an Optimizer, but has .state
        def __init__(self, inner):
            self.inner = inner

        @property
        def state(self):
            return self.inner.state

    p = nn.Parameter(torch.randn(100))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(100)
    inner.step()
    assert memory.tensor_bytes(Wrapper(inner)) == memory.tensor_bytes(inner) == 400  # the momentum buffer


def test_tied_parameter_counts_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert memory.tensor_bytes(nn.ModuleList([emb, head])) == 10 * 4 * 4


def test_saved_activation_bytes_of_a_linear_and_a_relu():
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    # a linear saves its input (the weight is a parameter: not counted)
    assert memory.saved_activation_bytes(lin, x) == 3 * 6 * 4
    # relu saves its output: one more (3, 5) storage
    assert memory.saved_activation_bytes(lambda t: torch.relu(lin(t)), x) == 3 * 6 * 4 + 3 * 5 * 4
    # under no_grad nothing is saved
    with torch.no_grad():
        assert memory.saved_activation_bytes(lin, x) == 0


def test_rss_reads_proc():
    if not memory.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs not writable here")
    before = memory.rss_bytes()
    assert memory.peak_rss_bytes() >= before > 0
    # 64 MiB of fresh anonymous pages, every one touched (an allocator could hand back memory
    # that an earlier test freed and that is still resident: then RSS would not move)
    big = mmap.mmap(-1, 64 * 2**20)
    big.write(b"\1" * len(big))
    assert memory.rss_bytes() - before > 48 * 2**20
    big.close()
    assert memory.peak_rss_bytes() - before > 48 * 2**20


# --- ZeRO, Table 1 ----------------------------------------------------------------------------
# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (2020),
# Table 1: per-device memory (GB) of the model states, K = 12, for DP degree N_d.
# Columns: baseline, P_os, P_os+g, P_os+g+p, as printed in the paper.
ZERO_TABLE_1 = {
    (7.5e9, 1): ("120", "120", "120", "120"),
    (7.5e9, 4): ("120", "52.5", "41.3", "30"),
    (7.5e9, 16): ("120", "35.6", "21.6", "7.5"),
    (7.5e9, 64): ("120", "31.4", "16.6", "1.88"),
    (128e9, 64): ("2048", "536", "284", "32"),
}


@pytest.mark.parametrize(("n_params", "dp"), list(ZERO_TABLE_1))
def test_zero_table_reproduces_the_paper(n_params, dp):
    got = memory.zero_table(n_params, dp)
    for column, printed in zip(["baseline", "os", "os+g", "os+g+p"], ZERO_TABLE_1[n_params, dp]):
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        # equal to the printed number within half a unit of its last digit
        assert abs(got[column] / 1e9 - float(printed)) <= 0.5 * 10**-decimals + 1e-9, (column, got[column])


def test_estimate_model_states_follow_zero_table():
    cfg = decoder.CONFIGS["gpt3-175b"]
    n = decoder.parameter_count(cfg)
    table = memory.zero_table(n, 64)
    for stage, column in enumerate(["baseline", "os", "os+g", "os+g+p"]):
        est = memory.estimate(cfg, batch=1, seq=2048, zero_stage=stage, dp=64)
        states = est["params"] + est["grads"] + est["optimizer"]
        assert states == pytest.approx(table[column], rel=1e-9, abs=64 * 16)  # ceil(n / dp) padding


# --- parameter counts against published ones ---------------------------------------------------
def test_bloom_parameter_count_is_exact():
    # BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model" (2022): 176,247,271,424.
    assert memory.stage_parameter_count(decoder.CONFIGS["bloom-176b"]) == 176_247_271_424


@pytest.mark.parametrize(("name", "published"), [("opt-175b", 175e9), ("gpt3-175b", 175.0e9)])
def test_175b_parameter_counts_near_published(name, published):
    # OPT (Zhang et al., 2022, Table 1) and GPT-3 (Brown et al., 2020, Table 2.1) print "175B" / "175.0B":
    # a rounded number. Our formula gives 174.6B (V·d + 2048·d + 96·(12d² + 13d) + 2d); OPT's released
    # position table has 2 more rows (an offset of 2), +24,576. 0.5% covers the rounding, not a
    # missing block (one layer is 1.8B = 1%).
    n = memory.stage_parameter_count(decoder.CONFIGS[name])
    assert n == pytest.approx(published, rel=0.005)


def test_bert_parameter_counts_near_published():
    # Devlin et al. (2019): BERT-base "110M", BERT-large "340M" (rounded). The released checkpoints'
    # BertModel (embeddings + layers + d x d pooler, no MLM head) count 109,482,240 and 335,141,888:
    # ours has no pooler, so add it to compare exactly; with our MLM head we are within 1.5% of "340M".
    for name, exact, published in [("base", 109_482_240, 110e6), ("large", 335_141_888, 340e6)]:
        cfg = bert.CONFIGS[name]
        d = cfg.hidden_size
        assert memory.stage_parameter_count(cfg) + d * d + d == exact
        assert bert.mlm_parameter_count(cfg) == pytest.approx(published, rel=0.015)


def test_stage_parameter_count_splits_like_megatron():
    cfg = _tiny_decoder(n_layers=4)
    model = decoder.DecoderLM(cfg)
    tp, pp = 2, 2
    # The reference: walk the real parameters and apply Megatron's rule by name.
    split = ("query.", "key.", "value.", "up.")  # column-parallel: weight and bias split
    row = ("output.weight", "down.weight")  # row-parallel: weight split, bias whole

    def per_rank(name, p):
        if name.endswith(row) or any(s in name for s in split) or name.endswith("word.weight"):
            return p.numel() // tp
        return p.numel()

    blocks = [sum(per_rank(n, p) for n, p in b.named_parameters()) for b in model.transformer.blocks]
    emb = sum(per_rank(n, p) for n, p in model.transformer.embeddings.named_parameters())
    final = sum(p.numel() for p in model.transformer.final_norm.parameters())
    word = cfg.vocab_size * cfg.hidden_size // tp
    assert memory.stage_parameter_count(cfg, tp, pp, stage=0) == emb + sum(blocks[:2])
    assert memory.stage_parameter_count(cfg, tp, pp, stage=1) == sum(blocks[2:]) + final + word
    assert memory.stage_parameter_count(cfg) == sum(p.numel() for p in model.parameters())


def test_bad_sizes_name_the_numbers():
    cfg = decoder.CONFIGS["opt-175b"]
    with pytest.raises(ValueError, match="n_heads 96 is not divisible by tp 5"):
        memory.estimate(cfg, batch=1, seq=2048, tp=5)
    with pytest.raises(ValueError, match="n_layers 96 is not divisible by pp 7"):
        memory.estimate(cfg, batch=1, seq=2048, pp=7)
    with pytest.raises(ValueError, match="recompute"):
        memory.estimate(cfg, batch=1, seq=2048, recompute="some")
    with pytest.raises(ValueError, match="activations='minidist'"):
        memory.estimate(cfg, batch=1, seq=2048, tp=8, activations="minidist")


# --- activations: Korthikanti et al. (2022) -----------------------------------------------------
def test_korthikanti_formulas_agree_where_they_must():
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    none = memory.activation_bytes_per_layer(s, b, h, a)
    assert none == pytest.approx(sbh * (34 + 5 * a * s / h))
    # t = 1: tensor parallel and sequence parallel change nothing
    assert memory.activation_bytes_per_layer(s, b, h, a, tp=1, sequence_parallel=True) == pytest.approx(none)
    for t in (2, 8):
        tp = memory.activation_bytes_per_layer(s, b, h, a, tp=t)
        sp = memory.activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=True)
        assert tp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert sp == pytest.approx(none / t)  # everything split t ways
        sel = memory.activation_bytes_per_layer(
            s, b, h, a, tp=t, recompute="selective", sequence_parallel=True
        )
        assert sel == pytest.approx(34 * sbh / t)
    assert memory.activation_bytes_per_layer(s, b, h, a, tp=8, recompute="full") == 2 * sbh
    # For GPT-3 the attention core (5as/h = 80) outweighs the rest (34): why selective recompute pays.
    assert 5 * a * s / h > 34


def test_pipeline_first_stage_holds_all_layers_worth_under_1f1b():
    # Korthikanti et al., section 4.2.3: under 1F1B stage 0 keeps p micro-batches of L/p layers.
    cfg = decoder.CONFIGS["opt-175b"]  # GPT-3's vocabulary (50257) does not split 8 ways; OPT's does
    per_layer = memory.activation_bytes_per_layer(2048, 1, 12288, 96, tp=8)
    first = memory.estimate(cfg, batch=1, seq=2048, tp=8, pp=16)["activations"]
    last = memory.estimate(cfg, batch=1, seq=2048, tp=8, pp=16, stage=15)["activations"]
    assert first == pytest.approx(96 * per_layer)
    assert last == pytest.approx(96 / 16 * per_layer)  # one micro-batch in flight
    gpipe = memory.estimate(cfg, batch=1, seq=2048, tp=8, pp=16, in_flight=64)["activations"]
    assert gpipe == pytest.approx(4 * first)  # GPipe keeps all m = 64 micro-batches


def test_our_block_is_the_paper_minus_dropout():
    # With 2-byte elements (and no LayerNorm statistics, which the paper leaves out), our dropout-free
    # block keeps the paper's list minus the two sbh masks, the as²b mask and the 2as²b dropout output.
    s, b, h, a = 64, 2, 256, 4
    ours = memory.block_activation_bytes(s, b, h, a, element_size=2, stat_size=0)
    paper = memory.activation_bytes_per_layer(s, b, h, a)
    assert ours == paper - 2 * s * b * h - a * s * s * b - 2 * a * s * s * b


def _tiny_decoder(n_layers=2, hidden=32, heads=2, vocab=96, alibi=False, ffn=0):
    return transformer.TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=heads,
        max_positions=32,
        intermediate_size=ffn,
        position="alibi" if alibi else "learned",
        causal=True,
        pre_ln=True,
        embedding_layernorm=alibi,
        layer_norm_eps=1e-5,
    )


@pytest.mark.parametrize(
    ("hidden", "heads", "ffn", "pre_ln", "dtype"),
    [
        (32, 2, 0, True, torch.float32),
        (48, 1, 0, True, torch.float32),  # one head: Q, K, V need no copy, the same bytes
        (64, 4, 96, False, torch.float32),  # post-LN (BERT's block), a non-4d MLP
        (32, 4, 0, True, torch.bfloat16),
    ],
)
def test_block_activation_bytes_match_saved_tensors(hidden, heads, ffn, pre_ln, dtype):
    torch.manual_seed(0)
    cfg = transformer.TransformerConfig(
        vocab_size=16, hidden_size=hidden, n_layers=1, n_heads=heads, max_positions=16,
        intermediate_size=ffn, causal=pre_ln, pre_ln=pre_ln,
    )  # fmt: skip
    block = transformer.TransformerBlock(cfg).to(dtype)
    b, s = 3, 12
    x = torch.randn(b, s, hidden, dtype=dtype)
    bias = transformer.attention_bias(cfg, s, None, dtype, x.device)
    measured = memory.saved_activation_bytes(block, x, bias)
    e = torch.tensor([], dtype=dtype).element_size()
    formula = memory.block_activation_bytes(s, b, hidden, heads, cfg.ffn_size, element_size=e)
    assert measured == pytest.approx(formula, rel=0.05)


def test_full_recompute_keeps_only_the_layer_input():
    # Korthikanti's "full" row (2sbh at 2 bytes) is the checkpointed block's input: measure it.
    from torch.utils.checkpoint import checkpoint

    cfg = _tiny_decoder(hidden=32, heads=2)
    block = transformer.TransformerBlock(cfg).to(torch.bfloat16)
    b, s, h = 2, 12, 32
    x = torch.randn(b, s, h, dtype=torch.bfloat16)
    saved = memory.saved_activation_bytes(lambda: checkpoint(block, x, use_reentrant=False))
    assert saved == memory.activation_bytes_per_layer(s, b, h, 2, recompute="full")


@pytest.mark.parametrize("alibi", [False, True])
def test_decoder_activation_bytes_match_saved_tensors(alibi):
    torch.manual_seed(0)
    cfg = _tiny_decoder(alibi=alibi)
    model = decoder.DecoderLM(cfg)
    b, s = 2, 16
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    measured = memory.saved_activation_bytes(lambda: model(ids, labels=ids).loss)
    # Exact today; 1% leaves room for a torch release that changes what one op saves, and is
    # still tighter than one sbh per layer (the smallest term we could have got wrong).
    assert measured == pytest.approx(memory.decoder_activation_bytes(cfg, b, s, element_size=4), rel=0.01)
    # without the loss (the log-softmax over the vocabulary) the layers dominate
    body = memory.saved_activation_bytes(lambda: model.transformer(ids))
    want = (
        memory.decoder_activation_bytes(cfg, b, s, element_size=4, with_loss=False)
        - 4 * s * b * cfg.hidden_size
    )
    assert body == pytest.approx(want, rel=0.01)
    est = memory.estimate(cfg, batch=b, seq=s, precision="fp32", activations="minidist")
    assert est["activations"] == memory.decoder_activation_bytes(cfg, b, s, element_size=4)


def test_estimate_fp32_model_states_match_what_torch_holds():
    torch.manual_seed(0)
    cfg = _tiny_decoder(n_layers=3, hidden=64, heads=4)
    model = decoder.DecoderLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    est = memory.estimate(cfg, batch=2, seq=8, precision="fp32", activations="minidist")
    n_tensors = len(list(model.parameters()))
    assert memory.tensor_bytes(model) == pytest.approx(est["params"] + est["grads"], rel=0.05)
    # torch's AdamW also keeps a 4-byte "step" per parameter tensor: counted, and within 5%
    assert memory.tensor_bytes(opt) == pytest.approx(est["optimizer"], rel=0.05)
    assert memory.tensor_bytes(opt) - est["optimizer"] == 4 * n_tensors


# --- building 175B models on the meta device --------------------------------------------------
@pytest.mark.parametrize("name", ["opt-175b", "bloom-176b"])
def test_build_on_meta_costs_no_weight_memory(name):
    cfg = decoder.CONFIGS[name]
    built = memory.build_on_meta(lambda: decoder.DecoderLM(cfg))
    n = memory.stage_parameter_count(cfg)
    assert sum(p.numel() for p in built.model.parameters()) == n
    assert memory.tensor_bytes(built.model) == 4 * n  # what fp32 weights would take: ~700 GB
    # a memory bound, not a timing one: the build allocated nothing near the weights' size
    assert built.rss_increase_bytes < 1e-3 * 4 * n


# --- FLOPs and time -----------------------------------------------------------------------------
def test_gpt3_training_compute():
    # Brown et al. (2020), Table D.1: GPT-3 175B trained on 300B tokens, 3.14e23 FLOPs (= 6ND, no attention).
    cfg = decoder.CONFIGS["gpt3-175b"]
    total = memory.flops_per_token(cfg, 2048, attention=False) * 300e9
    assert total == pytest.approx(3.14e23, rel=0.01)


def test_flops_match_narayanan_equation_3():
    # Narayanan et al. (2021), eq. 3, with activation recomputation, per iteration of B sequences:
    #   F = 96 B s l h² (1 + s / (6h) + V / (16 l h))
    for name, s in [("gpt3-175b", 2048), ("opt-175b", 1024)]:
        cfg = decoder.CONFIGS[name]
        h, layers, v = cfg.hidden_size, cfg.n_layers, cfg.vocab_size
        paper = 96 * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)) / s  # per token
        assert memory.flops_per_token(cfg, s, recompute="full") == pytest.approx(paper, rel=0.01)
        # without recomputation the layers run forward once: 72 l h² + 12 l h s + 6 V h
        plain = 72 * layers * h * h + 12 * layers * h * s + 6 * v * h
        assert memory.flops_per_token(cfg, s) == pytest.approx(plain, rel=0.01)


def test_training_days_match_narayanan():
    # Narayanan et al. (2021), section 5.1: GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s
    # achieved: "about 34 days" by 8TP / (nX).
    cfg = decoder.CONFIGS["gpt3-175b"]
    days = memory.training_days(cfg, 300e9, 1024, 312e12, 140 / 312, attention=False, recompute="full")
    assert days == pytest.approx(34, abs=0.5)
    with pytest.raises(ValueError, match="utilisation"):
        memory.training_days(cfg, 300e9, 1024, 312e12, 1.5)
