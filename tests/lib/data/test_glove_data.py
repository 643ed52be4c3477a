"""GloVe track, data and model: corpus, vocabulary, co-occurrence counting (single and
parallel), the loss and its gradients, AdaGrad, evaluation -- each against an
independent reference (brute force, autograd, scipy)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from minidist import glove
from minidist.glove import cooccur, corpus, model
from minidist.glove.evaluate import analogy_accuracy, nearest, rank_average, similarity_score, spearman


def brute_force_counts(documents: list[list[int]], window: int) -> dict[tuple[int, int], Fraction]:
    """The definition, literally: every ordered pair within the window adds 1/d, both ways."""
    counts: dict[tuple[int, int], Fraction] = {}
    for doc in documents:
        for a, b in itertools.combinations(range(len(doc)), 2):
            d = b - a
            if d <= window and doc[a] != doc[b]:
                for key in ((doc[a], doc[b]), (doc[b], doc[a])):
                    counts[key] = counts.get(key, Fraction(0)) + Fraction(1, d)
    return counts


def test_tokenize_lowercases_strips_accents_and_splits_letters_from_digits():
    assert corpus.tokenize("Don't panic, Café 1984!x2") == ["don", "t", "panic", "cafe", "1984", "x", "2"]


def test_vocabulary_min_count_order_and_encoding():
    docs = [["b", "a", "c", "a"], ["c", "b", "a", "d"]]
    vocab = corpus.Vocabulary.build(docs, min_count=2)
    assert vocab.words == ("a", "b", "c")  # a: 3; b and c: 2 (ties alphabetical); d dropped
    assert list(vocab.counts) == [3, 2, 2]
    encoded = vocab.encode(docs)
    assert [list(e) for e in encoded] == [[1, 0, 2, 0], [2, 1, 0]]  # "d" removed, not a gap
    with pytest.raises(ValueError, match="min_count"):
        corpus.Vocabulary.build(docs, min_count=10)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_count_equals_the_definition(window):
    rng = np.random.default_rng(window)
    documents = [rng.integers(0, 7, size=n) for n in (0, 1, 9, 30, 4)]
    result = cooccur.count(documents, vocab_size=7, window=window)
    expected = brute_force_counts([list(d) for d in documents], window)
    got = {
        (int(i), int(j)): Fraction(int(u), result.scale)
        for i, j, u in zip(result.rows, result.cols, result.units)
    }
    assert got == expected  # exact: integer units
    assert np.all(result.rows != result.cols)
    keys = result.rows * 7 + result.cols
    assert np.all(np.diff(keys) > 0)  # sorted, unique


def test_count_window_limits():
    assert cooccur.weight_scale(15) == 360360
    with pytest.raises(ValueError, match="window"):
        cooccur.weight_scale(0)
    with pytest.raises(ValueError, match="window"):
        cooccur.weight_scale(cooccur.MAX_WINDOW + 1)


@pytest.fixture(scope="module")
def small_data():
    return glove.load("small")


@pytest.mark.parametrize("workers", [2, 3])
def test_parallel_count_is_bit_identical(small_data, workers):
    docs = corpus.load_documents("small")[:400]
    encoded = small_data.vocab.encode(docs)
    single = cooccur.count(encoded, len(small_data.vocab), window=10)
    parallel = cooccur.count_parallel(encoded, len(small_data.vocab), window=10, workers=workers, timeout=120)
    assert len(single) > 10_000
    np.testing.assert_array_equal(parallel.rows, single.rows)
    np.testing.assert_array_equal(parallel.cols, single.cols)
    np.testing.assert_array_equal(parallel.units, single.units)


def test_parallel_count_with_more_workers_than_documents(small_data):
    encoded = small_data.vocab.encode(corpus.load_documents("small")[:3])
    single = cooccur.count(encoded, len(small_data.vocab), window=5)
    parallel = cooccur.count_parallel(encoded, len(small_data.vocab), window=5, workers=5, timeout=120)
    np.testing.assert_array_equal(parallel.units, single.units)
    np.testing.assert_array_equal(parallel.rows * 10**6 + parallel.cols, single.rows * 10**6 + single.cols)


def test_shard_bounds_cover_everything_once_and_balance_tokens():
    lengths = np.array([5, 100, 3, 3, 50, 50, 1, 80])
    bounds = cooccur.shard_bounds(lengths, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    tokens = [lengths[a:b].sum() for a, b in bounds]
    assert max(tokens) <= 150


def test_load_caches_and_the_cache_equals_a_fresh_build(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIDIST_CACHE", str(tmp_path))
    first = glove.load("small", window=5)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    cached = glove.load("small", window=5)
    fresh = glove.build("small", window=5)
    assert cached.vocab.words == fresh.vocab.words == first.vocab.words
    np.testing.assert_array_equal(cached.cooc.units, fresh.cooc.units)
    np.testing.assert_array_equal(cached.cooc.cols, fresh.cooc.cols)
    assert cached.tokens == fresh.tokens > 100_000


def test_unknown_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown corpus"):
        corpus.load_documents("wikipedia")


def reference_loss(table: torch.Tensor, rows, cols, log_x, f_x) -> torch.Tensor:
    """The GloVe loss written directly from the paper's formula."""
    dim = table.shape[1] - 1
    w, c = table[rows], table[cols]
    inner = (w[:, :dim] * c[:, :dim]).sum(1) + w[:, dim] + c[:, dim] - log_x
    return (f_x * inner**2).sum() / 2


