"""Data for the BERT track: text, tokenizer, MLM blocks and masking, the distributed sampler.

    from minidist import data
    text = data.corpus_articles()            # list of article strings ("train", "eval", "all")
    tok = data.load_tokenizer()              # tokenizers.Tokenizer, WordPiece, 8192 entries (shipped)
    blocks = data.mlm_dataset(tok, seq_len=128)            # LongTensor (n_blocks, 128), cached
    batch = data.mask_tokens(blocks[:32], tok, generator)  # (input_ids, labels with -100)
    sampler = data.DistributedSampler(len(blocks), comm.rank, comm.world_size, seed=0)
    sampler.set_epoch(epoch); indices = list(sampler)

Modules: ``sources`` (the raw text and the cache folder), ``corpus`` (article text and the
held-out split), ``tokenizer`` (WordPiece), ``mlm`` (packing and masking), ``lm`` (causal-LM
blocks for the decoder), ``sampler`` (which rank reads what).
"""

from minidist.data.corpus import HELD_OUT_EVERY, clean_wiki_text, corpus_articles
from minidist.data.lm import lm_dataset, pack_causal_blocks
from minidist.data.mlm import IGNORE_INDEX, MaskedBatch, mask_tokens, mlm_dataset, pack_blocks
from minidist.data.sampler import DistributedSampler
from minidist.data.tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    special_token_ids,
    tokenizer_digest,
    tokenizer_from_vocab,
    tokenizer_path,
    train_tokenizer,
    vocabulary,
)

__all__ = [
    "HELD_OUT_EVERY",
    "IGNORE_INDEX",
    "SPECIAL_TOKENS",
    "tokenizer_digest",
    "DistributedSampler",
    "MaskedBatch",
    "clean_wiki_text",
    "corpus_articles",
    "lm_dataset",
    "load_tokenizer",
    "mask_tokens",
    "mlm_dataset",
    "pack_blocks",
    "pack_causal_blocks",
    "special_token_ids",
    "tokenizer_from_vocab",
    "tokenizer_path",
    "train_tokenizer",
    "vocabulary",
]
