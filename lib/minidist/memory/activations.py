"""Activations: the bytes the forward pass keeps for the backward pass, term by term.

Unlike the model states (``model_states``), activations grow with the micro-batch b and the
sequence s, and depend on the recomputation policy. Two counts side by side:

    activation_bytes_per_layer   Korthikanti et al. (2022): 16-bit, dropout masks, tp and sequence
                                 parallelism, selective and full recomputation -- the paper's model
    block_activation_bytes       OUR dropout-free ``TransformerBlock``, exactly (any dtype): what
    decoder_activation_bytes     ``measure.saved_activation_bytes`` reports, byte for byte

``per_rank.estimate`` uses either, times the layers and micro-batches in flight on a rank.
"""

from __future__ import annotations

from minidist.models.transformer import TransformerConfig

__all__ = ["RECOMPUTE", "activation_bytes_per_layer", "block_activation_bytes", "decoder_activation_bytes"]

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
