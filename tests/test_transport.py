"""Point-to-point transports: correctness against the sent tensor, errors, stats."""

from __future__ import annotations

import pytest
import torch

import minidist as md
import workers
from minidist.transport import ShmComm, share_with_rank
from minidist.transport.shm import DEFAULT_CHUNK, allocate_mailboxes

TRANSPORTS = ["pipe", "shm", "torch"]


def specs():
    """(shape, dtype, seed, send non-contiguous, recv non-contiguous)."""
    out = []
    for i, dtype in enumerate(workers.DTYPES):
        out.append(((0,), dtype, i, False, False))
        out.append(((1,), dtype, i, False, False))
        out.append(((1000,), dtype, i, False, False))
        out.append(((3, 5), dtype, i, True, False))
        out.append(((4, 6), dtype, i, False, True))
    out.append(((2, 0, 3), "float32", 99, False, False))
    out.append(((), "float64", 98, False, False))  # a 0-dim tensor
    out.append(((2, 3, 4, 5, 2), "int64", 97, False, False))
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_roundtrip_every_dtype_shape_and_layout(transport):
    cases = specs()
    sent, received = md.launch(workers.roundtrip, 2, args=(cases,), transport=transport, timeout=60)
    for case, a, b in zip(cases, sent, received):
        assert a.dtype == b.dtype and a.shape == b.shape, case
        assert torch.equal(a, b), case


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "nbytes", [DEFAULT_CHUNK - 8, DEFAULT_CHUNK + 8, 3 * DEFAULT_CHUNK + 8 * 1001, 64 << 20]
)
def test_messages_across_chunk_boundaries(transport, nbytes):
    assert md.launch(workers.big_message, 2, args=(nbytes,), transport=transport, timeout=60) == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_message_larger_than_2_gib(transport):
    nbytes = (1 << 31) + (1 << 20)  # past every 32-bit length field
    assert md.launch(workers.big_message, 2, args=(nbytes,), transport=transport, timeout=300) == [True, True]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_operations_keep_posting_order(transport):
    sizes = [10, 300_000, 1, 0, 2_000_000, 17]
    out = md.launch(workers.async_ordering, 2, args=(sizes,), transport=transport, timeout=60)[1]
    for i, (n, t) in enumerate(zip(sizes, out[:-1])):
        assert torch.equal(t, torch.full((n,), float(i + 1)))
    assert torch.equal(out[-1], torch.full((3,), -1.0))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_simultaneous_exchange_of_large_tensors(transport):
    outs = md.launch(workers.exchange, 2, args=(4_000_000,), transport=transport, timeout=60)
    assert outs == [(2.0, 2.0), (1.0, 1.0)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [3, 4])
def test_ring_pass_and_byte_counts(transport, world_size):
    numel = 12_345
    outs = md.launch(workers.ring_pass, world_size, args=(numel,), transport=transport, timeout=60)
    for rank, (got, delta) in enumerate(outs):
        assert torch.equal(got, torch.full((numel,), float((rank - 1) % world_size)))
        # exactly one message each way, payload bytes only (headers are not counted)
        assert delta == {
            "bytes_sent": numel * 4,
            "messages_sent": 1,
            "bytes_received": numel * 4,
            "messages_received": 1,
        }


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "fn, words",
    [
        (workers.mismatched_shapes, ["shape (4, 2)", "shape (8,)", "rank 1", "rank 0"]),
        (workers.mismatched_dtypes, ["float64", "float32", "rank 1"]),
        (workers.recv_vs_barrier, ["barrier", "different operations"]),
    ],
)
def test_mismatch_is_a_clear_error_not_a_hang(transport, fn, words):
    with pytest.raises(md.WorkerError) as info:
        md.launch(fn, 2, transport=transport, timeout=30)
    assert info.value.rank == 1
    assert info.value.exc_type == "MessageMismatch"
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_calls_raise_at_once(transport):
    errors = md.launch(workers.bad_calls, 2, transport=transport, timeout=30)[0]
    assert "ValueError" in errors["self"] and "itself" in errors["self"]
    assert "ValueError" in errors["range"] and "0..1" in errors["range"]
    assert "ValueError" in errors["negative"]
    assert "TypeError" in errors["not_tensor"] and "list" in errors["not_tensor"]
    assert "TypeError" in errors["float_rank"]
    assert "TypeError" in errors["float_rank_send"] and "TypeError" in errors["float_rank_recv"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_barrier_waits_for_every_rank(transport):
    times = md.launch(workers.barrier_times, 4, transport=transport, timeout=30)
    last_entry = max(entered for entered, _ in times)
    assert all(left >= last_entry for _, left in times)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_dead_peer_is_reported_not_waited_for(transport, how):
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.peer_dies, 2, args=(how,), transport=transport, timeout=60)
    assert info.value.rank == 1  # the root cause, not rank 0 that was waiting for it
    assert ("code 3" if how == "exit" else "SIGKILL") in str(info.value)


def test_shm_fast_path_and_generic_path_agree_in_process():
    """Both ends in one process: small (fast path) and chunked (generic) messages."""
    shared = allocate_mailboxes(2, chunk=4096, slots=2)
    a = ShmComm(0, 2, share_with_rank("shm", shared, 0, 2))
    b = ShmComm(1, 2, share_with_rank("shm", shared, 1, 2))
    for n in [0, 1, 1000, 1024, 1025]:  # 1025 float32 > one 4096-byte chunk
        x = torch.randn(n)
        y = torch.empty(n)
        if n * 4 <= 2 * 4096:  # fits in the two slots: no reader needed while sending
            a.send(x, 1)
            b.recv(y, 0)
        else:
            work = a.isend(x, 1)
            b.recv(y, 0)
            work.wait()
        assert torch.equal(x, y)
    assert a.stats.messages_sent == 5 and b.stats.bytes_received == 4 * (1 + 1000 + 1024 + 1025)
    a.close()
    b.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tags_must_match(transport):
    assert torch.equal(
        md.launch(workers.tagged, 2, args=(7,), transport=transport, timeout=30)[1], torch.arange(4.0)
    )
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.tagged, 2, args=(8,), transport=transport, timeout=30)
    assert info.value.exc_type == "MessageMismatch" and "tags differ" in str(info.value)
