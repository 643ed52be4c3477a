"""The course's text as articles: Wikipedia lead sections and the full articles of gensim's excerpt.

The raw readers live in ``minidist.data.sources`` (the GloVe track reads the same two sources);
here the text is kept as text, with the little wiki markup that ``filter_wiki`` leaves behind
removed, because a subword tokenizer wants sentences, not GloVe's lower-cased word lists.

    corpus_articles("all")    10,139 articles: 10,033 lead sections, then the excerpt's 106 articles
                              (its redirect pages dropped), about 1.25M words
    corpus_articles("train")  every article except every 50th (9,937)
    corpus_articles("eval")   every 50th article (index 49, 99, ...; 202): the held-out split

The held-out split is by article, so no sentence of an evaluation article was seen in training
(the tokenizer is trained on the training split too).
"""

from __future__ import annotations

import functools
import re

from minidist.data.sources import lead_sections, wiki_articles

__all__ = ["HELD_OUT_EVERY", "SPLITS", "clean_wiki_text", "corpus_articles"]

HELD_OUT_EVERY = 50
SPLITS = ("train", "eval", "all")

_HEADING = re.compile(r"^\s*=+[^=]*=+\s*$")
_BULLET = re.compile(r"^[*#:;]+\s*")
_EMPHASIS = re.compile(r"'{2,}")


def clean_wiki_text(text: str) -> str:
    """Drop section headings, list bullets and ''emphasis'' quotes; keep every other line's text.

    >>> clean_wiki_text("'''Anarchism''' is...\\n==History==\\n* a point")
    'Anarchism is...\\na point'
    """
    lines = []
    for line in text.splitlines():
        if _HEADING.match(line):
            continue
        line = _EMPHASIS.sub("", _BULLET.sub("", line)).strip()
        if line:
            lines.append(line)
    return "\n".join(lines)


@functools.cache
def _all_articles() -> tuple[str, ...]:
    # Read once per process (decompressing the excerpt takes seconds); a tuple, so callers cannot edit it.
    raw = lead_sections() + wiki_articles()
    # Half of the excerpt's pages are "#REDIRECT Title" lines, not articles.
    cleaned = (clean_wiki_text(t) for t in raw if not t.lstrip().upper().startswith("#REDIRECT"))
    return tuple(a for a in cleaned if a)


def corpus_articles(split: str = "all") -> list[str]:
    """Article texts of the course corpus (about 1.25M words): ``split`` is "train", "eval" or "all".

    Order: lead sections by title, then the excerpt's articles in dump order; the "eval" split is
    every ``HELD_OUT_EVERY``-th article of that list (about 2%), "train" the rest.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS}")
    articles = _all_articles()
    if split == "all":
        return list(articles)
    held_out = split == "eval"
    return [a for i, a in enumerate(articles) if ((i + 1) % HELD_OUT_EVERY == 0) == held_out]
