"""A DDP comm hook that also adds up the seconds spent in it: the call and the ``wait()``.

With ``overlap=False`` a bucket is waited for right after it is launched, so ``seconds`` is the
whole cost of the hook per step. The compression ablation (``compression.ablation``) and the
averaging benchmark (``bench.averaging``) time their hooks with it.
"""

from __future__ import annotations

import time

import torch

from ..comm import Communicator, DerivedWork, Handle


class TimedHook:
    """Wraps a comm hook and adds up the seconds spent in it: the call (compression, launch)
    plus ``wait()`` (communication, decompression). With ``overlap=False`` the bucket is
    waited for right after it is launched, so this is the whole cost of the hook per step."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, comm: Communicator, flat_grad: torch.Tensor, bucket_index: int):
        start = time.perf_counter()
        work = self.inner(comm, flat_grad, bucket_index)
        self.seconds += time.perf_counter() - start
        return _TimedWork(work, self)


class _TimedWork(DerivedWork):
    """The hook's handle, with the time spent in ``wait()`` added to the hook's ``seconds``."""

    def __init__(self, work: Handle, hook: TimedHook) -> None:
        super().__init__(work)
        self.hook = hook

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        start = time.perf_counter()
        result = super().wait(timeout)
        self.hook.seconds += time.perf_counter() - start
        return result
