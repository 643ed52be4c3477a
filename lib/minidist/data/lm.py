"""Causal-language-model data: the corpus as blocks of token ids for next-token prediction.

Every article is tokenised without special tokens, the articles are concatenated in corpus order
with a [SEP] after each (the same stream as ``mlm.pack_blocks``), and the stream is cut into
blocks of ``seq_len`` tokens. There is no [CLS]: a decoder predicts each token from the ones
before it, and a block needs no summary token.

    stream:  a1 a2 a3 [SEP] b1 b2 b3 b4 b5 [SEP] c1 c2 ...
    blocks:  a1 a2 a3 [SEP] b1 b2 b3 b4            (seq_len = 8)
             b5 [SEP] c1 c2 ...

Inside a block, position t predicts token t + 1 (``DecoderLM(ids, labels=ids)`` shifts), so a
block of ``seq_len`` tokens gives ``seq_len - 1`` predictions. A block may cross an article
boundary; the [SEP] tells the model that what follows is a new text (GPT-2 packs its training
data the same way, with its end-of-text token). The tail that does not fill a block is dropped.

14,342 blocks of 128 tokens for "train" (1.84M tokens) and 237 for "eval"; cached under
``$MINIDIST_CACHE`` like the MLM blocks (the file name holds the tokenizer's digest).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from minidist.data.corpus import SPLITS, corpus_articles
from minidist.data.mlm import pack_blocks
from minidist.data.sources import cache_dir
from minidist.data.tokenizer import special_token_ids, tokenizer_digest

__all__ = ["LM_DATA_VERSION", "lm_dataset", "pack_causal_blocks"]

LM_DATA_VERSION = 1


def pack_causal_blocks(token_lists: Sequence[Sequence[int]], sep_id: int, seq_len: int) -> torch.Tensor:
    """Concatenate ``token_lists`` with ``sep_id`` after each and cut into blocks: LongTensor (n, seq_len).

    The stream is MLM packing's: ``mlm.pack_blocks`` with blocks one longer leads each piece of
    ``seq_len`` stream tokens with a [CLS] column, which we drop.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one token predicts the next), got {seq_len}")
    return pack_blocks(token_lists, cls_id=sep_id, sep_id=sep_id, seq_len=seq_len + 1)[:, 1:].contiguous()


def dataset_path(tok: Tokenizer, seq_len: int, split: str) -> Path:
    # The file name carries a digest of the tokenizer: another tokenizer never reads these ids.
    digest = tokenizer_digest(tok)[:12]
    return cache_dir() / f"lm-{split}-seq{seq_len}-tok{digest}-v{LM_DATA_VERSION}.pt"


def lm_dataset(tok: Tokenizer, seq_len: int = 128, split: str = "train", cache: bool = True) -> torch.Tensor:
    """The corpus split ``split`` ("train", "eval", "all") as causal-LM blocks, LongTensor (n, seq_len).

    Tokenising takes a few seconds; the blocks are cached as int16 (any id below 32768).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
    path = dataset_path(tok, seq_len, split)
    if cache and path.exists():
        return torch.load(path, weights_only=True).long()
    encodings = tok.encode_batch(corpus_articles(split), add_special_tokens=False)
    blocks = pack_causal_blocks([e.ids for e in encodings], special_token_ids(tok)["[SEP]"], seq_len)
    if cache:
        if tok.get_vocab_size() > 2**15:
            raise ValueError("the cache stores ids as int16: vocabularies above 32768 need cache=False")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(blocks.to(torch.int16), partial)
        os.replace(partial, path)  # atomic: a concurrent reader never sees half a file
    return blocks
