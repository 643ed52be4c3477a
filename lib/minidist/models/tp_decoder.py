"""``DecoderLM`` with Megatron tensor parallelism: every rank of ``comm`` holds 1/p of each layer.

    input_ids ─► VocabParallelEmbedding (V/p rows here; g) + position table (replicated)
              ─► block × n_layers:  x = x + ParallelSelfAttention(LN(x))     heads H/p here; f ... g
                                    x = x + ParallelMLP(LN(x))               ffn/p here;    f ... g
              ─► final LN ─f─► h · E_rᵀ ─► local logits (B, T, V/p) ─► vocab_parallel_cross_entropy

LayerNorms, the position table and the residual stream are replicated: every rank computes them
on the same (B, T, d) activations. The output matrix is the (tied) word table, so each rank's
logits are its V/p vocabulary columns and the loss never needs the full (B, T, V) logits.

Collectives per training step (forward + backward, p > 1), counted by ``tp.count_collectives``:

    forward:  1 (embedding g) + 2 per layer (attention g, MLP g) + 2 (cross-entropy: max, [Σexp, target])
    backward: 2 per layer (attention f, MLP f) + 1 (f before the logits)

``gather_logits`` (an allgather, forward only) builds the full logits for inspection.

``sequence_parallel=True`` (Korthikanti et al., 2022; ``minidist.parallel.tensor.sequence``):
the residual stream, the LayerNorms and the position table's rows run on this rank's S/p tokens:

    input_ids ─► VocabParallelEmbedding ─g-bar^T─► [S/p] + positions [S/p] (LN)
              ─► block × n_layers:  x [S/p] + g-bar^T(Attn(g-bar(LN(x))))     f ... g become
                                    x [S/p] + g-bar^T(MLP(g-bar(LN(x))))      g-bar ... g-bar^T
              ─► final LN [S/p] ─g-bar─► h · E_rᵀ ─► local logits (B, S, V/p) ─► the same loss

Each allreduce of TP becomes a reduce-scatter (forward at g, backward at f) plus an all-gather
(the other pass): the same bytes. Extra, in backward: one all-gather per g-bar (the layer after
it saved only S/p tokens; ``keep_gathered=True`` saves them all instead), one allreduce of 2d
numbers per LayerNorm and of d per row-parallel bias (they saw S/p tokens: the TP group sums
their gradients), and an all-gather of the position table's gradient rows. Per step, L layers:

    forward:  2L + 1 all-gathers, 2L + 1 reduce-scatters, 2 allreduces (the loss, as TP)
    backward: 2L + 1 reduce-scatters; 2L + 1 all-gathers + 2L + 1 re-gathers (0 with keep_gathered)
              + 1 (position rows, learned positions); 4L + 1 (+1 embedding LN) small allreduces

The sequence length must divide by p.

Parameter names are the dense model's (``transformer.blocks.0.mlp.up.weight`` ...): the split ones
hold this rank's slice -- rows of query/key/value/up and of the word table, columns of the
output/down weights -- and every other one is a full copy.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.models import transformer
from minidist.models.decoder import IGNORE_INDEX, CausalLMOutput, DecoderLM, check_labels
from minidist.models.transformer import TransformerConfig
from minidist.parallel import tensor as tp

from ..comm import Communicator

__all__ = ["TensorParallelDecoderLM", "check_tp_config"]


def check_tp_config(cfg: TransformerConfig, degree: int) -> None:
    """Raise a ValueError naming the numbers if heads, vocabulary or ffn size do not divide by ``degree``."""
    for what, size in (
        ("n_heads", cfg.n_heads),
        ("vocab_size", cfg.vocab_size),
        ("ffn size (intermediate_size or 4 * hidden_size)", cfg.ffn_size),
    ):
        if size % degree:
            raise ValueError(
                f"{what} = {size} is not divisible by the tensor-parallel degree {degree}: every rank "
                f"must hold an equal share; choose a degree that divides {size} (or pad the size)"
            )


def _layer_norm(cfg: TransformerConfig, comm: Communicator, sequence_parallel: bool) -> nn.LayerNorm:
    if sequence_parallel:
        return tp.SequenceParallelLayerNorm(cfg.hidden_size, comm, eps=cfg.layer_norm_eps, device=comm.device)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=comm.device)


class _Embeddings(nn.Module):
    def __init__(self, cfg: TransformerConfig, comm: Communicator, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.cfg, self.comm, self.sequence_parallel = cfg, comm, sequence_parallel
        self.word = tp.VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, comm, sequence_parallel=sequence_parallel
        )
        dev = comm.device
        self.position = (
            nn.Embedding(cfg.max_positions, cfg.hidden_size, device=dev)
            if cfg.position == "learned"
            else None
        )
        self.norm = _layer_norm(cfg, comm, sequence_parallel) if cfg.embedding_layernorm else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if self.position is not None and seq_len > self.cfg.max_positions:
            raise ValueError(
                f"sequence of {seq_len} tokens, but the model has {self.cfg.max_positions} positions"
            )
        x = self.word(input_ids)  # (B, S, d), or this rank's (B, S/p, d) with sequence parallelism
        if self.position is not None:
            positions = self.position(torch.arange(seq_len, device=input_ids.device))[None]
            if self.sequence_parallel:  # my rows; their gradients all-gathered in backward
                positions = tp.scatter_to_sequence_parallel(positions, self.comm)
            x = x + positions
        return x if self.norm is None else self.norm(x)


class _Block(nn.Module):
    """Pre-LN block: x + Attn(LN(x)), then x + MLP(LN(x)); 2 allreduces forward, 2 backward.

    ``sequence_parallel=True``: x is this rank's (B, S/p, d); 2 all-gathers and 2 reduce-scatters
    forward, 2 reduce-scatters and 2 all-gathers backward (+ 2 re-gathers unless
    ``keep_gathered``, + 4 small allreduces: the LayerNorms' and the row-parallel biases' gradients)."""

    def __init__(
        self,
        cfg: TransformerConfig,
        comm: Communicator,
        sequence_parallel: bool = False,
        keep_gathered: bool = False,
    ) -> None:
        super().__init__()
        sp = dict(sequence_parallel=sequence_parallel, keep_gathered=keep_gathered)
        self.attention = tp.ParallelSelfAttention(cfg.hidden_size, cfg.n_heads, comm, **sp)
        self.attention_norm = _layer_norm(cfg, comm, sequence_parallel)
        self.mlp = tp.ParallelMLP(cfg.hidden_size, cfg.ffn_size, comm, **sp)
        self.mlp_norm = _layer_norm(cfg, comm, sequence_parallel)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class _Transformer(nn.Module):
    def __init__(
        self, cfg: TransformerConfig, comm: Communicator, sequence_parallel: bool, keep_gathered: bool
    ):
        super().__init__()
        self.embeddings = _Embeddings(cfg, comm, sequence_parallel)
        self.blocks = nn.ModuleList(
            _Block(cfg, comm, sequence_parallel, keep_gathered) for _ in range(cfg.n_layers)
        )
        self.final_norm = _layer_norm(cfg, comm, sequence_parallel)


class TensorParallelDecoderLM(nn.Module):
    """``forward(input_ids, labels=None, attention_mask=None) -> CausalLMOutput(loss, local logits)``.

    The logits are this rank's vocabulary columns, (B, T, V/p); ``gather_logits`` concatenates
    them. Build it from a dense model with ``from_dense`` so both start equal.
    ``sequence_parallel=True`` adds Megatron sequence parallelism (the module docstring); the
    results and the parameters' names and gradients are the same.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        comm: Communicator,
        sequence_parallel: bool = False,
        keep_gathered: bool = False,
    ) -> None:
        super().__init__()
        if not cfg.causal or not cfg.pre_ln:
            raise ValueError(
                "TensorParallelDecoderLM needs a causal pre-LN config (causal=True, pre_ln=True)"
            )
        if cfg.type_vocab_size:
            raise ValueError(
                f"a decoder has no segment embeddings: type_vocab_size is {cfg.type_vocab_size}, use 0"
            )
        if cfg.dropout:
            raise ValueError(f"dropout {cfg.dropout}: tensor-parallel ranks must draw the same masks; use 0")
        check_tp_config(cfg, comm.world_size)
        self.cfg, self.comm = cfg, comm
        self.sequence_parallel, self.keep_gathered = sequence_parallel, keep_gathered
        self.transformer = _Transformer(cfg, comm, sequence_parallel, keep_gathered)

    @classmethod
    def from_dense(cls, dense: DecoderLM, comm: Communicator, **options) -> TensorParallelDecoderLM:
        """A tensor-parallel copy of ``dense``: this rank's slices of the split weights, the rest
        copied; ``options``: ``sequence_parallel``, ``keep_gathered``."""
        model = cls(dense.cfg, comm, **options)
        src, dst = dense.transformer, model.transformer
        dst.embeddings.word.load_dense(src.embeddings.word.weight)
        for name in ("position", "norm"):
            if getattr(dst.embeddings, name) is not None:
                getattr(dst.embeddings, name).load_state_dict(getattr(src.embeddings, name).state_dict())
        for mine, theirs in zip(dst.blocks, src.blocks, strict=True):
            mine.attention.load_dense(theirs.attention)
            mine.mlp.load_dense(theirs.mlp)
            mine.attention_norm.load_state_dict(theirs.attention_norm.state_dict())
            mine.mlp_norm.load_state_dict(theirs.mlp_norm.state_dict())
        dst.final_norm.load_state_dict(src.final_norm.state_dict())
        return model

    @property
    def word_embeddings(self) -> nn.Parameter:
        """This rank's (V/p, d) rows of the word table, also its part of the output matrix."""
        return self.transformer.embeddings.word.weight

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V) from every rank's (B, T, V/p): one allgather."""
        return tp.gather_from_tensor_parallel(local_logits, self.comm)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if self.sequence_parallel:
            tp.check_sequence_divisible(input_ids.shape[1], self.comm)
        t = self.transformer
        x = t.embeddings(input_ids)
        bias = transformer.attention_bias(self.cfg, input_ids.shape[1], attention_mask, x.dtype, x.device)
        for block in t.blocks:
            x = block(x, bias)
        if self.sequence_parallel:  # g-bar: all-gather the S/p tokens of every rank
            (logits,) = tp.gather_and_linear(
                t.final_norm(x), [(self.word_embeddings, None)], self.comm, self.keep_gathered
            )
        else:
            h = tp.copy_to_tensor_parallel(t.final_norm(x), self.comm)
            logits = torch.nn.functional.linear(h, self.word_embeddings)  # (B, T, V/p)
        loss = None
        if labels is not None:
            check_labels(input_ids, labels)
            loss = tp.vocab_parallel_cross_entropy(
                logits[:, :-1], labels[:, 1:], self.comm, ignore_index=IGNORE_INDEX
            )
        return CausalLMOutput(loss, logits)
