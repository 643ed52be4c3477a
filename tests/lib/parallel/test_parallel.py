"""minidist.parallel: variable-length messages and receive-from-any-source."""

from __future__ import annotations

import pytest
import torch

import minidist as md
import parallel_workers


@pytest.mark.parametrize("transport", ["shm", "pipe"])
def test_rows_of_any_length_arrive_intact(transport):
    lengths = [0, 1, 7, 50_000]
    outs = md.launch(parallel_workers.rows_roundtrip, 2, args=(lengths,), transport=transport, timeout=60)
    for n, got in zip(lengths, outs[1], strict=True):
        torch.testing.assert_close(got, torch.arange(n * 3, dtype=torch.float64).reshape(n, 3))


def test_inbox_delivers_in_arrival_order_and_per_source_fifo():
    delays = [0.0, 0.0, 0.05, 0.15]  # rank 1 first, rank 3 last
    arrivals = md.launch(parallel_workers.inbox_server, 4, args=(delays,), transport="pipe", timeout=60)[0]
    assert sorted(arrivals) == [(r, [r, k]) for r in (1, 2, 3) for k in range(3)]
    for r in (1, 2, 3):
        assert [m[1] for src, m in arrivals if src == r] == [0, 1, 2]  # each source in its order
    assert arrivals[-1][0] == 3 and arrivals[0][0] == 1


def test_a_peer_that_dies_mid_message_is_an_error_not_a_hang():
    with pytest.raises(md.WorkerError, match="rank 1|gives up"):
        md.launch(parallel_workers.inbox_peer_fails, 2, transport="pipe", timeout=30)
