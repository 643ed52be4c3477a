"""The course's WordPiece tokenizer (BERT's scheme), trained with Hugging Face ``tokenizers`` and cached.

    "Hogwild updates!" ─ normalise (lower case, accents off) ─► "hogwild updates!"
                       ─ pre-tokenise (whitespace, punctuation) ─► ["hogwild", "updates", "!"]
                       ─ WordPiece (longest vocabulary prefix first) ─► ["hog", "##wild", "updates", "!"]

WordPiece keeps frequent words whole and splits rare ones into pieces ("##" marks a piece that
continues a word), so every word has an encoding and the vocabulary stays small: 8192 entries
here (BERT used 30522), which keeps the MLM output layer, V x d, a modest share of a small model.

The five special tokens come first, so their ids are fixed: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3,
[MASK]=4. ``tok.encode(text)`` adds [CLS] ... [SEP] (BERT's template);
``tok.encode(text, add_special_tokens=False)`` does not.

Training on the course's training split takes a few seconds; the result is a JSON file under the
GloVe cache folder (``$MINIDIST_CACHE``, default ``~/.cache/minidist``) whose name carries the
vocabulary size and ``TOKENIZER_VERSION`` (bump it when the corpus or the recipe changes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from minidist.data.corpus import corpus_articles
from minidist.glove.data import cache_dir

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_VERSION",
    "load_tokenizer",
    "special_token_ids",
    "tokenizer_path",
    "train_tokenizer",
]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A WordPiece tokenizer with ``vocab_size`` entries (special tokens included) learnt from ``texts``."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    ids = special_token_ids(tok)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{"[PAD]": 0, "[UNK]": 1, ...}: the ids of the special tokens; a clear error if one is missing."""
    ids = {}
    for token in SPECIAL_TOKENS:
        token_id = tok.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"the tokenizer has no {token} token: use minidist.data.load_tokenizer() "
                "or train_tokenizer(), which add all of " + " ".join(SPECIAL_TOKENS)
            )
        ids[token] = token_id
    return ids


def tokenizer_path(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Where ``load_tokenizer`` keeps the tokenizer trained on the training split."""
    return cache_dir() / f"wordpiece-train-{vocab_size}-v{TOKENIZER_VERSION}.json"


def load_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, cache: bool = True) -> Tokenizer:
    """The course tokenizer: read from the cache, or trained on ``corpus_articles("train")`` and saved."""
    path = tokenizer_path(vocab_size)
    if cache and path.exists():
        return Tokenizer.from_file(str(path))
    tok = train_tokenizer(corpus_articles("train"), vocab_size)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(partial))
        os.replace(partial, path)  # atomic: a concurrent reader never sees half a file
    return tok
