"""Recording a communicator's messages: ``attach(comm, recorder)`` and ``detach(comm)``.

``attach`` wraps ``send``, ``recv``, ``isend`` and ``irecv`` of one communicator instance so
that each call becomes a "message" event of the recorder (peer, bytes, tag; from the call
until the transport finished it). The communicator's class and every other instance stay
untouched.
"""

from __future__ import annotations

import threading
import time

from ..comm import Communicator
from .recorder import Recorder, _thread_name

_WRAPPED = ("send", "recv", "isend", "irecv")
_ORIGINALS = "_trace_originals"  # where attach keeps a communicator's own methods


def attach(comm: Communicator, recorder: Recorder) -> None:
    """Record every point-to-point message of ``comm`` (send, recv, isend, irecv) into ``recorder``.

    Wraps the four methods *of this instance* (the class is untouched, so other
    communicators are not affected, and properties such as ``shared_workspace``
    keep working -- the shm fast-path allreduce sends no messages, so it shows up
    only as the comm span its caller records). An isend/irecv event lasts from the
    call until the transport finishes it (``Work.add_done_callback``), not until
    someone waits. A recv's event includes the time spent waiting for the sender.
    Nested calls (a transport's isend that calls its own send) are recorded once.
    Messages of ``comm.barrier()`` are not point-to-point calls and are not recorded.
    ``detach(comm)`` undoes it.
    """
    if _ORIGINALS in vars(comm):
        raise ValueError("this communicator is already attached to a recorder: call trace.detach(comm) first")
    originals = {name: getattr(comm, name) for name in _WRAPPED}
    inside = threading.local()  # set while this thread is in a recorded call

    def blocking(name: str, direction: str):
        original = originals[name]

        def call(tensor, *args, **kwargs):
            if getattr(inside, "active", False):
                return original(tensor, *args, **kwargs)
            inside.active = True
            start = time.perf_counter_ns()
            try:
                result = original(tensor, *args, **kwargs)
            finally:
                inside.active = False
            peer, tag = _peer_and_tag(args, kwargs)
            recorder.message(peer, _nbytes(tensor), direction, start, time.perf_counter_ns(), tag)
            return result

        return call

    def nonblocking(name: str, direction: str):
        original = originals[name]

        def call(tensor, *args, **kwargs):
            if getattr(inside, "active", False):
                return original(tensor, *args, **kwargs)
            inside.active = True
            start = time.perf_counter_ns()
            try:
                work = original(tensor, *args, **kwargs)
            finally:
                inside.active = False
            peer, tag = _peer_and_tag(args, kwargs)
            tid, thread = recorder._tid(), _thread_name()  # the issuing thread owns the event

            def finished(_work) -> None:
                end = time.perf_counter_ns()
                recorder._message(peer, _nbytes(tensor), direction, start, end, tag, tid, thread)

            add_callback = getattr(work, "add_done_callback", None)
            if add_callback is not None:
                add_callback(finished)
            else:  # a handle without callbacks: the event ends when wait() returns
                wait = work.wait

                def wait_and_record(*args, **kwargs):
                    result = wait(*args, **kwargs)
                    finished(work)
                    return result

                work.wait = wait_and_record
            return work

        return call

    setattr(comm, _ORIGINALS, originals)
    comm.send = blocking("send", "send")
    comm.recv = blocking("recv", "recv")
    comm.isend = nonblocking("isend", "send")
    comm.irecv = nonblocking("irecv", "recv")


def detach(comm: Communicator) -> None:
    """Stop recording ``comm``'s messages (undo ``attach``)."""
    originals = vars(comm).pop(_ORIGINALS, None)
    if originals is None:
        raise ValueError("this communicator is not attached to a recorder")
    for name in _WRAPPED:
        vars(comm).pop(name, None)  # the class' method shows again


def _peer_and_tag(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(peer, tag) of a ``send(t, dst, tag)`` / ``recv(t, src, tag)`` call, positional or keyword."""
    peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
    tag = args[1] if len(args) > 1 else kwargs.get("tag", 0)
    return peer, tag


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["attach", "detach"]
