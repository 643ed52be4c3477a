"""Point-to-point transports: correctness against the sent tensor, errors, stats."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading

import pytest
import torch

import minidist as md
import peer_workers
import workers
from minidist import CommStats, PeerError
from minidist.transport import MailboxComm, ShmComm, share_with_rank
from minidist.transport.presence import PeerPresence
from minidist.transport.shm_layout import DEFAULT_CHUNK, allocate_mailboxes

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


@pytest.mark.parametrize(
    "sender, receiver", [(ShmComm, ShmComm), (MailboxComm, ShmComm), (ShmComm, MailboxComm)]
)
def test_shm_fast_path_and_generic_path_agree_in_process(sender, receiver):
    """Both ends in one process: small (fast path) and chunked (generic) messages; the
    teaching path (MailboxComm) and the fast path (ShmComm) speak the same protocol."""
    shared = allocate_mailboxes(2, chunk=4096, slots=2)
    a = sender(0, 2, share_with_rank("shm", shared, 0, 2))
    b = receiver(1, 2, share_with_rank("shm", shared, 1, 2))
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


def _shm_comms(world_size: int, **sizes):
    shared = allocate_mailboxes(world_size, **sizes)
    return shared, [
        ShmComm(r, world_size, share_with_rank("shm", shared, r, world_size)) for r in range(world_size)
    ]


def _switch_threads_between_any_two_bytecodes(frame, event, arg):
    """A trace function for ``threading.settrace``: inside the transports' ``send`` and
    ``recv`` it runs at every bytecode, and the interpreter may switch threads there.

    Without it CPython switches threads only at a few kinds of instructions, so a
    ``counter += n`` shared by threads almost never loses an update -- although nothing
    promises that (and a free-threaded Python loses them readily).
    """
    if event == "call":
        code = frame.f_code
        if code.co_name not in ("send", "recv") or "transport" not in code.co_filename:
            return None
        frame.f_trace_opcodes = True
    return _switch_threads_between_any_two_bytecodes


def test_stats_are_exact_when_several_threads_send_and_receive():
    """Rank 0 receives from ranks 1 and 2 on two threads (as an Inbox does) and sends to
    them on two more; the counters are the sums, message for message."""
    _, comms = _shm_comms(3, chunk=4096, slots=4)
    count, numel = 2000, 4

    def run(operation, other):
        sys.settrace(_switch_threads_between_any_two_bytecodes)
        buffer = torch.ones(numel)
        for _ in range(count):
            operation(buffer, other)

    jobs = []
    for peer in (1, 2):
        jobs += [(comms[peer].send, 0), (comms[0].recv, peer), (comms[0].send, peer), (comms[peer].recv, 0)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # and switch as often as possible
    try:
        threads = [threading.Thread(target=run, args=job) for job in jobs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    every = 2 * count
    assert comms[0].stats == CommStats(
        bytes_sent=every * numel * 4,
        messages_sent=every,
        bytes_received=every * numel * 4,
        messages_received=every,
    )
    for comm in comms:
        comm.close()


@pytest.mark.parametrize("reaped", [False, True])
def test_a_killed_peer_ends_a_shm_wait_without_any_timeout(reaped):
    """Rank 1 is a process that gets killed while rank 0 waits for its message;
    rank 0 has no per-operation timeout, as under md.launch, and must raise PeerError."""
    shared, comms = _shm_comms(2, chunk=4096, slots=2)
    comms[1].close()  # rank 1 is played by another process from here on
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        PeerPresence(shared["presence"], 1).arrive(pid=stand_in.pid)
        errors = []

        def wait_for_rank_1():
            try:
                comms[0].recv(torch.zeros(4), 1)
            except PeerError as error:
                errors.append(str(error))

        comms[0].timeout = 120.0  # only a guard against a hang: it would say "timeout"
        waiter = threading.Thread(target=wait_for_rank_1)
        waiter.start()
        stand_in.kill()
        if reaped:
            stand_in.wait()  # gone entirely; otherwise a zombie, dead but not reaped
        waiter.join()
    finally:
        stand_in.kill()
        stand_in.wait()
    assert len(errors) == 1 and "rank 1" in errors[0] and "is gone" in errors[0], errors
    comms[0].close()


@pytest.mark.parametrize("transport", ["shm", "pipe"])
@pytest.mark.parametrize(
    "operation, peer", [("recv", 1), ("send", 1), ("barrier", None), ("allreduce", None), ("inbox", None)]
)
def test_waiting_on_a_peer_that_returned_raises_peer_error(transport, operation, peer):
    """Ranks 1 and 2 return at once; rank 0 then waits on them (on two threads for the
    inbox). Under md.launch there is no per-operation timeout, and nothing kills rank 0:
    only noticing that the peer is gone ends the wait."""
    outs = md.launch(
        peer_workers.wait_for_peers_that_left, 3, args=(operation,), transport=transport, timeout=60
    )
    kind, message, cause = outs[0]
    if operation == "inbox":  # the Inbox re-raises its listener's error
        assert kind == "RuntimeError" and cause == "PeerError", outs[0]
    else:  # it names the rank it waited for (barrier, allreduce: whichever it met first)
        assert kind == "PeerError", outs[0]
        assert any(f"rank {r}" in message for r in ([peer] if peer else [1, 2])), message


def test_shm_refuses_a_cpu_that_may_reorder_stores(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    with pytest.raises(ValueError, match="transport='pipe'") as info:
        md.launch(workers.identity, 2, transport="shm", timeout=30)
    assert "arm64" in str(info.value)
    assert md.launch(workers.identity, 2, transport="pipe", timeout=30) is not None


def test_a_forked_rank_sees_its_peer_leave_on_pipe():
    """Under fork every rank inherits every pipe; each must close the ends that are not
    its own, or a peer's exit would never reach it as end-of-file."""
    outs = md.launch(
        peer_workers.wait_for_peers_that_left,
        3,
        args=("recv",),
        transport="pipe",
        start_method="fork",
        timeout=60,
    )
    assert outs[0][0] == "PeerError" and "rank 1" in outs[0][1], outs[0]
