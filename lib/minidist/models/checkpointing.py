"""Activation checkpointing: keep fewer activations for backward, recompute the rest when needed.

Backward needs tensors that forward computed (a Linear needs its input, a softmax its output).
Autograd keeps them all from forward until backward reaches them, so a training step holds the
activations of every layer at once. Korthikanti et al. (2022) count, per transformer layer and
in 16-bit with dropout, s·b·h·(34 + 5·a·s/h) bytes (s sequence, b batch, h hidden, a heads):
the 34·s·b·h part grows with s, the 5·a·s²·b part (attention scores, softmax, its dropout
mask) with s², and it dominates for long sequences.

Checkpointing trades compute for memory: run a piece of the forward under ``no_grad`` (nothing
is saved inside it), keep only its inputs, and when backward arrives run the piece again with
grad on and backpropagate through the fresh copy::

    forward:   x ──[ piece under no_grad ]──► y          saved: x only
    backward:  x ──[ piece again, grad on ]──► y'   then  y'.backward(dy)  ──► dx, d(weights)

Two choices of "piece" (``apply_checkpointing(model, mode)``):

    "full"       each TransformerBlock: a layer keeps only its input, s·b·h values, and the
                 whole forward runs twice (about 1/3 more compute per step).
    "selective"  only the attention core softmax(Q Kᵀ/√d + bias)·V: the s²-sized tensors are
                 dropped and recomputed, everything linear in s is kept. It removes the
                 5·a·s²·b term for a few percent of the FLOPs (Korthikanti et al., section 4).

Randomness: a recomputed dropout must draw the same mask as the first forward did. ``checkpoint``
saves the CPU generator's state (and the CUDA one when its inputs are on a GPU) before the first
run and restores it around the recomputation, inside ``torch.random.fork_rng`` so that the
generator outside moves on as if nothing had been recomputed.

The course's ``checkpoint`` is the "re-entrant" kind: its backward calls ``torch.autograd.backward``
on the recomputed piece, which accumulates the weights' gradients into ``.grad`` directly. So use
``loss.backward()``, not ``torch.autograd.grad(loss, params)``, with a checkpointed model (torch's
``use_reentrant=False`` variant, built on saved-tensor hooks, lifts that limit).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minidist import measure
from minidist.models.bert import BertForMLM
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import MultiHeadSelfAttention, TransformerBlock, TransformerConfig

__all__ = [
    "checkpoint",
    "attention_core",
    "apply_checkpointing",
    "remove_checkpointing",
    "checkpointing_mode",
    "measure_checkpointing",
    "MODES",
]

MODES = ("none", "selective", "full")


class _Checkpoint(torch.autograd.Function):
    """forward: ``fn(*args)`` under no_grad, saving only the tensor inputs; backward: recompute, backprop."""

    @staticmethod
    def forward(ctx, fn: Callable, anchor: torch.Tensor, *args: Any):  # noqa: ARG004 (anchor: see checkpoint)
        ctx.fn = fn
        # Non-tensor arguments (None, numbers) are kept as they are; tensors go through
        # save_for_backward, so they are counted like any other saved activation.
        ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [args[i] for i in ctx.tensor_positions]
        ctx.save_for_backward(*tensors)
        ctx.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.is_cuda})
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        with torch.no_grad():
            out = fn(*args)
        return out

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        saved = ctx.saved_tensors
        args = list(ctx.others)
        inputs = []
        for i, t in zip(ctx.tensor_positions, saved, strict=True):
            x = t.detach().requires_grad_(t.requires_grad)
            args[i] = x
            inputs.append(x)
        # Recompute with the generators as they were at the first forward, then put them back.
        with torch.random.fork_rng(devices=ctx.cuda_devices):
            torch.set_rng_state(ctx.cpu_rng)
            for d, state in zip(ctx.cuda_devices, ctx.cuda_rng, strict=True):
                torch.cuda.set_rng_state(state, d)
            with torch.enable_grad():
                out = ctx.fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs, strict=True) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads: list[torch.Tensor | None] = [None] * len(args)
        for i, x in zip(ctx.tensor_positions, inputs, strict=True):
            grads[i] = x.grad if x.requires_grad else None
        return (None, None, *grads)


def checkpoint(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and recomputing ``fn`` during backward.

    ``fn`` returns a tensor or a tuple of tensors. Its weights (closed over, e.g. a module's
    parameters) get their gradients when backward passes through, as without checkpointing.
    An empty "anchor" tensor that requires grad is passed along so that the output requires
    grad even when no input does (the first layer's input, say): otherwise autograd would never
    call our backward and the weights inside ``fn`` would get no gradient.
    """
    if not torch.is_grad_enabled():
        return fn(*args)  # nothing will be saved anyway: no reason to pay for the machinery
    anchor = torch.empty(0, requires_grad=True)
    return _Checkpoint.apply(fn, anchor, *args)


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout: nn.Module
) -> torch.Tensor:
    """softmax(Q Kᵀ / √d_head + bias) V on split heads (B, H, T, d_head): the part selective recompute drops.

    The same operations, in the same order, as ``MultiHeadSelfAttention.forward`` (so gradients agree
    exactly); every tensor made here except the result is (B, H, T, T).
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    return dropout(torch.softmax(scores, dim=-1)) @ v


def _selective_attention_forward(
    attn: MultiHeadSelfAttention, x: torch.Tensor, bias: torch.Tensor | None = None
):
    """``MultiHeadSelfAttention.forward`` with its core under ``checkpoint``: Q, K, V kept, scores not."""
    batch, seq_len, d = x.shape
    q, k, v = attn.split_heads(attn.query(x)), attn.split_heads(attn.key(x)), attn.split_heads(attn.value(x))
    out = checkpoint(attention_core, q, k, v, bias, attn.attn_dropout)
    return attn.output(out.transpose(1, 2).reshape(batch, seq_len, d))


def _full_block_forward(block: TransformerBlock, x: torch.Tensor, bias: torch.Tensor | None = None):
    """``TransformerBlock.forward`` under ``checkpoint``: the block keeps only its input."""
    return checkpoint(type(block).forward.__get__(block), x, bias)


_MODE_ATTR = "_minidist_checkpointing"


def _blocks(model: nn.Module) -> list[TransformerBlock]:
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no TransformerBlock: apply_checkpointing works on models built "
            "from minidist.models.transformer (DecoderLM, BertForMLM, Transformer)"
        )
    return blocks


def apply_checkpointing(model: nn.Module, mode: str = "full") -> nn.Module:
    """Checkpoint every TransformerBlock of ``model`` in place; returns ``model``.

    ``mode``: "full" (the whole block), "selective" (the attention core only) or "none" (undo,
    the same as ``remove_checkpointing``). The parameters and ``state_dict`` are untouched: only
    the blocks' (or their attention's) ``forward`` is replaced on the instance.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    blocks = _blocks(model)
    remove_checkpointing(model)
    for block in blocks:
        if mode == "full":
            block.forward = _full_block_forward.__get__(block)
        elif mode == "selective":
            block.attention.forward = _selective_attention_forward.__get__(block.attention)
        setattr(block, _MODE_ATTR, mode)
    return model


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo ``apply_checkpointing``: every block runs its class's own forward again."""
    for block in _blocks(model):
        block.__dict__.pop("forward", None)
        block.attention.__dict__.pop("forward", None)
        setattr(block, _MODE_ATTR, "none")
    return model


