"""Lecture 10, section 5: one transformer block, tensor parallel with and without sequence parallel."""

import torch

from minidist import measure
from minidist.models import decoder, transformer
from minidist.models.tp_decoder import TensorParallelDecoderLM

D, HEADS, BATCH, SEQ = 48, 4, 2, 16


def block_config() -> transformer.TransformerConfig:
    return transformer.TransformerConfig(
        vocab_size=64, hidden_size=D, n_layers=1, n_heads=HEADS, max_positions=SEQ, causal=True, pre_ln=True
    )


def saved_bytes(block, x, bias):
    """The block's output and the bytes of the activations it saves for backward (weights left out)."""
    y, records = measure.saved_tensors(block, x, bias)
    return y, sum(r.storage_bytes for r in records if r.new_storage)


def sp_body(comm) -> dict:
    """Rank body: the block under TP and under TP + SP: bytes sent forward and backward, the bytes
    it saves for backward, and its output (SP: this rank's S/t tokens)."""
    torch.manual_seed(0)
    dense = decoder.DecoderLM(block_config())
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(BATCH, SEQ, D, generator=gen)
    bias = transformer.attention_bias(block_config(), SEQ, None, torch.float32, torch.device("cpu"))
    out = {}
    for name, sp in (("tp", False), ("sp", True)):
        block = TensorParallelDecoderLM.from_dense(dense, comm, sequence_parallel=sp).transformer.blocks[0]
        x = x_full.chunk(comm.world_size, dim=1)[comm.rank] if sp else x_full
        x = x.clone().requires_grad_(False)
        s0 = comm.stats.copy()
        y, saved = saved_bytes(block, x, bias)
        s1 = comm.stats.copy()
        y.sum().backward()
        s2 = comm.stats.copy()
        out[name] = {
            "y": y.detach(),
            "saved_bytes": saved,
            "forward_bytes": (s1 - s0).bytes_sent,
            "backward_bytes": (s2 - s1).bytes_sent,
        }
    return out
