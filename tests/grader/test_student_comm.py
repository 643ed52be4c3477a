"""The communicator a submission gets (``grader/student_comm.StudentComm``): the whole declared
``minidist.comm.Communicator`` interface, but no shortcut past counted point-to-point messages,
no way to reach what it wraps through a public attribute, and counters a submission cannot reset."""

from __future__ import annotations

import pytest

from grader.student_comm import CounterSeal, StudentComm
from minidist.comm import CommStats, Communicator, CommView
from minidist.transport.base import BaseComm


def test_it_is_a_communicator_without_shortcuts_or_a_public_inner():
    comm = StudentComm(BaseComm(rank=0, world_size=2))
    assert isinstance(comm, Communicator)
    assert not isinstance(comm, CommView)  # a view would expose the wrapped communicator as `inner`
    assert not hasattr(comm, "inner")
    assert comm.shared_workspace is None
    assert comm.without_shortcuts() is comm
    assert (comm.rank, comm.world_size, comm.name) == (0, 2, "base")


def test_a_submission_cannot_reset_the_counters():
    comm = StudentComm(BaseComm(rank=0, world_size=2))
    with pytest.raises(RuntimeError, match="cannot be reset"):
        comm.reset_stats()


def test_the_seal_refuses_counters_patched_through_their_class():
    """a9's review: ``type(comm.stats).bytes_sent = property(lambda s: 0, ...)`` passes intake (the
    class is reached through a local name) and zeroes the transport's own counts; a seal made before
    the submission is imported refuses to read them afterwards."""

    class Comm:  # stands for a transport: its stats are a CommStats
        stats = CommStats(bytes_sent=80, messages_sent=2)

    seal = CounterSeal()
    assert seal.sent(Comm()) == (80, 2)
    counts = type(Comm().stats)
    original = vars(counts)["bytes_sent"]
    counts.bytes_sent = property(lambda anyone: 0, lambda anyone, value: None)
    try:
        with pytest.raises(AssertionError, match="tampered with: CommStats.bytes_sent"):
            seal.sent(Comm())
    finally:
        counts.bytes_sent = original
    assert seal.sent(Comm()) == (80, 2)