def checkpointing_mode(model: nn.Module) -> str:
    """The mode applied to ``model``'s blocks ("none", "selective", "full"), or "mixed"."""
    modes = {getattr(b, _MODE_ATTR, "none") for b in _blocks(model)}
    return modes.pop() if len(modes) == 1 else "mixed"


def measure_checkpointing(
    cfg: TransformerConfig,
    batch: int,
    seq: int,
    modes: tuple[str, ...] = MODES,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Bytes saved for backward and the time of one training step, per checkpointing mode.

    Builds a ``DecoderLM`` (causal configs) or ``BertForMLM`` from ``cfg`` with ``seed``, runs one
    forward and backward on random tokens per mode. ``saved_bytes`` is counted by
    ``minidist.measure.saved_activation_bytes`` (distinct storages saved for backward during the
    forward); ``step_s`` is the best of ``repeats`` forward+backward timings. Returns
    ``{mode: {"saved_bytes": ..., "step_s": ...}}``; ``time ratio`` vs "none" is what recompute costs.
    """
    torch.manual_seed(seed)
    model = DecoderLM(cfg) if cfg.causal else BertForMLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))

    def loss_of(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids, labels=input_ids).loss

    results: dict[str, dict[str, float]] = {}
    try:
        for mode in modes:
            apply_checkpointing(model, mode)
            saved = measure.saved_activation_bytes(loss_of, ids)
            times = []
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                loss_of(ids).backward()
                times.append(time.perf_counter() - start)
            results[mode] = {"saved_bytes": float(saved), "step_s": min(times)}
    finally:
        remove_checkpointing(model)
    return results
