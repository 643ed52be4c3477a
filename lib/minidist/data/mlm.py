"""Masked-language-model data: the corpus as packed blocks of token ids, and BERT's masking.

Packing (``pack_blocks``): every article is tokenised without special tokens, the articles are
concatenated in corpus order with a [SEP] after each, and the stream is cut into pieces of
``seq_len - 1`` tokens; each block is [CLS] + piece. The tail that does not fill a block is
dropped (fewer than ``seq_len`` tokens of about 1.9M), so every block is full and no padding or
attention mask is needed:

    stream:  a1 a2 a3 [SEP] b1 b2 b3 b4 b5 [SEP] c1 c2 ...
    blocks:  [CLS] a1 a2 a3 [SEP] b1 b2      (seq_len = 8: 7 stream tokens per block)
             [CLS] b3 b4 b5 [SEP] c1 c2 ...

A block may hold the end of one article and the start of the next ([SEP] between them), as in
RoBERTa's "full sentences" packing; BERT's next-sentence task is not used.

Masking (``mask_tokens``), BERT's recipe: each non-special position is chosen with probability
``prob`` (0.15); a chosen position becomes [MASK] 80% of the time, a random ordinary token 10%,
and stays as it is 10%. Labels hold the original id at chosen positions and -100 elsewhere, so
the loss counts chosen positions only. The random and unchanged cases keep the model from
learning that only [MASK] positions matter (at fine-tuning time there is no [MASK]).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer

from minidist.data.corpus import SPLITS, corpus_articles
from minidist.data.sources import cache_dir
from minidist.data.tokenizer import special_token_ids, tokenizer_digest

__all__ = ["IGNORE_INDEX", "MLM_DATA_VERSION", "MaskedBatch", "mask_tokens", "mlm_dataset", "pack_blocks"]

IGNORE_INDEX = -100
MLM_DATA_VERSION = 1


def pack_blocks(token_lists: Sequence[Sequence[int]], cls_id: int, sep_id: int, seq_len: int) -> torch.Tensor:
    """Concatenate ``token_lists`` with ``sep_id`` after each, cut into [CLS]-led blocks (see the module doc).

    Returns a LongTensor (n_blocks, seq_len); the incomplete tail is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 ([CLS] and one token), got {seq_len}")
    stream = torch.tensor([t for tokens in token_lists for t in (*tokens, sep_id)], dtype=torch.long)
    per_block = seq_len - 1
    n_blocks = len(stream) // per_block
    body = stream[: n_blocks * per_block].view(n_blocks, per_block)
    return torch.cat([torch.full((n_blocks, 1), cls_id, dtype=torch.long), body], dim=1)


def dataset_path(tok: Tokenizer, seq_len: int, split: str) -> Path:
    # The file name carries a digest of the tokenizer: another tokenizer never reads these ids.
    digest = tokenizer_digest(tok)[:12]
    return cache_dir() / f"mlm-{split}-seq{seq_len}-tok{digest}-v{MLM_DATA_VERSION}.pt"


def mlm_dataset(tok: Tokenizer, seq_len: int = 128, split: str = "train", cache: bool = True) -> torch.Tensor:
    """The corpus split ``split`` ("train", "eval", "all") as packed blocks: LongTensor (n_blocks, seq_len).

    About 14,500 blocks of 128 for "train" and 240 for "eval". Tokenising takes a few seconds;
    the blocks are cached (as int16, which holds any id below 32768) next to the tokenizer.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
    path = dataset_path(tok, seq_len, split)
    if cache and path.exists():
        return torch.load(path, weights_only=True).long()
    ids = special_token_ids(tok)
    encodings = tok.encode_batch(corpus_articles(split), add_special_tokens=False)
    blocks = pack_blocks([e.ids for e in encodings], ids["[CLS]"], ids["[SEP]"], seq_len)
    if cache:
        if tok.get_vocab_size() > 2**15:
            raise ValueError("the cache stores ids as int16: vocabularies above 32768 need cache=False")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(blocks.to(torch.int16), partial)
        os.replace(partial, path)
    return blocks


class MaskedBatch(NamedTuple):
    """``input_ids`` with chosen positions replaced, ``labels`` (original id where chosen, else -100)."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def mask_tokens(
    ids: torch.Tensor, tok: Tokenizer, generator: torch.Generator, prob: float = 0.15
) -> MaskedBatch:
    """BERT's masking of a batch of token ids (any shape); ``ids`` itself is not modified.

    Special tokens ([PAD], [UNK], [CLS], [SEP], [MASK]) are never chosen, and the random
    replacement is drawn uniformly from the ordinary tokens. All randomness comes from
    ``generator``, so a seed fixes the masks (the evaluation uses one fixed mask set). The
    random numbers are drawn on the generator's device and moved to ``ids``' device, so a
    CPU generator gives the same masks for CPU and CUDA ids.
    """
    if not 0.0 < prob < 1.0:
        raise ValueError(f"prob must be in (0, 1), got {prob}")
    specials = special_token_ids(tok)
    vocab_size = tok.get_vocab_size()
    draw_on = generator.device
    special_ids = torch.tensor(sorted(specials.values()), device=ids.device)
    is_special = torch.isin(ids, special_ids)
    chosen = (torch.rand(ids.shape, generator=generator, device=draw_on).to(ids.device) < prob) & ~is_special
    action = torch.rand(ids.shape, generator=generator, device=draw_on).to(ids.device)
    to_mask = chosen & (action < 0.8)
    to_random = chosen & (action >= 0.8) & (action < 0.9)

    ordinary = torch.ones(vocab_size, dtype=torch.bool, device=ids.device)
    ordinary[special_ids] = False
    ordinary_ids = ordinary.nonzero().squeeze(1)
    draws = torch.randint(len(ordinary_ids), ids.shape, generator=generator, device=draw_on)
    random_ids = ordinary_ids[draws.to(ids.device)]

    input_ids = ids.clone()
    input_ids[to_mask] = specials["[MASK]"]
    input_ids[to_random] = random_ids[to_random]
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return MaskedBatch(input_ids, labels)
