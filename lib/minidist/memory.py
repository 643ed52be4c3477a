"""Where the bytes of training go: a calculator, and the measurements that check it (layer 5).

Training a model holds four kinds of state on every rank:

    parameters      the weights themselves                               Ψ · bytes/param
    gradients       one per parameter                                    Ψ · bytes/grad
    optimizer       Adam's m and v (and, in mixed precision, an fp32     Ψ · K
                    master copy of the weights)
    activations     what the forward pass saves for the backward pass    ∝ batch · seq · layers

The first three depend on the parameter count Ψ only; ZeRO (Rajbhandari et al., 2020) shards
them over the data-parallel ranks, tensor parallelism splits the matrices, pipeline parallelism
splits the layers. Activations depend on the batch, the sequence and the recomputation policy
(Korthikanti et al., 2022). This module computes all of them per rank (``estimate``) and
measures the same quantities on real tensors (``tensor_bytes``, ``saved_activation_bytes``,
``rss_bytes``) so that each formula is checked against what torch actually holds.

Calculator
----------
``estimate(cfg, batch=, seq=, zero_stage=, dp=, tp=, pp=, recompute=, sequence_parallel=)``
                                    bytes per rank: params, grads, optimizer, activations, total
``zero_table(n_params, dp)``        the ZeRO paper's Table 1 row (model states per device)
``stage_parameter_count(cfg, tp, pp, stage)``   parameters on one rank
``activation_bytes_per_layer(s, b, h, a, tp, recompute, sequence_parallel)``   Korthikanti et al.
``block_activation_bytes``, ``decoder_activation_bytes``   our dropout-free model, exactly
``flops_per_token(cfg, seq)``, ``training_days(cfg, tokens, n_devices, peak_flops, utilisation)``

Measurement
-----------
``tensor_bytes(obj)``               bytes of the distinct storages reachable from obj
``saved_activation_bytes(fn, ...)`` bytes autograd saves for backward while fn runs
``rss_bytes()``, ``peak_rss_bytes()``, ``reset_peak_rss()``   the process's resident memory (Linux)
``build_on_meta(factory)``          build a model with shapes only; seconds and RSS it cost

Worked example (OPT-175B, s = 2048, micro-batch 1, 16-bit, on 1024 GPUs: TP 8 x PP 16 x DP 8,
ZeRO-1, sequence parallel and selective recomputation), per GPU of the first stage:

    params 2.9 GB   grads 2.9 GB   optimizer (Adam, sharded over 8) 2.2 GB   activations 10.3 GB

Without any parallelism one copy would need 2.8 TB of model states (16 bytes x 174.6B)
before a single activation.
"""

from __future__ import annotations

from minidist._proc import peak_rss_bytes, reset_peak_rss, rss_bytes
from minidist.measure import (  # the measurements live one layer down, where models can use them
    MetaBuild,
    SavedTensor,
    build_on_meta,
    saved_activation_bytes,
    saved_tensors,
    tensor_bytes,
)
from minidist.models import transformer
from minidist.models.transformer import TransformerConfig

__all__ = [
    "PRECISIONS",
    "estimate",
    "zero_table",
    "stage_parameter_count",
    "activation_bytes_per_layer",
    "block_activation_bytes",
    "decoder_activation_bytes",
    "flops_per_token",
    "training_days",
    "build_on_meta",
    "MetaBuild",
    "tensor_bytes",
    "saved_activation_bytes",
    "saved_tensors",
    "SavedTensor",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
]


# --------------------------------------------------------------------------------------------
# The calculator: parameters, gradients, optimizer state
# --------------------------------------------------------------------------------------------
PRECISIONS: dict[str, tuple[int, int, int]] = {
    # bytes per parameter for (parameters, gradients, optimizer state)
    # mixed precision Adam (ZeRO's K = 12): 16-bit weights and grads; fp32 master weights, m and v
    "mixed": (2, 2, 12),
    # plain fp32 training with Adam (what our CPU runs do): fp32 weights and grads; m and v
    "fp32": (4, 4, 8),
}


