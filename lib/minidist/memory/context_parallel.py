"""Activations under context parallelism: the sequence split over ``cp`` ranks.

Everything in a transformer layer except attention acts token by token, so splitting the
sequence of S tokens over cp ranks leaves S/cp tokens' worth of every activation on a rank:
each sbh term of Korthikanti et al. divides by cp. Attention is where the S^2 was -- and ring
attention (``minidist.parallel.context``) never keeps a score matrix: forward folds one tile
at a time into a running output, backward recomputes the tiles. What it keeps per rank:

    q, k, v, out      4 e b a (S/cp) d        this rank's shards (e bytes an element)
    lse               l b a (S/cp)            one log-sum-exp per query row (l bytes, here e)

    ring_attention_saved_bytes(b, a, S, d, cp) = b a (S/cp) (4 d e + l)      -- exactly 1/cp
                                                                              of cp = 1's

Compare softmax attention on one rank that saves its probabilities, e b a S^2 more (our
``TransformerBlock``: ``activations.block_activation_bytes``' as^2b term): at S = 128k that
term alone is 64 GiB per head-batch in fp32; with ring attention the largest score matrix a
rank ever holds is one tile, (S/cp)^2 contiguous or (S/2cp)^2 zig-zag, per (batch, head), and
it is freed before the next.

``activation_bytes_per_layer_cp``: Korthikanti et al.'s layer (``activation_bytes_per_layer``)
with the sequence split over cp ranks and the attention core replaced by ring attention's
lse -- the selective-recomputation count at S/cp tokens, plus 4 a (S/cp) b bytes (fp32 lse).
"""

from __future__ import annotations

from minidist.memory.activations import activation_bytes_per_layer

__all__ = ["activation_bytes_per_layer_cp", "ring_attention_saved_bytes"]


def ring_attention_saved_bytes(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    cp: int = 1,
    element_size: int = 4,
    lse_size: int | None = None,
) -> int:
    """Bytes ``context.ring_attention`` saves for backward on one rank: q, k, v, out and lse
    for S/cp tokens (``lse_size`` bytes per lse entry; default ``element_size``, our lse's dtype)."""
    if cp < 1 or seq % cp:
        raise ValueError(f"cp must be >= 1 and divide the sequence, got cp={cp}, seq={seq}")
    lse = element_size if lse_size is None else lse_size
    return batch * heads * (seq // cp) * (4 * head_dim * element_size + lse)


def activation_bytes_per_layer_cp(
    s: int, b: int, h: int, a: int, cp: int = 1, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Bytes one layer keeps per rank with context parallel degree ``cp`` (ring attention),
    in Korthikanti et al.'s 16-bit model: ``activation_bytes_per_layer(s/cp, ..., recompute=
    "selective")`` -- no s^2 term -- plus the lse, 4 bytes per query row and head (split by tp)."""
    if cp < 1 or s % cp:
        raise ValueError(f"cp must be >= 1 and divide the sequence, got cp={cp}, s={s}")
    local = s // cp
    kept = activation_bytes_per_layer(
        local, b, h, a, tp=tp, recompute="selective", sequence_parallel=sequence_parallel
    )
    return kept + 4 * a * local * b / tp
