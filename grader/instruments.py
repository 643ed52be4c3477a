"""What the sandbox's workers count: every call a submission makes to a library collective.

An assignment whose student code may call ``md.allreduce`` and friends (a3's DDP, a4's hook,
a5's tensor-parallel layers) wraps those collectives *before* the student's module is imported,
under every public name a submission can reach them by (``md.X``, ``minidist.collectives.X``,
``minidist.collectives.api.X``), so that no import path bypasses the count. What a call records
differs per assignment (a3: the launch time and order for overlap, a4: bytes and ``async_op``,
a5: a copy of the tensor handed in); the wrapper is written once here, the record by each
``workers.py``::

    def wrapper(name, original):
        @functools.wraps(original)
        def collective(comm, tensor, *args, **kwargs):
            log.append(...)                         # what this assignment needs to know
            return original(comm, tensor, *args, **kwargs)
        return collective

    wrap_collectives(("allreduce", "allgather"), wrapper)

Copied into every sandbox (``grade.SHARED_SANDBOX_FILES``) beside ``guard.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["wrap_collectives"]


def wrap_collectives(names: Iterable[str], wrapper: Callable[[str, Callable], Callable]) -> None:
    """Replace each collective ``name`` by ``wrapper(name, original)`` wherever the library exposes it."""
    import minidist as md
    import minidist.collectives as collectives
    import minidist.collectives.api as api

    for name in names:
        wrapped = wrapper(name, getattr(api, name))
        for owner in (md, collectives, api):
            if hasattr(owner, name):
                setattr(owner, name, wrapped)
