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

The course's 8192-entry vocabulary ships with the library (``wordpiece-8192.txt``, one token per
line in id order), and ``load_tokenizer()`` builds the tokenizer from it. Why not train it on each
machine: ``tokenizers``' trainer breaks ties between equally frequent merges in hash order, so two
trainings on the same text differ in a handful of tokens -- and thousands of ids. Shipping the
vocabulary makes every machine (a student's laptop, CI, the grader) see the same ids; a test
checks that training with ``train_tokenizer`` on the course text still gives almost the same
vocabulary (``python -m minidist.data.tokenizer`` rewrites the file from a fresh training).
Other vocabulary sizes are trained on the course's training split (a few seconds) and cached as
a JSON file under the GloVe cache folder (``$MINIDIST_CACHE``, default ``~/.cache/minidist``)
whose name carries the vocabulary size and ``TOKENIZER_VERSION``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from minidist.data.corpus import corpus_articles
from minidist.data.sources import cache_dir

__all__ = [
    "SPECIAL_TOKENS",
    "tokenizer_digest",
    "TOKENIZER_VERSION",
    "load_tokenizer",
    "special_token_ids",
    "tokenizer_from_vocab",
    "vocabulary",
    "tokenizer_path",
    "train_tokenizer",
]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_VERSION = 1
DEFAULT_VOCAB_SIZE = 8192


SHIPPED_VOCAB = Path(__file__).with_name(f"wordpiece-{DEFAULT_VOCAB_SIZE}.txt")


def _bert_pipeline(model: models.WordPiece) -> Tokenizer:
    """BERT's normaliser, pre-tokeniser and decoder around a WordPiece model."""
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A WordPiece tokenizer with ``vocab_size`` entries (special tokens included) learnt from ``texts``."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tok = _bert_pipeline(models.WordPiece(unk_token="[UNK]"))
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _with_bert_template(tok)


def tokenizer_from_vocab(tokens: list[str]) -> Tokenizer:
    """The tokenizer whose vocabulary is ``tokens`` (id = position), with BERT's pipeline."""
    if len(set(tokens)) != len(tokens):
        raise ValueError("the vocabulary has repeated tokens: each line must be a different token")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = _bert_pipeline(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocabulary: ids unchanged
    return _with_bert_template(tok)


def vocabulary(tok: Tokenizer) -> list[str]:
    """The tokens of ``tok`` in id order."""
    by_id = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda item: item[1])
    return [token for token, _ in by_id]


def _with_bert_template(tok: Tokenizer) -> Tokenizer:
    ids = special_token_ids(tok)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    return tok


def tokenizer_digest(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's JSON: cached token ids and trained weights record it, so that
    another tokenizer never reads ids (or weights) made with this one."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


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
    """The course tokenizer: the shipped vocabulary for the default size; another size is read
    from the cache, or trained on ``corpus_articles("train")`` and saved."""
    if vocab_size == DEFAULT_VOCAB_SIZE:
        return tokenizer_from_vocab(SHIPPED_VOCAB.read_text(encoding="utf-8").splitlines())
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


if __name__ == "__main__":  # rewrite the shipped vocabulary from a fresh training (maintainers)
    trained = train_tokenizer(corpus_articles("train"), DEFAULT_VOCAB_SIZE)
    SHIPPED_VOCAB.write_text("".join(token + "\n" for token in vocabulary(trained)), encoding="utf-8")
    print(f"wrote {SHIPPED_VOCAB} ({DEFAULT_VOCAB_SIZE} tokens)")
