"""How good are the vectors? Word similarity, analogies, nearest neighbours.

* **WordSim353 / SimLex-999**: human similarity scores for word pairs; we report the
  Spearman rank correlation between them and the cosine similarity of our vectors,
  over the pairs whose two words are both in the vocabulary (SimLex scores
  *similarity*, so "old"/"new" is low; WordSim353 rewards *relatedness*).
* **Analogies** (Mikolov et al.'s questions-words): "athens is to greece as berlin is
  to ?" -- the answer is the word nearest to ``greece - athens + berlin`` (the three
  question words excluded), over the questions whose four words are in the vocabulary.
  The first five sections are *semantic*, the ``gram*`` ones *syntactic*.

The files come with gensim (see docs/library.md, "The GloVe track"). Random vectors score about 0 on
both correlations and about 1/V on analogies: the baseline every test compares with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minidist.data.sources import gensim_datapath

from .corpus import Vocabulary


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def rank_average(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get the average of the ranks they span."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the (tie-averaged) ranks."""
    ra, rb = rank_average(np.asarray(a, float)), rank_average(np.asarray(b, float))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else 0.0


def read_similarity(name: str) -> list[tuple[str, str, float]]:
    """Word pairs and human scores from ``wordsim353.tsv`` or ``simlex999.txt``."""
    triples = []
    for line in gensim_datapath(name).read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        first, second, score = line.split("\t")[:3]
        triples.append((first.lower(), second.lower(), float(score)))
    return triples


def similarity_score(
    vectors: np.ndarray, vocab: Vocabulary, name: str = "wordsim353.tsv"
) -> tuple[float, int]:
    """(Spearman correlation, number of pairs used) on a similarity benchmark."""
    index, unit = vocab.index, _unit_rows(vectors)
    known = [(index[a], index[b], s) for a, b, s in read_similarity(name) if a in index and b in index]
    if len(known) < 2:
        return 0.0, len(known)
    first, second, human = map(np.asarray, zip(*known, strict=True))
    cosine = (unit[first] * unit[second]).sum(axis=1)
    return spearman(cosine, human), len(known)


def read_analogies() -> list[tuple[str, tuple[str, str, str, str]]]:
    """(section, (a, b, c, d)) for every question of questions-words.txt."""
    questions, section = [], ""
    for line in gensim_datapath("questions-words.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith(":"):
            section = line[1:].strip()
        elif line.strip():
            questions.append((section, tuple(line.lower().split())))
    return questions


@dataclass(frozen=True)
class AnalogyResult:
    semantic: float  # accuracy over the questions answered
    syntactic: float
    answered: int  # questions whose four words are all in the vocabulary
    total: int


def analogy_accuracy(vectors: np.ndarray, vocab: Vocabulary, chunk: int = 512) -> AnalogyResult:
    """3CosAdd accuracy: argmax_x cos(x, b - a + c), the question words excluded."""
    index, unit = vocab.index, _unit_rows(vectors).astype(np.float32)
    questions = read_analogies()
    known = [
        (s.startswith("gram"), [index[w] for w in q]) for s, q in questions if all(w in index for w in q)
    ]
    if not known:
        return AnalogyResult(0.0, 0.0, 0, len(questions))
    syntactic = np.array([k[0] for k in known])
    ids = np.array([k[1] for k in known])
    correct = np.zeros(len(ids), dtype=bool)
    for start in range(0, len(ids), chunk):
        a, b, c, d = ids[start : start + chunk].T
        scores = (unit[b] - unit[a] + unit[c]) @ unit.T
        rows = np.arange(len(a))
        scores[rows, a] = scores[rows, b] = scores[rows, c] = -np.inf
        correct[start : start + chunk] = scores.argmax(axis=1) == d
    semantic_acc = float(correct[~syntactic].mean()) if (~syntactic).any() else 0.0
    syntactic_acc = float(correct[syntactic].mean()) if syntactic.any() else 0.0
    return AnalogyResult(semantic_acc, syntactic_acc, len(ids), len(questions))


def nearest(vectors: np.ndarray, vocab: Vocabulary, word: str, k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` words with the highest cosine similarity to ``word`` (itself excluded)."""
    if word not in vocab.index:
        raise KeyError(f"{word!r} is not in the vocabulary ({len(vocab)} words, min count too high?)")
    unit = _unit_rows(vectors)
    scores = unit @ unit[vocab.index[word]]
    scores[vocab.index[word]] = -np.inf
    best = np.argsort(-scores)[:k]
    return [(vocab.words[i], float(scores[i])) for i in best]


@dataclass(frozen=True)
class Quality:
    wordsim353: float
    simlex999: float
    analogy: AnalogyResult

    def __str__(self) -> str:
        a = self.analogy
        return (
            f"WordSim353 {self.wordsim353:.3f}  SimLex999 {self.simlex999:.3f}  "
            f"analogy {a.semantic:.1%} sem / {a.syntactic:.1%} syn ({a.answered} of {a.total})"
        )


def evaluate(vectors: np.ndarray, vocab: Vocabulary) -> Quality:
    return Quality(
        similarity_score(vectors, vocab, "wordsim353.tsv")[0],
        similarity_score(vectors, vocab, "simlex999.txt")[0],
        analogy_accuracy(vectors, vocab),
    )
