"""Prompt tuning (Lester et al., 2021, "The Power of Scale for Parameter-Efficient Prompt Tuning").

Keep *every* weight frozen and learn n vectors that are prepended to the embedded input, a
"soft prompt" the model reads before the text::

    embedded text (B, T, d)  ──►  [p_1 … p_n | e_1 … e_T]  (B, n + T, d)  ──► frozen blocks
    labels                   ──►  [-100 … -100 | l_1 … l_T]   (prompt positions predict nothing)

n·d trainable numbers (20 × 14336 = 287k for BLOOM): the smallest adapter there is, and the
one that travels best over a network, since only activations and the prompt move. Its sibling
``adapters`` (LoRA) changes the weights' output instead; ``training.finetune`` trains either.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.models import decoder as decoder_mod
from minidist.models import transformer

__all__ = ["PromptTuning", "prompt_forward"]

IGNORE_INDEX = decoder_mod.IGNORE_INDEX


class PromptTuning(nn.Module):
    """n trainable vectors prepended to the embedded input (Lester et al.'s soft prompt).

    ``forward(embedded)``: (B, T, d) -> (B, n + T, d). ``extend_labels`` and
    ``extend_attention_mask`` make the matching (B, n + T) labels (-100 for the prompt: nothing
    to predict there) and mask (1: the prompt is always attended to). ``init_std`` is the
    spread of the starting vectors; Lester et al. found starting from real word embeddings
    helps (``init_from``), which we offer too.
    """

    def __init__(
        self, n_tokens: int, hidden: int, init_std: float = 0.02, init_from: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        if n_tokens < 1 or hidden < 1:
            raise ValueError(f"n_tokens and hidden must be positive, got {n_tokens} and {hidden}")
        if init_from is not None:
            if init_from.shape != (n_tokens, hidden):
                raise ValueError(f"init_from must be ({n_tokens}, {hidden}), got {tuple(init_from.shape)}")
            start = init_from.detach().clone().float()
        else:
            start = torch.randn(n_tokens, hidden) * init_std
        self.n_tokens, self.hidden = n_tokens, hidden
        self.prompts = nn.Parameter(start)

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        if embedded.dim() != 3 or embedded.shape[-1] != self.hidden:
            raise ValueError(f"expected embedded input (B, T, {self.hidden}), got {tuple(embedded.shape)}")
        prompts = self.prompts.to(embedded.dtype).expand(embedded.shape[0], -1, -1)
        return torch.cat([prompts, embedded], dim=1)

    def extend_labels(self, labels: torch.Tensor) -> torch.Tensor:
        pad = labels.new_full((labels.shape[0], self.n_tokens), IGNORE_INDEX)
        return torch.cat([pad, labels], dim=1)

    def extend_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        ones = attention_mask.new_ones((attention_mask.shape[0], self.n_tokens))
        return torch.cat([ones, attention_mask], dim=1)


def prompt_forward(
    model: decoder_mod.DecoderLM,
    prompt: PromptTuning,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> decoder_mod.CausalLMOutput:
    """``model(input_ids, labels)`` with ``prompt`` prepended to the word embeddings.

    Positions (learned table) and the embedding LayerNorm apply to the n + T sequence, as if the
    prompt were n extra tokens. The loss is the next-token loss over the extended labels, so
    the last prompt vector predicts the first real token. Logits are (B, n + T, V).
    """
    emb = model.transformer.embeddings
    cfg = model.cfg
    x = prompt(emb.word(input_ids))
    seq_len = x.shape[1]
    if emb.position is not None:
        if seq_len > cfg.max_positions:
            raise ValueError(
                f"{prompt.n_tokens} prompt vectors + {input_ids.shape[1]} tokens = {seq_len} positions, "
                f"the model has {cfg.max_positions}: shorten the input or the prompt"
            )
        x = x + emb.position(torch.arange(seq_len, device=x.device))[None]
    if emb.segment is not None:
        raise ValueError("prompt_forward supports decoders without segment embeddings")
    if emb.norm is not None:
        x = emb.norm(x)
    x = emb.dropout(x)
    mask = None if attention_mask is None else prompt.extend_attention_mask(attention_mask)
    bias = transformer.attention_bias(cfg, seq_len, mask, x.dtype, x.device)
    for block in model.transformer.blocks:
        x = block(x, bias)
    if model.transformer.final_norm is not None:
        x = model.transformer.final_norm(x)
    logits = torch.nn.functional.linear(x, model.word_embeddings)
    loss = None
    if labels is not None:
        decoder_mod.check_labels(input_ids, labels)
        loss = decoder_mod.next_token_loss(logits, prompt.extend_labels(labels))
    return decoder_mod.CausalLMOutput(loss, logits)