def test_pair_gradients_match_autograd():
    torch.manual_seed(0)
    vocab, dim = 6, 4
    table = model.init_table(vocab, dim, seed=1) * 50
    rows = torch.tensor([0, 1, 1, 5, 2])
    cols = torch.tensor([3, 0, 4, 2, 2]) + vocab  # repeated rows on purpose
    x = torch.tensor([1.0, 2.5, 12.0, 0.5, 200.0])
    log_x, f_x = x.log(), model.weighting(x)
    index = torch.cat([rows, cols])
    grads, loss = model.pair_gradients(table[index], log_x, f_x)
    leaf = table.clone().requires_grad_(True)
    expected_loss = reference_loss(leaf, rows, cols, log_x, f_x)
    expected_loss.backward()
    dense = torch.zeros_like(table).index_add_(0, index, grads)
    torch.testing.assert_close(loss, expected_loss.detach())
    torch.testing.assert_close(dense, leaf.grad)


def test_weighting_function():
    x = torch.tensor([0.5, 10.0, 5.0, 1000.0])
    expected = [(0.5 / model.X_MAX) ** 0.75, 1.0, (5.0 / model.X_MAX) ** 0.75, 1.0]
    torch.testing.assert_close(model.weighting(x), torch.tensor(expected))
    torch.testing.assert_close(model.weighting(torch.tensor([50.0]), x_max=100.0), torch.tensor([0.5**0.75]))


def test_batch_of_one_is_per_pair_adagrad():
    """A hand-written scalar loop in the shape of glove.c's, one pair at a time
    (with the paper's AdaGrad: squares of the gradient, not of lr x gradient)."""
    vocab, dim, lr = 5, 3, 0.05
    table = model.init_table(vocab, dim, seed=3).double() * 100
    gradsq = model.init_gradsq(vocab, dim).double()
    W, G = table.numpy().copy(), gradsq.numpy().copy()
    pairs = [(0, 1, 3.0), (2, 4, 0.5), (0, 4, 40.0), (0, 1, 3.0)]
    for i, j, x in pairs:
        l1, l2 = i, j + vocab
        diff = sum(W[l1][k] * W[l2][k] for k in range(dim)) + W[l1][dim] + W[l2][dim] - math.log(x)
        fdiff = min(1.0, (x / model.X_MAX) ** 0.75) * diff
        fdiff = max(-model.GRAD_CLIP, min(model.GRAD_CLIP, fdiff))
        for k in range(dim):
            t1, t2 = fdiff * W[l2][k], fdiff * W[l1][k]
            W[l1][k] -= lr * t1 / math.sqrt(G[l1][k])
            W[l2][k] -= lr * t2 / math.sqrt(G[l2][k])
            G[l1][k] += t1 * t1
            G[l2][k] += t2 * t2
        for row in (l1, l2):
            W[row][dim] -= lr * fdiff / math.sqrt(G[row][dim])
            G[row][dim] += fdiff * fdiff
        batch = model.Pairs(
            torch.tensor([i]),
            torch.tensor([j + vocab]),
            torch.tensor([math.log(x)]).double(),
            model.weighting(torch.tensor([x], dtype=torch.float64)),
            vocab,
        )
        model.batch_step(table, gradsq, batch, lr)
    np.testing.assert_allclose(table.numpy(), W, rtol=1e-9)
    np.testing.assert_allclose(gradsq.numpy(), G, rtol=1e-9)


def test_spearman_matches_scipy_including_ties():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5, 50).astype(float)
    b = a + rng.normal(0, 2, 50)
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    np.testing.assert_array_equal(rank_average(np.array([3.0, 1.0, 3.0])), [2.5, 1.0, 2.5])


def test_evaluation_on_vectors_built_to_answer():
    vocab = corpus.Vocabulary(
        ("athens", "greece", "berlin", "germany", "paris", "france", "tiger", "cat"),
        np.ones(8, dtype=np.int64),
    )
    capital, country = np.array([1.0, 0, 0, 0, 0]), np.array([0, 1.0, 0, 0, 0])
    places = {"athens": 2, "berlin": 3, "paris": 4}
    vectors = np.zeros((8, 5))
    for city, axis in places.items():
        place = np.eye(5)[axis]
        vectors[vocab.index[city]] = capital + place
        vectors[vocab.index[{"athens": "greece", "berlin": "germany", "paris": "france"}[city]]] = (
            country + place
        )
    vectors[6], vectors[7] = [0.1, 0.1, 0.1, 0.1, 1], [0.1, 0.1, 0.1, 0.2, 1]
    result = analogy_accuracy(vectors, vocab)
    assert result.answered >= 6  # e.g. athens greece berlin germany, in both orders
    assert result.semantic == 1.0
    assert nearest(vectors, vocab, "tiger", k=1)[0][0] == "cat"
    with pytest.raises(KeyError, match="not in the vocabulary"):
        nearest(vectors, vocab, "zebra")


def test_random_vectors_score_about_zero(small_data):
    vectors = np.random.default_rng(0).normal(size=(len(small_data.vocab), 50))
    ws, used = similarity_score(vectors, small_data.vocab)
    assert used > 50 and abs(ws) < 0.2
