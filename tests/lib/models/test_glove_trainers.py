"""GloVe track, trainers: every parallel trainer against the single-process one.

Synchronous trainers must equal it to float tolerance (same global batch, or the
same schedule replayed); asynchronous ones (async parameter server, Hogwild) are
checked for convergence against its loss, and with one worker for equality.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from minidist import glove
from minidist.glove.model import batch_step, init_gradsq, init_table
from minidist.glove.trainers import model_parallel
from minidist.glove.trainers.common import batch_slices, split, training_order
from minidist.glove.trainers.hogwild import count_row_updates, lost_updates

CONFIG = glove.GloveConfig(epochs=2, batch_size=512, seed=3)
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def data():
    return glove.load("small")


@pytest.fixture(scope="module")
def pairs(data):
    """A random 20k of the small slice's pairs: fast, and still many repeated rows per batch."""
    return data.pairs.shuffled(7).subset(slice(0, 20_000))


@pytest.fixture(scope="module")
def single(pairs):
    return glove.train_single(pairs, CONFIG)


def assert_same_training(result, reference, atol=1e-5):
    torch.testing.assert_close(result.table, reference.table, atol=atol, rtol=1e-4)
    torch.testing.assert_close(result.gradsq, reference.gradsq, atol=atol, rtol=1e-4)
    np.testing.assert_allclose([h[1] for h in result.history], [h[1] for h in reference.history], rtol=1e-5)


def test_single_learns(pairs, single):
    losses = [h[1] for h in single.history]
    assert losses[1] < losses[0]
    assert single.pairs_trained == 2 * len(pairs)
    # The epoch's loss is measured while training; the loss of the final table is lower still.
    assert glove.full_loss(single.table, pairs) < losses[-1]


@pytest.mark.parametrize("variant", ["dense", "sparse"])
@pytest.mark.parametrize("workers", [2, 3])
def test_sync_data_parallel_equals_single(pairs, single, variant, workers):
    result = glove.train_data_parallel(pairs, CONFIG, workers=workers, variant=variant, timeout=120)
    assert_same_training(result, single)
    assert result.comm_bytes > 0


