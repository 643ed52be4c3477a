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


class _Embeddings(nn.Module):
    def __init__(self, cfg: TransformerConfig, comm: Communicator) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = tp.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm)
        dev = comm.device
        self.position = (
            nn.Embedding(cfg.max_positions, cfg.hidden_size, device=dev)
            if cfg.position == "learned"
            else None
        )
        self.norm = (
            nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=dev)
            if cfg.embedding_layernorm
            else None
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if self.position is not None and seq_len > self.cfg.max_positions:
            raise ValueError(
                f"sequence of {seq_len} tokens, but the model has {self.cfg.max_positions} positions"
            )
        x = self.word(input_ids)
        if self.position is not None:
            x = x + self.position(torch.arange(seq_len, device=input_ids.device))[None]
        return x if self.norm is None else self.norm(x)


class _Block(nn.Module):
    """Pre-LN block: x + Attn(LN(x)), then x + MLP(LN(x)); 2 allreduces forward, 2 backward."""

    def __init__(self, cfg: TransformerConfig, comm: Communicator) -> None:
        super().__init__()
        dev = comm.device
        self.attention = tp.ParallelSelfAttention(cfg.hidden_size, cfg.n_heads, comm)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=dev)
        self.mlp = tp.ParallelMLP(cfg.hidden_size, cfg.ffn_size, comm)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=dev)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class _Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig, comm: Communicator) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg, comm)
        self.blocks = nn.ModuleList(_Block(cfg, comm) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, device=comm.device)


class TensorParallelDecoderLM(nn.Module):
    """``forward(input_ids, labels=None, attention_mask=None) -> CausalLMOutput(loss, local logits)``.

    The logits are this rank's vocabulary columns, (B, T, V/p); ``gather_logits`` concatenates
    them. Build it from a dense model with ``from_dense`` so both start equal.
    """

    def __init__(self, cfg: TransformerConfig, comm: Communicator) -> None:
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
        self.transformer = _Transformer(cfg, comm)

    @classmethod
    def from_dense(cls, dense: DecoderLM, comm: Communicator) -> TensorParallelDecoderLM:
        """A tensor-parallel copy of ``dense``: this rank's slices of the split weights, the rest copied."""
        model = cls(dense.cfg, comm)
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
        t = self.transformer
        x = t.embeddings(input_ids)
        bias = transformer.attention_bias(self.cfg, input_ids.shape[1], attention_mask, x.dtype, x.device)
        for block in t.blocks:
            x = block(x, bias)
        h = tp.copy_to_tensor_parallel(t.final_norm(x), self.comm)
        logits = torch.nn.functional.linear(h, self.word_embeddings)  # (B, T, V/p)
        loss = None
        if labels is not None:
            check_labels(input_ids, labels)
            loss = tp.vocab_parallel_cross_entropy(
                logits[:, :-1], labels[:, 1:], self.comm, ignore_index=IGNORE_INDEX
            )
        return CausalLMOutput(loss, logits)
