"""Tensor parallelism, Megatron style (Shoeybi et al., 2019): one layer's matrices split across ranks.

Every rank of ``comm`` holds 1/p of each big weight and computes 1/p of each big product; the
ranks see the *same* input batch. The trick is to split the two matrices of an MLP so that the
pair needs a single allreduce:

    Y = GeLU(X A)         A (d, f) split by COLUMNS:  A = [A_0 | A_1 | ... ]   (column-parallel)
                          rank r computes Y_r = GeLU(X A_r), its own f/p columns of Y.
                          GeLU acts element by element, so no communication is needed here:
                          GeLU([X A_0 | X A_1]) = [GeLU(X A_0) | GeLU(X A_1)].

    Z = Y B               B (f, d) split by ROWS:     B = [B_0 ; B_1 ; ... ]   (row-parallel)
                          rank r computes the partial sum Z_r = Y_r B_r (full shape (.., d)),
                          and Z = sum_r Z_r  -> ONE allreduce.

          X ──f──┬─► X A_0 ─ GeLU ─► Y_0 ─► Y_0 B_0 ─┐
                 └─► X A_1 ─ GeLU ─► Y_1 ─► Y_1 B_1 ─┴─g─► Z        (p = 2)

Had we split A by rows instead, X A would be a partial sum *before* the GeLU, and since
GeLU(a + b) != GeLU(a) + GeLU(b) we would need a second allreduce. Attention splits the same
way: Q, K, V column-parallel (each rank owns n_heads/p whole heads, and heads never talk to each
other), the output projection row-parallel.

The package, one idea per module, in reading order:

    operators.py   f and g (and the gather/scatter pair): all the communication, as four small
                   autograd functions; ``count_collectives(comm)`` counts them
    layers.py      ColumnParallelLinear, RowParallelLinear, and the MLP and attention built from them
    vocab.py       the vocabulary split: VocabParallelEmbedding, vocab_parallel_cross_entropy
    sequence.py    sequence parallelism: LayerNorms and residuals on S/p tokens, g-bar (all-gather)
                   and g-bar^T (reduce-scatter) in place of f and g; ``count_sequence_collectives``
    traffic.py     tp_traffic_formula: collectives and bytes per step of a tensor-parallel decoder

It takes plain sizes and imports no model; ``minidist.models.tp_decoder`` builds a decoder from
these parts. Every name is here: ``from minidist.parallel import tensor as tp``.
"""

from .layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    check_divisible,
)
from .operators import (
    copy_to_tensor_parallel,
    count_collectives,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    reset_collective_counts,
    scatter_to_tensor_parallel,
)
from .sequence import (
    SequenceParallelLayerNorm,
    check_sequence_divisible,
    count_sequence_collectives,
    gather_and_linear,
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
    reset_sequence_collective_counts,
    scatter_to_sequence_parallel,
    sum_grads_over_tensor_parallel,
)
from .traffic import allreduce_bytes, tp_traffic_formula
from .vocab import IGNORE_INDEX, VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "SequenceParallelLayerNorm",
    "VocabParallelEmbedding",
    "allreduce_bytes",
    "check_divisible",
    "check_sequence_divisible",
    "count_sequence_collectives",
    "gather_and_linear",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "reset_sequence_collective_counts",
    "scatter_to_sequence_parallel",
    "sum_grads_over_tensor_parallel",
    "copy_to_tensor_parallel",
    "count_collectives",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "reset_collective_counts",
    "scatter_to_tensor_parallel",
    "tp_traffic_formula",
    "vocab_parallel_cross_entropy",
]