def test_data_parallel_bytes_match_the_formulas(pairs):
    """Dense: a ring allreduce of 2 x 2V x (dim+1) floats per step; sparse: allgather of
    the padded touched rows. Both measured from comm.stats, checked against the docstrings."""
    config = glove.GloveConfig(epochs=1, batch_size=4000, dim=10)
    p, steps, width = 2, -(-len(pairs) // 4000), 11
    V = pairs.vocab_size
    dense = glove.train_data_parallel(pairs, config, workers=p, variant="dense", timeout=120)
    sparse = glove.train_data_parallel(pairs, config, workers=p, variant="sparse", timeout=120)
    bookkeeping = 2 * p * 8  # the loss allreduce at the end of the epoch (ring on 1 float64 over 2 ranks)
    dense_per_rank = 2 * (p - 1) / p * (2 * 2 * V * width * 4)
    assert dense.comm_bytes == pytest.approx(p * steps * dense_per_rank, rel=0.01)
    part = 2000  # ceil(batch / p)
    sparse_per_rank = (p - 1) * 2 * part * (8 + width * 4)
    assert sparse.comm_bytes - bookkeeping == pytest.approx(p * steps * sparse_per_rank, rel=0.01)


@pytest.mark.parametrize("workers", [2, 3])
def test_model_parallel_equals_single_replaying_its_schedule(pairs, workers):
    result = glove.train_model_parallel(pairs, CONFIG, workers=workers, timeout=120)
    order = training_order(pairs, CONFIG)
    schedule = model_parallel.schedule(order, workers, CONFIG.batch_size)
    assert sorted(torch.cat(schedule).tolist()) == list(range(len(pairs)))  # every pair once per epoch
    replay = glove.train_single(pairs, CONFIG, batches=schedule)
    assert_same_training(result, replay, atol=1e-6)


def test_model_parallel_sends_only_context_shards(pairs):
    workers, config = 2, glove.GloveConfig(epochs=1, dim=10)
    result = glove.train_model_parallel(pairs, config, workers=workers, timeout=120)
    shard_bytes = 2 * (pairs.vocab_size // workers) * 11 * 4  # rows + G of one context shard
    bookkeeping = 2 * workers * 8 + 64  # loss allreduce, barriers
    assert (
        workers * workers * shard_bytes <= result.comm_bytes <= workers * workers * shard_bytes + bookkeeping
    )


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_parameter_server_equals_single(pairs, single, servers):
    result = glove.train_param_server(pairs, CONFIG, workers=2, servers=servers, mode="sync", timeout=120)
    assert_same_training(result, single)
    assert set(result.extra["staleness"]) == {0}
    assert result.extra["dropped"] == 0


@pytest.mark.parametrize("staleness_aware", [False, True])
def test_async_parameter_server_with_one_worker_is_sequential(pairs, single, staleness_aware):
    result = glove.train_param_server(
        pairs, CONFIG, workers=1, mode="async", staleness_aware=staleness_aware, timeout=120
    )
    assert_same_training(result, single)
    assert set(result.extra["staleness"]) == {0}


@pytest.mark.parametrize("staleness_aware", [False, True])
def test_async_parameter_server_converges(pairs, single, staleness_aware):
    result = glove.train_param_server(
        pairs, CONFIG, workers=3, servers=2, mode="async", staleness_aware=staleness_aware, timeout=120
    )
    steps = CONFIG.epochs * -(-len(pairs) // CONFIG.batch_size)
    assert len(result.extra["staleness"]) == steps * 3 * 2  # one per push: steps x workers x servers
    assert min(result.extra["staleness"]) >= 0
    assert result.pairs_trained == single.pairs_trained
    final, reference = glove.full_loss(result.table, pairs), glove.full_loss(single.table, pairs)
    # Staleness-aware steps are smaller (lr / staleness): slower per epoch, never divergent.
    # (measured: 1.11-1.14x the single process's loss staleness-aware, 1.004x plain; more under load)
    assert final < (1.4 if staleness_aware else 1.1) * reference
    assert final < 0.9 * result.history[0][1]


def test_backup_worker_drops_the_straggler(pairs, single):
    result = glove.train_param_server(
        pairs, CONFIG, workers=3, mode="sync", backup=1, slow_worker=2, slow_delay=0.01, timeout=120
    )
    assert result.extra["dropped"] > 0
    assert set(result.extra["staleness"]) == {0}
    assert result.pairs_trained < single.pairs_trained  # the dropped gradients are lost work
    assert glove.full_loss(result.table, pairs) < 1.2 * glove.full_loss(single.table, pairs)


def replay_sync_steps(pairs, config, workers, quorums):
    """One process, one AdaGrad step per synchronous step, on exactly the parts of the
    workers in that step's quorum: worker w's part of step v is the ((w + v) % W)-th of
    W nearly equal pieces of global batch v (the parts rotate)."""
    order = training_order(pairs, config)
    global_batches = list(batch_slices(0, len(order), config.batch_size))
    table = init_table(pairs.vocab_size, config.dim, config.seed)
    gradsq = init_gradsq(pairs.vocab_size, config.dim)
    for step, quorum in enumerate(quorums):
        batch = global_batches[step % len(global_batches)]
        pieces = [split(batch.stop - batch.start, workers, (w + step) % workers) for w in sorted(quorum)]
        indices = torch.cat([torch.arange(batch.start + p.start, batch.start + p.stop) for p in pieces])
        batch_step(table, gradsq, order.subset(indices), config.lr)
    return table, gradsq


def test_sync_servers_with_backup_workers_agree_on_every_quorum(pairs):
    """Two servers, three workers, one backup, a straggler: every step must apply the
    same workers' gradients on both shards -- a step that one process could take. The
    straggler's link to server 1 is slow: server 0 often hears from it among the first
    two, server 1 last, so servers that each took their own first two would disagree."""
    workers, backup = 3, 1
    result = glove.train_param_server(
        pairs, CONFIG, workers=workers, servers=2, mode="sync", backup=backup,
        slow_worker=2, slow_link_delay=0.005, timeout=120,
    )  # fmt: skip
    on_server_0, on_server_1 = result.extra["quorums"]
    steps = CONFIG.epochs * -(-len(pairs) // CONFIG.batch_size)
    assert len(on_server_0) == steps
    assert on_server_1 == on_server_0
    assert all(len(quorum) == workers - backup for quorum in on_server_0)  # one worker left out each step
    table, gradsq = replay_sync_steps(pairs, CONFIG, workers, on_server_0)
    torch.testing.assert_close(result.table, table, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(result.gradsq, gradsq, atol=1e-5, rtol=1e-4)


def test_parameter_server_progress_bar_ends_full(pairs, capfd):
    """Worker 0's bar counts steps (one per global batch and epoch) and is closed: its
    last drawing shows every step done, also with backup workers (where a worker skips
    the steps the others closed without it)."""
    steps = CONFIG.epochs * -(-len(pairs) // CONFIG.batch_size)
    for options in ({"workers": 2}, {"workers": 3, "backup": 1, "slow_worker": 0, "slow_delay": 0.005}):
        glove.train_param_server(pairs, CONFIG, mode="sync", progress=True, timeout=120, **options)
        drawings = [d for d in re.split(r"[\r\n]", capfd.readouterr().err) if "parameter server (sync)" in d]
        assert drawings, "no progress bar drawn"
        assert re.search(rf"100%.*\b{steps}/{steps}\b", drawings[-1]), drawings[-1]


def _makes_tqdm_process_lock(code: str) -> bool:
    """Whether ``code``, run in a fresh interpreter (this one made tqdm's lock long ago),
    creates tqdm's default lock: a multiprocessing semaphore, which a worker leaving
    through os._exit leaks into /dev/shm."""
    script = (
        f"from tqdm.std import TqdmDefaultWriteLock\n{code}\nprint(hasattr(TqdmDefaultWriteLock, 'mp_lock'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip() != "False"


def test_silent_progress_bar_makes_no_process_semaphore():
    """tqdm registers even a disabled bar under its default lock."""
    code = "from minidist.glove.trainers.common import step_bar\nstep_bar(5, 'silent', show=False).close()"
    assert not _makes_tqdm_process_lock(code)


def test_single_trainer_makes_no_process_semaphore():
    """train_single runs inside workers too (lecture 04 trains two side by side)."""
    code = (
        "import torch\n"
        "from minidist import glove\n"
        "from minidist.glove.model import Pairs\n"
        "pairs = Pairs(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.zeros(2), torch.ones(2), 2)\n"
        "glove.train_single(pairs, glove.GloveConfig(dim=4, epochs=2, batch_size=2))"
    )
    assert not _makes_tqdm_process_lock(code)


def test_parameter_server_rejects_bad_arguments(pairs):
    with pytest.raises(ValueError, match="mode"):
        glove.train_param_server(pairs, CONFIG, mode="eventual")
    with pytest.raises(ValueError, match="at least one server"):
        glove.train_param_server(pairs, CONFIG, servers=0)
    with pytest.raises(ValueError, match="at least one server and one worker"):
        glove.train_param_server(pairs, CONFIG, workers=0)
    with pytest.raises(ValueError, match="backup"):
        glove.train_param_server(pairs, CONFIG, workers=2, mode="sync", backup=2)
    with pytest.raises(ValueError, match="sync"):
        glove.train_param_server(pairs, CONFIG, workers=2, mode="async", backup=1)
    with pytest.raises(ValueError, match="variant"):
        glove.train_data_parallel(pairs, CONFIG, variant="compressed")


def test_hogwild_with_one_worker_equals_single(pairs, single):
    assert_same_training(glove.train_hogwild(pairs, CONFIG, workers=1, timeout=120), single, atol=1e-6)


def test_hogwild_converges_like_single(pairs, single):
    result = glove.train_hogwild(pairs, CONFIG, workers=2, timeout=120, count_lost_updates=True)
    assert result.pairs_trained == single.pairs_trained
    assert glove.full_loss(result.table, pairs) < 1.1 * glove.full_loss(single.table, pairs)
    # How many are lost depends on timing (often none); races can only lose increments.
    assert result.row_updates == 2 * len(pairs) * CONFIG.epochs
    assert 0 <= result.lost_updates < result.row_updates
    assert result.extra["lost_per_row"].min() >= 0
    assert int(result.extra["lost_per_row"].sum()) == result.lost_updates


def test_hogwild_with_one_worker_loses_no_update(pairs, single):
    result = glove.train_hogwild(pairs, CONFIG, workers=1, timeout=120, count_lost_updates=True)
    assert result.lost_updates == 0
    assert result.row_updates == 2 * len(pairs) * CONFIG.epochs
    assert not result.extra["lost_per_row"].any()
    assert_same_training(result, single, atol=1e-6)  # counting does not change the training


def test_lost_update_accounting_on_a_simulated_race():
    """Two workers count overlapping row updates; worker 1 read the tally before worker 0
    wrote it, so its write-back of row 2 erases worker 0's increment: exactly 1 lost."""
    tally = torch.zeros(4, dtype=torch.int64)
    rows_0, rows_1 = torch.tensor([1, 2]), torch.tensor([2, 3])
    stale_read = tally.clone()  # worker 1 reads ...
    count_row_updates(tally, rows_0)  # ... worker 0 reads, adds, writes ...
    count_row_updates(stale_read, rows_1)  # ... worker 1 adds to what it read ...
    tally[rows_1] = stale_read[rows_1]  # ... and writes back
    assert tally.tolist() == [0, 1, 1, 1]
    assert lost_updates(tally, row_updates=len(rows_0) + len(rows_1)) == 1
    no_race = torch.zeros(4, dtype=torch.int64)
    for rows in (rows_0, rows_1, torch.tensor([3, 3, 0])):  # one after the other, repeated rows too
        count_row_updates(no_race, rows)
    assert no_race.tolist() == [1, 1, 2, 3]
    assert lost_updates(no_race, row_updates=7) == 0


def test_quality_is_well_above_random_vectors(data):
    """The CI check of the whole pipeline: the small slice, fixed seed, a few epochs."""
    config = glove.GloveConfig(epochs=4, seed=0)
    result = glove.train_hogwild(data.pairs, config, workers=2, timeout=120)
    random_vectors = np.random.default_rng(0).normal(size=(len(data.vocab), config.dim))
    random_ws = glove.similarity_score(random_vectors, data.vocab)[0]
    quality = glove.evaluate(result.vectors(), data.vocab)
    assert quality.wordsim353 > 0.12
    assert quality.wordsim353 > random_ws + 0.12
