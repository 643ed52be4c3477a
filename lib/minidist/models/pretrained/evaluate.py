"""Measuring a language model: held-out perplexity, and what quantizing the weights does to it.

``perplexity``: the exponential of the mean next-token negative log-likelihood on held-out text,

    perplexity = exp( - 1/N  Σ_t  log p(x_{t+1} | x_1 .. x_t) )

"as uncertain as a uniform choice among that many tokens". An untrained model's logits are
nearly equal, so its perplexity is about the vocabulary size (8192); a unigram model (token
frequencies, no context: ``unigram_perplexity``) is the baseline any language model must beat.
Measured on the "eval" split (237 blocks of 128 tokens): untrained 8,459, unigram 1,050, the
course model 112 (105 on its training split; version 1 of its recipe, 400 steps, reached 419).

``perplexity_by_format`` puts the same model in fp32, bf16, int8 and NF4 side by side with the
bytes its weights occupy. Only ``nn.Linear`` weights are quantized; the word table (which is
also the output matrix) stays fp32. In this small model the table is more than half the
parameters, so the whole-model bits per parameter stay far above 4 even for NF4; in BLOOM-176B
the table is 3.6B of 176B parameters (2%), and the linear-layer figure (``linear_bits_per_param``)
is the one that scales.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from minidist import data, quant
from minidist.measure import tensor_bytes
from minidist.models.decoder import DecoderLM

__all__ = ["perplexity", "perplexity_by_format", "unigram_perplexity"]


def _eval_blocks(
    split: str, seq_len: int, max_blocks: int | None, blocks: torch.Tensor | None, tok: Tokenizer | None
) -> torch.Tensor:
    if blocks is None:
        blocks = data.lm_dataset(tok or data.load_tokenizer(), seq_len, split)
    if max_blocks is not None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1 (or None for all), got {max_blocks}")
        blocks = blocks[:max_blocks]
    if blocks.dim() != 2 or blocks.shape[1] < 2:
        raise ValueError(f"blocks must be (n, seq_len >= 2) token ids, got shape {tuple(blocks.shape)}")
    return blocks


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    split: str = "eval",
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
    batch_size: int = 32,
) -> float:
    """exp(mean next-token negative log-likelihood) of ``model`` on a split's causal-LM blocks.

    Every block of ``seq_len`` tokens gives ``seq_len - 1`` predictions; the mean is over all
    predictions of all blocks (the first ``max_blocks``, or all). ``blocks`` replaces the split
    (any (n, T) id tensor). ``model(ids)`` must return logits (B, T, V) or an object with
    ``.logits``; they are compared in fp32 whatever the model's dtype.
    """
    blocks = _eval_blocks(split, seq_len, max_blocks, blocks, tok)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total_nll, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size].to(device)
        out = model(ids)
        logits = getattr(out, "logits", out)
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(total_nll / count)


def unigram_perplexity(
    split: str = "eval",
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    train_blocks: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
) -> float:
    """The baseline without context: p(token) = (count in the train split + 1) / (N + V), add-one
    smoothed so that unseen tokens have a finite cost; scored on the same predicted positions
    as ``perplexity``."""
    tok = tok or data.load_tokenizer()
    if train_blocks is None:
        train_blocks = data.lm_dataset(tok, seq_len, "train")
    blocks = _eval_blocks(split, seq_len, max_blocks, blocks, tok)
    vocab = tok.get_vocab_size()
    counts = torch.bincount(train_blocks.flatten(), minlength=vocab).double() + 1.0
    log_p = counts.log() - counts.sum().log()
    return math.exp(-log_p[blocks[:, 1:].flatten()].mean().item())


def _linear_weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes, parameters) of the weights of the linear layers (quantized or not), biases excluded."""
    nbytes = params = 0
    for module in model.modules():
        if isinstance(module, quant.QuantizedLinear):
            nbytes += module.weight_nbytes
            params += module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear):
            nbytes += tensor_bytes(module.weight)
            params += module.weight.numel()
    return nbytes, params


def perplexity_by_format(
    model: DecoderLM,
    formats: tuple[str, ...] = ("fp32", "bf16", "int8", "nf4"),
    seq_len: int = 128,
    max_blocks: int | None = None,
    *,
    blocks: torch.Tensor | None = None,
    tok: Tokenizer | None = None,
) -> list[dict]:
    """Held-out perplexity and measured weight memory of ``model`` stored in each format.

    "fp32" is the model as given; "bf16" casts every weight (and the computation) to bfloat16;
    other formats go through ``quant.quantize_linear_weights`` on a copy (linear layers
    quantized, the word table and LayerNorms kept). Each row: ``format``, ``perplexity``,
    ``weight_bytes`` (``memory.tensor_bytes`` of the whole model: every storage counted once),
    ``bits_per_param`` (8 x weight_bytes / parameters), and ``linear_weight_bytes``,
    ``linear_bits_per_param`` for the linear layers' weights alone.
    """
    n_params = sum(p.numel() for p in model.parameters())
    blocks = _eval_blocks("eval", seq_len, max_blocks, blocks, tok)
    rows = []
    for fmt in formats:
        if fmt == "fp32":
            variant = model
        elif fmt == "bf16":
            variant = copy.deepcopy(model).to(torch.bfloat16)
        else:
            variant = quant.quantize_linear_weights(copy.deepcopy(model), fmt)
        weight_bytes = tensor_bytes(variant)
        linear_bytes, linear_params = _linear_weight_bytes(variant)
        rows.append(
            {
                "format": fmt,
                "perplexity": perplexity(variant, blocks=blocks),
                "weight_bytes": weight_bytes,
                "bits_per_param": 8 * weight_bytes / n_params,
                "linear_weight_bytes": linear_bytes,
                "linear_bits_per_param": 8 * linear_bytes / linear_params,
            }
        )
    return rows
