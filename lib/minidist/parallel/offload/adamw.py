"""AdamW whose state lives in memory-mapped files on disk: ZeRO-Infinity's NVMe tier, on a CPU.

Adam keeps two fp32 numbers per parameter (the moments m and v), and mixed-precision training a
third (an fp32 master copy of the weights): 8 to 12 bytes per parameter, against 2 for the bf16
weights themselves. ZeRO-Infinity (Rajbhandari et al., 2021) moves that state to NVMe and
brings it into memory a piece at a time for the update, writing each piece back, so the state
may be far larger than the device.
On this CPU-only machine "the device" is the process's resident memory (RSS) and "NVMe" is a
file: the state is written to files in ``directory`` and ``step()`` walks through them one
chunk at a time, never holding more than ``budget_bytes`` of it in RAM::

    files on disk:   exp_avg    [ chunk 0 | chunk 1 | chunk 2 | ... ]
                     exp_avg_sq [ chunk 0 | chunk 1 | chunk 2 | ... ]
                     master     [ chunk 0 | chunk 1 | chunk 2 | ... ]   (master_weights=True)
                                    │
    step():  for each chunk:  map its pages in ──► AdamW update (with the grads, in RAM)
                              ──► write back (msync) ──► drop the pages (madvise DONTNEED)

Why the last step matters, and how a chunk of a file becomes a tensor: ``files.py``. Whether
the budget holds, measured, and the step time against torch's AdamW: ``measure.py``.

The arithmetic is ``torch.optim.AdamW``'s (decoupled weight decay, Loshchilov & Hutter), element
by element, so chunking changes nothing and the result equals torch's (the tests check it)::

    p ← p · (1 − lr·λ)
    m ← β₁ m + (1 − β₁) g                  v ← β₂ v + (1 − β₂) g²
    p ← p − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

Cost: every step reads and writes the whole state once: 2 × 8 bytes per parameter (12 with the
master copy) of file traffic, against none for an optimizer in RAM. The files are deleted by
``close()``, at the end of a ``with`` block, or when the optimizer is garbage-collected.

    opt = OffloadedAdamW(model.parameters(), directory="/tmp", budget_bytes=8 << 20, lr=1e-3)
    with opt:
        for batch in data:
            model(batch).backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable

import torch

from .files import _cleanup, _StateFile

__all__ = ["OffloadedAdamW", "PAGE_ELEMENTS", "TEMPORARIES", "chunk_elements", "state_bytes"]

PAGE_ELEMENTS = mmap.PAGESIZE // 4  # fp32 elements in one page: chunks start on page boundaries
TEMPORARIES = 2  # chunk-sized temporaries of the update (√v term, the grad slice as fp32)


def state_bytes(n_params: int, master_weights: bool = False) -> int:
    """Bytes of AdamW state on disk for ``n_params`` parameters: 8 each (m, v), 12 with a master copy."""
    return n_params * 4 * (3 if master_weights else 2)


def chunk_elements(budget_bytes: int, master_weights: bool = False) -> int:
    """How many parameters one chunk holds so that its RAM stays within ``budget_bytes``.

    Per element a chunk holds its state (4 bytes each for m, v and the master copy) plus
    ``TEMPORARIES`` fp32 temporaries of the update; the count is rounded down to whole pages
    (``madvise`` and ``msync`` work on pages). Raises ValueError if not even one page fits.
    """
    per_element = 4 * ((3 if master_weights else 2) + TEMPORARIES)
    elements = (budget_bytes // per_element) // PAGE_ELEMENTS * PAGE_ELEMENTS
    if elements < PAGE_ELEMENTS:
        raise ValueError(
            f"budget_bytes={budget_bytes} is smaller than one chunk: the smallest chunk is one page of "
            f"{PAGE_ELEMENTS} parameters x {per_element} bytes = {PAGE_ELEMENTS * per_element} bytes; "
            "raise budget_bytes to at least that"
        )
    return elements


class OffloadedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` with its state in memory-mapped files, streamed through ``budget_bytes`` of RAM.

    ``directory``: an existing writable folder; the files go in a fresh sub-folder of it that
    ``close()`` deletes. ``budget_bytes``: RAM for the state of one chunk (see ``chunk_elements``).
    ``master_weights=True`` keeps an fp32 master copy of the weights in a file too: the update is
    applied to it and the (e.g. bf16) parameters receive its rounded value, as in mixed precision.
    ``sync_to_disk=False`` skips the ``msync`` after each chunk: the kernel then writes the pages
    back when it likes (dropping them loses nothing: a shared file mapping's dirty pages stay in
    the page cache), which shows how much of the step time is the disk's.
    Parameters must be contiguous. ``state_dict()`` is not supported (the state is the files).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        directory: str | os.PathLike,
        budget_bytes: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = False,
        sync_to_disk: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"need lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1); got lr={lr}, eps={eps}, "
                f"weight_decay={weight_decay}, betas={betas}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        self.sync_to_disk = sync_to_disk
        self.budget_bytes = int(budget_bytes)
        self.chunk = chunk_elements(self.budget_bytes, master_weights)
        self._drop_pages = True  # False only to show (in tests) what RSS does without dropping pages

        # Every parameter gets a slice [offset, offset + numel) of the flat state files.
        self._slices: list[tuple[torch.Tensor, dict, int]] = []
        offset = 0
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_contiguous():
                    raise ValueError(
                        f"parameter of shape {tuple(p.shape)} is not contiguous: OffloadedAdamW streams "
                        "flat slices; make it contiguous (p.data = p.data.contiguous()) first"
                    )
                self._slices.append((p, group, offset))
                offset += p.numel()
        self.n_params = offset
        self.step_count = 0

        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise ValueError(f"directory {directory!r} does not exist or is not a folder: create it first")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"directory {directory!r} is not writable: pass a folder you can write to")
        need = state_bytes(self.n_params, master_weights)
        free = shutil.disk_usage(directory).free
        if need > free:
            raise ValueError(
                f"the optimizer state needs {need} bytes but {directory!r} has {free} free: "
                "pick another folder"
            )
        self.folder = tempfile.mkdtemp(prefix="offload-adamw-", dir=directory)
        n = max(self.n_params, 1)
        names = ["exp_avg", "exp_avg_sq"] + (["master"] if master_weights else [])
        self._files = {name: _StateFile(os.path.join(self.folder, name + ".f32"), n) for name in names}
        self._finalizer = weakref.finalize(self, _cleanup, list(self._files.values()), self.folder)
        if master_weights:
            self._write_master()

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Delete the state files (idempotent); the optimizer cannot step afterwards."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> OffloadedAdamW:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self):  # noqa: D102
        raise NotImplementedError(
            "OffloadedAdamW keeps its state in files; checkpointing it is not supported"
        )

    def load_state_dict(self, state_dict) -> None:  # noqa: D102
        raise NotImplementedError(
            "OffloadedAdamW keeps its state in files; checkpointing it is not supported"
        )

    # -- the step ------------------------------------------------------------------------------

    def _pieces(self, lo: int, hi: int):
        """The parts of parameters that fall in flat elements [lo, hi): (param, group, a, b, lo_in_chunk)."""
        for p, group, offset in self._slices:
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                yield p, group, a - offset, b - offset, a - lo

    def _write_master(self) -> None:
        for lo in range(0, self.n_params, self.chunk):
            hi = min(lo + self.chunk, self.n_params)
            master = self._files["master"].view(lo, hi)
            for p, _, a, b, at in self._pieces(lo, hi):
                master[at : at + b - a].copy_(p.detach().reshape(-1)[a:b])
            del master
            self._files["master"].release(lo, hi, self._drop_pages, self.sync_to_disk)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over all parameters, one chunk of the state files at a time."""
        if self.closed:
            raise RuntimeError("OffloadedAdamW.step() after close(): the state files are gone")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_count += 1
        t = self.step_count
        for lo in range(0, self.n_params, self.chunk):
            hi = min(lo + self.chunk, self.n_params)
            exp_avg = self._files["exp_avg"].view(lo, hi)
            exp_avg_sq = self._files["exp_avg_sq"].view(lo, hi)
            master = self._files["master"].view(lo, hi) if self.master_weights else None
            for p, group, a, b, at in self._pieces(lo, hi):
                if p.grad is None:
                    continue
                lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                grad = p.grad.reshape(-1)[a:b].float()
                m, v = exp_avg[at : at + b - a], exp_avg_sq[at : at + b - a]
                w = master[at : at + b - a] if master is not None else p.view(-1)[a:b]
                # The same operations, in the same order, as torch.optim.AdamW (single-tensor path).
                w.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**t
                bias_correction2_sqrt = (1 - beta2**t) ** 0.5
                denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
                w.addcdiv_(m, denom, value=-lr / bias_correction1)
                if master is not None:
                    p.view(-1)[a:b].copy_(w)
                del grad, m, v, w, denom
            del exp_avg, exp_avg_sq, master  # no view may outlive the pages we drop next
            for f in self._files.values():
                f.release(lo, hi, self._drop_pages, self.sync_to_disk)
        return loss

    def read_state(self, name: str) -> torch.Tensor:
        """A RAM copy of one state file ("exp_avg", "exp_avg_sq" or "master"), flat, for tests and plots."""
        view = self._files[name].view(0, self.n_params)
        out = view.clone()
        del view
        self._files[name].release(0, self.n_params, self._drop_pages, sync=False)
        return out
