"""The same-run baseline of ``python -m minidist.bench glove``: an established GloVe trainer.

The baseline is glove-python's trainer (Maciej Kula's Cython code, installed as the
maintained fork ``bicleaner-ai-glove``, module ``glove``), run in this process on
*exactly our pairs*: the rows and columns of ``Pairs`` become its sparse matrix, and
its counts are ``exp(log_x)``, so the ``log X`` it fits is our float32 ``log_x``. Its
row ``i`` is our vocabulary's word ``i`` (it never reorders the matrix). Its threads
are our workers: 1 thread against our single process, 2 against 2 Hogwild workers.

What it does per epoch, and how that differs from ``minidist.glove.model``::

    shuffle the pair indices (again every epoch; ours: one fixed order)
    for each pair (a, b), in parallel over threads (OpenMP, no locks -- Hogwild):
        fdiff = clip(f(X_ab) (w_a . w_b + b_a + b_b - log X_ab), +-max_loss)
        w_a -= lr * fdiff w_b / sqrt(G_a);  G_a += (fdiff w_b)^2
        w_b -= lr * fdiff w_a / sqrt(G_b);  G_b += (fdiff w_a)^2     <- w_a already updated
        (biases alike, with gradient fdiff)

* the AdaGrad rule is the textbook one, as ours (squares of the gradient, G starts at
  1, the step reads G before adding) -- not glove.c's squares of ``lr x gradient``;
* but it steps after every *pair*, ours after a batch of 2048: where a row occurs twice
  in one of our batches, its two gradients are added and scaled by the same G; there the
  second step sees the first one's update and its square in G;
* word and context vectors are *one* table (``w_b`` plays the context), ours are two
  (embedding ``w_i + c_i``); its biases start at 0, ours uniform like the vectors;
* float64, ours float32.

With one table, a word's row takes the steps of both roles, and per-pair AdaGrad has no
batch to average over: at our ``lr = 0.1`` it diverges on the small slice (mean loss 82
after one epoch, measured), so the baseline runs at its own and glove.c's default,
``BASELINE_LR = 0.05`` (loss 0.048 after that epoch; ours at 0.1: 0.048). Speed does not
depend on the learning rate: every pair costs the same arithmetic.

Its kernel reports no loss, so after each epoch (outside the clock) we compute the mean
``f diff^2 / 2`` of the model as it then is (``full_loss``); our trainers report the
loss of each pair as they visited it. ``end_loss`` in the benchmark compares both on
the final parameters.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..glove.model import ALPHA, GRAD_CLIP, GloveConfig, Pairs, full_loss
from ..glove.trainers.common import TrainResult

BASELINE_NAME = "glove-python"
BASELINE_LR = 0.05  # glove-python's and glove.c's default; our 0.1 diverges here (docstring)


def _import_glove():
    try:
        from glove import Glove
        from glove.glove_cython import fit_vectors
    except ImportError as error:
        raise ImportError(
            "the GloVe benchmark's baseline needs glove-python's trainer: "
            "run `make setup` (or `pip install -e '.[dev]'`, which pins bicleaner-ai-glove), "
            f"or leave it out with --trainers ... without {BASELINE_NAME!r}"
        ) from error
    return Glove, fit_vectors


def cooccurrence_matrix(pairs: Pairs):
    """Our pairs as the square sparse COO matrix glove-python trains on (word ids, counts).

    ``pairs.cols`` are table rows ``V + j``; the matrix wants the context's word id ``j``.
    """
    import scipy.sparse

    vocab_size = pairs.vocab_size
    rows = pairs.rows.numpy().astype(np.int32)
    cols = (pairs.cols - vocab_size).numpy().astype(np.int32)
    counts = np.exp(pairs.log_x.numpy().astype(np.float64))
    return scipy.sparse.coo_matrix((counts, (rows, cols)), shape=(vocab_size, vocab_size))


def tied_table(word_vectors: np.ndarray, word_biases: np.ndarray) -> torch.Tensor:
    """Our ``2V x (dim + 1)`` table layout for a model whose word and context rows are one.

    Rows ``i`` and ``V + i`` are both ``[w_i, b_i]``, so ``full_loss`` and
    ``embeddings`` (which returns ``2 w_i``: the same directions) apply unchanged.
    """
    rows = torch.from_numpy(np.column_stack([word_vectors, word_biases])).float()
    return torch.cat([rows, rows])


def train_glove_python(
    pairs: Pairs, config: GloveConfig, threads: int = 1, lr: float = BASELINE_LR
) -> TrainResult:
    """Train glove-python's model on ``pairs`` for ``config.epochs`` with ``threads`` threads.

    Does what ``glove.Glove.fit`` does (same initialisation from ``config.seed``, same
    shuffle, same compiled kernel ``fit_vectors``), one epoch per call so that the loss
    can be measured between epochs; the clock stops while it is. The dimension,
    ``x_max``, the weighting exponent and the clipping are ours (``config``, ``ALPHA``,
    ``GRAD_CLIP``); ``config.batch_size`` does not apply (one pair at a time).
    """
    glove_class, fit_vectors = _import_glove()
    matrix = cooccurrence_matrix(pairs)
    model = glove_class(
        no_components=config.dim,
        learning_rate=lr,
        alpha=ALPHA,
        max_count=config.x_max,
        max_loss=GRAD_CLIP,
        random_state=config.seed,
    )
    # Glove.fit's set-up, line for line (tests check the result equals Glove.fit's)
    random_state = np.random.RandomState(config.seed)
    vocab_size = pairs.vocab_size
    model.word_vectors = (random_state.rand(vocab_size, config.dim) - 0.5) / config.dim
    model.word_biases = np.zeros(vocab_size, dtype=np.float64)
    model.vectors_sum_gradients = np.ones_like(model.word_vectors)
    model.biases_sum_gradients = np.ones_like(model.word_biases)
    shuffle = np.arange(matrix.nnz, dtype=np.int32)

    history, seconds = [], 0.0
    for epoch in range(config.epochs):
        started = time.perf_counter()
        random_state.shuffle(shuffle)
        fit_vectors(
            model.word_vectors,
            model.vectors_sum_gradients,
            model.word_biases,
            model.biases_sum_gradients,
            matrix.row,
            matrix.col,
            matrix.data,
            shuffle,
            model.learning_rate,
            model.max_count,
            model.alpha,
            model.max_loss,
            int(threads),
        )
        seconds += time.perf_counter() - started
        if not np.isfinite(model.word_vectors).all():
            raise FloatingPointError(
                f"{BASELINE_NAME} diverged in epoch {epoch + 1} (non-finite vectors) at lr {lr}: "
                "lower its learning rate (BASELINE_LR)"
            )
        history.append((seconds, full_loss(tied_table(model.word_vectors, model.word_biases), pairs)))
    table = tied_table(model.word_vectors, model.word_biases)
    gradsq = tied_table(model.vectors_sum_gradients, model.biases_sum_gradients)
    return TrainResult(
        BASELINE_NAME,
        table,
        gradsq,
        history,
        len(pairs) * config.epochs,
        seconds,
        workers=threads,
        extra={"lr": lr, "word_vectors": model.word_vectors, "word_biases": model.word_biases},
    )
