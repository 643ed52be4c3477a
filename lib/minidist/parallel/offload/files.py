"""A flat fp32 array in a memory-mapped file, whose pages can be written back and dropped.

The storage under ``OffloadedAdamW`` (``adamw.py``): one ``_StateFile`` per kind of state
(exp_avg, exp_avg_sq, master), each viewed a chunk at a time as a tensor on the mapped pages::

    file:    [ chunk 0 | chunk 1 | chunk 2 | ... ]      ftruncate: a sparse file of zeros
    view(lo, hi)     -> a tensor on the pages of [lo, hi) (no copy; touching maps them in)
    release(lo, hi)  -> msync (write back, wait for the disk) + madvise(DONTNEED) (drop them)

Why dropping matters: pages of a mapped file that the process has touched count in its
RSS, just like memory it allocated. Without dropping them, one ``step()`` would leave the whole
state resident (the kernel evicts clean file pages only under memory pressure) and the budget
would mean nothing. ``madvise(MADV_DONTNEED)`` on a shared file mapping removes the pages from
this process (the data stays in the file and the page cache, which is not the process's).
"""

from __future__ import annotations

import mmap
import os
import shutil

import numpy as np
import torch


class _StateFile:
    """One flat fp32 array of ``n`` elements in a file, mapped shared; views are made per chunk."""

    def __init__(self, path: str, n: int) -> None:
        self.path = path
        self.nbytes = n * 4
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        # ftruncate makes a sparse file of zeros: nothing is written or resident until touched.
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes, flags=mmap.MAP_SHARED)

    def view(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) as a tensor on the mapped pages (no copy); touching it maps them in."""
        return torch.from_numpy(np.frombuffer(self.map, dtype=np.float32, count=hi - lo, offset=lo * 4))

    def release(self, lo: int, hi: int, drop_pages: bool = True, sync: bool = True) -> None:
        """Write elements [lo, hi) back to the file (``sync``: wait for the disk) and drop their pages."""
        start, length = lo * 4, min(hi * 4, self.nbytes) - lo * 4
        if sync:
            self.map.flush(start, length)
        if drop_pages:
            self.map.madvise(mmap.MADV_DONTNEED, start, length)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def _cleanup(files: list[_StateFile], folder: str) -> None:
    """Close the maps and delete the folder (also run by the garbage collector via weakref.finalize)."""
    for f in files:
        try:
            f.close()
        except (BufferError, ValueError, OSError):
            pass  # a view still alive, or already closed: the folder is removed anyway
    shutil.rmtree(folder, ignore_errors=True)