def zero_table(n_params: float, dp: int, k: int = 12) -> dict[str, float]:
    """Bytes per device of the model states under each ZeRO-DP stage (Rajbhandari et al., 2020, Table 1).

    Ψ parameters, 16-bit weights (2Ψ) and gradients (2Ψ), K·Ψ optimizer state (Adam: K = 12,
    fp32 master weights + m + v), N_d data-parallel ranks:

        baseline   (2 + 2 + K) Ψ             every rank holds everything
        P_os       2Ψ + 2Ψ + K Ψ / N_d       optimizer state sharded (ZeRO-1)
        P_os+g     2Ψ + (2 + K) Ψ / N_d      ... and gradients (ZeRO-2)
        P_os+g+p   (2 + 2 + K) Ψ / N_d       ... and parameters (ZeRO-3)

    7.5B parameters on 64 ranks: 120, 31.4, 16.6 and 1.88 GB (GB = 1e9 bytes), the table's row.
    """
    if dp < 1:
        raise ValueError(f"dp (the data-parallel degree N_d) must be >= 1, got {dp}")
    psi = float(n_params)
    return {
        "baseline": (2 + 2 + k) * psi,
        "os": 2 * psi + 2 * psi + k * psi / dp,
        "os+g": 2 * psi + (2 + k) * psi / dp,
        "os+g+p": (2 + 2 + k) * psi / dp,
    }


def _check_divides(what: str, n: int, by: str, m: int, fix: str) -> None:
    if n % m:
        raise ValueError(f"{what} {n} is not divisible by {by} {m}: {fix}")


