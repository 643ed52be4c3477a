"""Cut a ``DecoderLM`` into pipeline stages (for ``minidist.parallel.pipeline``).

    DecoderLM:  ids ─► embeddings ─► block 0 .. block L-1 ─► final norm ─► h·Eᵀ ─► logits
    p = 2:      stage 0: ids ─► embeddings ─► blocks 0 .. L/2-1            ─► hidden (B, T, d)
                stage 1: hidden ─► blocks L/2 .. L-1 ─► final norm ─► h·Eᵀ ─► logits

The embeddings go with the first stage, the blocks are split evenly, and the final LayerNorm
and the output matrix go with the last; ``next_token_loss`` is the loss the last stage's
executor applies (``run_pipeline(..., loss_fn=next_token_loss)``).

The output matrix IS the word-embedding table E (tied). With p > 1 the first stage needs E to
look tokens up and the last stage needs it to score them, so each holds a copy. One process
would add the two gradients into one ``E.grad``; a pipeline must do the same by hand:
``sync_tied_gradients`` sends each copy's gradient to the other holder and adds (Megatron
all-reduces the embedding gradients between its first and last stage). Both copies then take
the same optimizer step and stay equal.

With ``chunks`` = v > 1 (interleaved schedules) the blocks are split into p·v virtual stages;
rank r holds virtual stages r, r + p, ..., as a list of v modules.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models.decoder import DecoderLM, next_token_loss  # noqa: F401  (the last stage's loss_fn)
from minidist.models.transformer import attention_bias

from ..comm import Communicator

__all__ = ["DecoderStage", "split_decoder", "next_token_loss", "sync_tied_gradients"]

_WORD = "transformer.embeddings.word.weight"


class DecoderStage(nn.Module):
    """A slice of a decoder: [embeddings] + some blocks [+ final norm + tied output matrix].

    ``original_names`` maps each of its parameter names to the name in the ``DecoderLM`` it
    came from (both copies of the tied table map to ``transformer.embeddings.word.weight``).
    """

    def __init__(self, model: DecoderLM, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.first_block = first
        self.original_names: dict[str, str] = {}
        t = model.transformer
        self.embeddings = copy.deepcopy(t.embeddings) if is_first else None
        if is_first:
            for name, _ in t.embeddings.named_parameters():
                self.original_names[f"embeddings.{name}"] = f"transformer.embeddings.{name}"
        self.blocks = nn.ModuleList(copy.deepcopy(t.blocks[i]) for i in range(first, last))
        for j, i in enumerate(range(first, last)):
            for name, _ in t.blocks[i].named_parameters():
                self.original_names[f"blocks.{j}.{name}"] = f"transformer.blocks.{i}.{name}"
        self.final_norm = copy.deepcopy(t.final_norm) if is_last else None
        # The last stage's copy of E; on a one-stage split it is the embedding's own table.
        self.head = None
        if is_last:
            for name, _ in t.final_norm.named_parameters():
                self.original_names[f"final_norm.{name}"] = f"transformer.final_norm.{name}"
            if not is_first:
                self.head = nn.Parameter(model.word_embeddings.detach().clone())
                self.original_names["head"] = _WORD
        self.is_first, self.is_last = is_first, is_last

    @property
    def output_matrix(self) -> nn.Parameter:
        return self.embeddings.word.weight if self.head is None else self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, d) elsewhere; logits out of the last."""
        if self.embeddings is not None:
            if x.dim() != 2:
                raise ValueError(f"the first stage takes token ids (B, T), got shape {tuple(x.shape)}")
            x = self.embeddings(x)
        bias = attention_bias(self.cfg, x.shape[1], None, x.dtype, x.device)
        for block in self.blocks:
            x = block(x, bias)
        if self.is_last:
            x = F.linear(self.final_norm(x), self.output_matrix)
        return x


def split_decoder(model: DecoderLM, stages: int, chunks: int = 1) -> list:
    """``stages`` DecoderStage modules (a list of ``chunks`` modules per stage when chunks > 1).

    The blocks split evenly: n_layers must be a multiple of stages x chunks.
    """
    n = model.cfg.n_layers
    pieces = stages * chunks
    if stages < 1 or chunks < 1:
        raise ValueError(f"stages ({stages}) and chunks ({chunks}) must be >= 1")
    if n % pieces:
        raise ValueError(
            f"{n} layers do not split evenly into {stages} stages x {chunks} chunks = {pieces} pieces: "
            f"pick a number of stages (x chunks) that divides {n}"
        )
    per = n // pieces
    virtual = [
        DecoderStage(model, s * per, (s + 1) * per, is_first=s == 0, is_last=s == pieces - 1)
        for s in range(pieces)
    ]
    if chunks == 1:
        return virtual
    return [nn.ModuleList(virtual[c * stages + r] for c in range(chunks)) for r in range(stages)]


def sync_tied_gradients(stage_modules, comm: Communicator) -> None:
    """Sum the gradients of the two copies of the tied table E (first and last stage); both get the sum.

    Call it on every rank after ``run_pipeline`` and before the optimizer step; ranks that
    hold no copy return at once. The two holders exchange their gradients (isend, then recv)
    and add: afterwards each copy's ``.grad`` is the one-process gradient of E.
    """
    modules = (
        list(stage_modules) if isinstance(stage_modules, list | tuple | nn.ModuleList) else [stage_modules]
    )
    first = [mod for mod in modules if mod.is_first]
    last = [mod for mod in modules if mod.is_last and mod.head is not None]
    p = comm.world_size
    if first and last:  # both copies on this rank (one stage, several chunks): add locally
        e, h = first[0].embeddings.word.weight, last[0].head
        total = _grad(e) + _grad(h)
        e.grad, h.grad = total, total.clone()
        return
    if p == 1 or not (first or last):
        return
    mine = first[0].embeddings.word.weight if first else last[0].head
    peer = p - 1 if first else 0
    grad = _grad(mine)
    work = comm.isend(grad.clone(), peer, 7311)
    other = comm.recv(torch.empty_like(grad), peer, 7311)
    work.wait()
    mine.grad = grad + other


def _grad(param: nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