def stage_parameter_count(cfg: TransformerConfig, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters held by one rank of pipeline stage ``stage`` with tensor-parallel degree ``tp``.

    Megatron's split (what ``minidist.parallel.tensor`` and ``models.stages`` do):

        per block   Q, K, V and MLP-up are column-parallel: weights and biases / tp
                    attention-output and MLP-down are row-parallel: weights / tp, biases whole
                    the two LayerNorms (4d) are replicated on every tp rank
        embeddings  the word table is vocabulary-parallel (V·d / tp); the position table,
                    segment table and embedding LayerNorm are replicated; all on stage 0
        last stage  the final LayerNorm (replicated); with pp > 1 it also holds its own copy of
                    the (tied) word-table shard for the output layer, as Megatron does
        layers      n_layers / pp per stage

    With tp = pp = 1 this is ``transformer.parameter_count(cfg)`` (the tied head adds nothing).
    """
    d, f, layers = cfg.hidden_size, cfg.ffn_size, cfg.n_layers
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside 0..{pp - 1} (pp = {pp})")
    _check_divides("n_heads", cfg.n_heads, "tp", tp, "pick a tensor-parallel degree that divides the heads")
    _check_divides("ffn size", f, "tp", tp, "pick a tensor-parallel degree that divides the MLP width")
    _check_divides("vocab_size", cfg.vocab_size, "tp", tp, "pad the vocabulary to a multiple of tp")
    _check_divides("n_layers", layers, "pp", pp, "pick a number of stages that divides the layers")
    block = (3 * d * d + 3 * d) // tp + d * d // tp + d + (d * f + f) // tp + f * d // tp + d + 4 * d
    count = layers // pp * block
    word = cfg.vocab_size * d // tp
    if stage == 0:
        count += word + cfg.type_vocab_size * d
        if cfg.position == "learned":
            count += cfg.max_positions * d
        if cfg.embedding_layernorm:
            count += 2 * d
    if stage == pp - 1:
        if cfg.pre_ln:
            count += 2 * d
        if pp > 1:
            count += word  # the output layer's copy of the tied word table
    return count


# --------------------------------------------------------------------------------------------
# The calculator: activations
# --------------------------------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    tp: int = 1,
    recompute: str = "none",
    sequence_parallel: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward, by Korthikanti et al. (2022), section 4.

    s sequence length, b micro-batch size, h hidden size, a heads, t tensor-parallel degree.
    The paper's model: 16-bit activations (2 bytes an element), dropout after the softmax and
    after each of the two sub-blocks (a mask is 1 byte an element), an MLP of width 4h.

    Attention block, 11sbh + 5as²b:
        2sbh     input of the Q, K, V projections (the LayerNorm's output)
        4sbh     Q and K, saved by QKᵀ
        2as²b    the softmax output, saved by the softmax's backward
        as²b     the dropout mask on the attention weights
        2as²b    the dropout's output (the weights), saved by weights·V
        2sbh     V, saved by weights·V
        2sbh     input of the output projection
        sbh      the dropout mask after the block
    MLP block, 19sbh:
        2sbh     input of the first linear
        8sbh     input of GELU (4h wide), saved by GELU's backward
        8sbh     output of GELU, the second linear's input
        sbh      the dropout mask after the block
    LayerNorms, 4sbh: each of the two saves its 2sbh input.

    Total without parallelism: sbh (34 + 5as/h).

    Tensor parallel (t ranks): everything between the f and g operators is split -- Q, K, V,
    the softmax and its dropout, the output projection's input, GELU's input and output: 24sbh
    + 5as²b, divided by t. The LayerNorm inputs (4sbh), the two sub-block inputs (4sbh) and the
    two dropout masks (2sbh) stay whole on every rank:  sbh (10 + 24/t + 5as/(ht)).

    Sequence parallel also splits those 10sbh along the sequence:  sbh/t (34 + 5as/h).

    Selective recomputation drops the 5as²b of the attention core (QKᵀ, softmax, dropout,
    weights·V are recomputed from Q, K, V):  sbh (10 + 24/t), or 34 sbh/t with sequence parallel.

    Full recomputation keeps only the layer's input, 2sbh (2sbh/t with sequence parallel, where
    the input is split along the sequence), and recomputes the layer in backward.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / tp if sequence_parallel else 2.0 * sbh
    attention_core = 5 * a * s * s * b if recompute == "none" else 0
    whole = 10 * sbh / tp if sequence_parallel else 10.0 * sbh
    return whole + (24 * sbh + attention_core) / tp


def block_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    ffn: int | None = None,
    element_size: int = 4,
    stat_size: int | None = None,
) -> int:
    """Bytes one of OUR ``TransformerBlock``s saves for backward (dropout 0, any dtype), exactly.

    ``transformer.TransformerBlock`` in training mode with ``dropout`` 0, e bytes an element,
    f = ffn width (4h by default). What autograd keeps, counted by ``saved_activation_bytes``:

        attention     e·sbh     the LayerNorm's output, input of Q, K, V (one storage, saved 3 times)
                      e·2sbh    Q and K, copied into (b·a, s, h/a) for the batched QKᵀ
                      e·as²b    the softmax output, saved by softmax and by weights·V
                      e·sbh     V, copied into (b·a, s, h/a) for weights·V
                      e·sbh     the heads concatenated: the output projection's input
        MLP           e·sbh     the LayerNorm's output, input of the first linear
                      e·sbf     the first linear's output, saved by GELU
                      e·sbf     GELU's output, input of the second linear
        LayerNorms    e·2sbh    the two inputs
                      4sb·st    mean and 1/std per position, per LayerNorm (st = stat_size bytes;
                                the input dtype on CPU, fp32 on CUDA for 16-bit inputs)

        total         e·(8sbh + 2sbf + as²b) + 4sb·st   =  e·(16 sbh + as²b) + ...  for f = 4h

    Against the paper's 34 sbh + 5as²b (2-byte elements): with e = 2 ours is 32 sbh + 2as²b.
    Dropout 0 means no masks (sbh after each sub-block, as²b on the weights) and no dropout
    output to save (2as²b: weights·V saves the softmax output itself) -- the rest is the same list.
    Post-LN blocks (BERT) save the same amounts (the block input feeds Q, K, V instead of a LayerNorm).
    """
    f = ffn if ffn is not None else 4 * h
    st = element_size if stat_size is None else stat_size
    return element_size * (8 * s * b * h + 2 * s * b * f + a * s * s * b) + 4 * s * b * st


def decoder_activation_bytes(
    cfg: TransformerConfig, batch: int, seq: int, element_size: int = 4, with_loss: bool = True
) -> int:
    """Bytes ``DecoderLM(cfg)(input_ids, labels=input_ids)`` saves for backward, exactly (dropout 0).

    n_layers blocks (``block_activation_bytes``) plus the ends of the model:

        token ids                      8·b·s      int64, saved by the word embedding
        position ids                   8·s        int64 (learned positions only)
        embedding LayerNorm (BLOOM)    e·sbh + 2sb·e
        final LayerNorm                e·sbh + 2sb·e
        output layer input             e·sbh      the final LayerNorm's output, saved by h·Eᵀ
        loss (with labels)             e·b(s-1)V  log-softmax output;  8·b(s-1) the shifted labels;
                                       e          the loss's total weight

    For a large vocabulary and a short sequence the log-softmax output dominates: it is the
    "4sbv" (fp32) term of Korthikanti et al.'s output layer.
    """
    b, s, h, e = batch, seq, cfg.hidden_size, element_size
    total = cfg.n_layers * block_activation_bytes(s, b, h, cfg.n_heads, cfg.ffn_size, e)
    total += 8 * b * s
    if cfg.position == "learned":
        total += 8 * s
    if cfg.embedding_layernorm:
        total += e * s * b * h + 2 * s * b * e
    total += e * s * b * h + 2 * s * b * e  # final LayerNorm
    total += e * s * b * h  # output layer input
    if with_loss:
        total += e * b * (s - 1) * cfg.vocab_size + 8 * b * (s - 1) + e
    return total


def estimate(
    cfg: TransformerConfig,
    *,
    batch: int,
    seq: int,
    zero_stage: int = 0,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    recompute: str = "none",
    sequence_parallel: bool = False,
    precision: str = "mixed",
    bytes_per_param: tuple[int, int, int] | None = None,
    activations: str = "korthikanti",
    in_flight: int | None = None,
    stage: int = 0,
) -> dict[str, int]:
    """Bytes per rank of training ``cfg``: "params", "grads", "optimizer", "activations", "total".

    The rank is one of pipeline stage ``stage`` (default 0, the first: it holds the embeddings
    and, under 1F1B, the most micro-batches in flight). ``batch`` is the micro-batch size b.

    Model states (``stage_parameter_count`` for what TP and PP leave on the rank):
        precision "mixed"   2 + 2 + 12 = 16 bytes a parameter (16-bit weights and grads; Adam's
                            fp32 master copy, m, v: ZeRO's K = 12)
        precision "fp32"    4 + 4 + 8 (fp32 weights and grads; m and v) -- our CPU runs
        bytes_per_param     (weights, grads, optimizer) bytes to override either
        zero_stage          1 shards the optimizer state over dp ranks, 2 also the gradients,
                            3 also the parameters (each divided by dp, rounded up)

    Activations:
        "korthikanti"  ``activation_bytes_per_layer`` (16-bit activations, dropout masks) times the
                       layers of the stage, n_layers / pp, times the micro-batches in flight on it
                       (``in_flight``; default pp - stage, as under 1F1B -- so the first stage
                       holds n_layers layers' worth whatever pp is, the paper's observation).
                       The embedding's and output layer's activations are left out (the paper
                       shows they are small next to the layers').
        "minidist"     ``decoder_activation_bytes``: our ``DecoderLM`` exactly, element size from
                       ``precision``; only for tp = pp = 1 and recompute "none".

    Not counted: temporary buffers (ZeRO-3's gathered unit, communication buckets, the logits
    before the loss), the one layer that recomputation re-materialises during backward, and the
    allocator's fragmentation -- a real run needs some headroom above "total".
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if min(batch, seq) < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    p_bytes, g_bytes, o_bytes = bytes_per_param or PRECISIONS[precision]
    n = stage_parameter_count(cfg, tp=tp, pp=pp, stage=stage)
    shard = -(-n // dp)  # ceil: ZeRO pads the flat parameter vector to a multiple of dp
    params = p_bytes * (shard if zero_stage >= 3 else n)
    grads = g_bytes * (shard if zero_stage >= 2 else n)
    optimizer = o_bytes * (shard if zero_stage >= 1 else n)

    if activations == "korthikanti":
        per_layer = activation_bytes_per_layer(
            seq,
            batch,
            cfg.hidden_size,
            cfg.n_heads,
            tp=tp,
            recompute=recompute,
            sequence_parallel=sequence_parallel,
        )
        flights = pp - stage if in_flight is None else in_flight
        acts = round(per_layer * (cfg.n_layers // pp) * flights)
    elif activations == "minidist":
        if tp != 1 or pp != 1 or recompute != "none" or sequence_parallel:
            raise ValueError(
                "activations='minidist' models our single-rank DecoderLM without recomputation: "
                "use tp=pp=1, recompute='none', sequence_parallel=False, or activations='korthikanti'"
            )
        element = 4 if precision == "fp32" else 2
        acts = decoder_activation_bytes(cfg, batch, seq, element_size=element)
    else:
        raise ValueError(f"activations must be 'korthikanti' or 'minidist', got {activations!r}")
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": acts,
        "total": params + grads + optimizer + acts,
        "params_count": n,
    }


# --------------------------------------------------------------------------------------------
# FLOPs and time
# --------------------------------------------------------------------------------------------
def flops_per_token(
    cfg: TransformerConfig, seq: int, attention: bool = True, recompute: str = "none"
) -> float:
    """Training FLOPs per token: forward + backward (+ a second forward of the layers with full recompute).

    A matrix multiply of an m×k by a k×n matrix costs 2mkn FLOPs (a multiply and an add), so the
    forward pass costs 2 FLOPs per parameter per token (2N; the tied output layer is the word
    table used as a matmul, the lookup itself is free), and backward twice that (gradients
    with respect to inputs and to weights): 6N. Attention adds, per layer and token, QKᵀ
    (2·s·d) and weights·V (2·s·d) forward, 12·s·d for training, over all s positions
    (no saving for the causal mask) -- Narayanan et al. (2021), eq. 3:

        none   6N + 12·L·s·d
        full   8N - 2·V·d + 16·L·s·d    (the layers run forward twice; the output layer does not)

    ``attention=False`` drops the s-terms: 6N per token, the "C = 6ND" of Kaplan et al. (2020)
    and of GPT-3's compute table.
    """
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute must be 'none' or 'full' for FLOPs, got {recompute!r}")
    n = transformer.parameter_count(cfg)
    d, layers = cfg.hidden_size, cfg.n_layers
    attn = 4 * layers * seq * d if attention else 0  # forward FLOPs of QKᵀ and weights·V per token
    flops = 3 * (2 * n + attn)
    if recompute == "full":
        flops += 2 * (n - cfg.vocab_size * d) + attn
    return float(flops)


def training_days(
    cfg: TransformerConfig,
    tokens: float,
    n_devices: int,
    peak_flops: float,
    utilisation: float,
    seq: int | None = None,
    attention: bool = True,
    recompute: str = "none",
) -> float:
    """Days to train on ``tokens`` tokens: tokens · flops_per_token / (n_devices · peak_flops · utilisation).

    With ``attention=False, recompute="full"`` this is Narayanan et al.'s (2021) end-to-end
    estimate 8TP / (nX): T tokens, P parameters, n GPUs, X achieved FLOP/s per GPU.
    ``seq`` defaults to ``cfg.max_positions``.
    """
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation is a fraction of peak in (0, 1], got {utilisation}")
    if n_devices < 1 or peak_flops <= 0:
        raise ValueError(f"need n_devices >= 1 and peak_flops > 0, got {n_devices}, {peak_flops}")
    per_token = flops_per_token(cfg, seq or cfg.max_positions, attention=attention, recompute=recompute)
    seconds = tokens * per_token / (n_devices * peak_flops * utilisation)
    return seconds / 86400.0
