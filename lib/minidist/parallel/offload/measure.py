"""Measuring ``OffloadedAdamW``: step time against torch's AdamW, and whether RSS stays in budget.

``measure_offload``     the median ``step()`` time of both on the same model and data, and the
                        largest weight difference at the end (0.0: the same arithmetic)
``measure_rss_growth``  the peak resident memory that training steps add, in a fresh child
                        process (``python -m minidist.parallel.offload`` runs ``_rss_growth_here``)

The optimizer itself is ``adamw.py``; its files and their pages are ``files.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import torch

from minidist._proc import peak_rss_bytes, reset_peak_rss, rss_bytes

from .adamw import OffloadedAdamW, chunk_elements, state_bytes

__all__ = ["measure_offload", "measure_rss_growth"]


def measure_offload(
    directory: str | os.PathLike,
    budget_bytes: int,
    width: int = 512,
    layers: int = 8,
    steps: int = 5,
    seed: int = 0,
    sync_to_disk: bool = True,
) -> dict[str, float]:
    """Step time of ``OffloadedAdamW`` against ``torch.optim.AdamW`` in RAM, on the same model and data.

    Two copies of ``layers`` Linear(width, width) start equal; each trains ``steps`` steps (after one
    warm-up step) on the same batches, one optimizer after the other: all of AdamW's steps in one
    loop, then all of the offloaded ones in another, so that each is timed on its own, not between
    the other's steps (whose writes to the disk it would share). Returns the median
    ``optimizer.step()`` time of each (``offload_step_s``, ``adamw_step_s``), their ``ratio``, the
    parameter and state sizes, and ``max_abs_diff`` between the two models' weights at the end
    (0.0: the same arithmetic).
    ``offload_best_s`` and ``adamw_best_s`` are the fastest step of each: on a shared machine a
    burst of other work can slow several steps in a row, and the best is then the steadier number.
    ``adamw_times_s`` and ``offload_times_s``: every timed step's seconds (for a median and range).
    """
    import copy
    import statistics
    import time

    torch.manual_seed(seed)
    reference = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    offloaded = copy.deepcopy(reference)
    n_params = sum(p.numel() for p in reference.parameters())
    batches = torch.randn(steps + 1, 4, width, generator=torch.Generator().manual_seed(seed))

    def timed_steps(model: torch.nn.Module, opt) -> list[float]:
        """Train ``model`` on every batch; the seconds of each ``opt.step()`` after the first."""
        seconds = []
        for i, x in enumerate(batches):
            opt.zero_grad()
            model(x).square().mean().backward()
            start = time.perf_counter()
            opt.step()
            if i > 0:  # step 0 allocates torch's state and faults in the files: warm-up
                seconds.append(time.perf_counter() - start)
        return seconds

    times = {"adamw": timed_steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))}
    with OffloadedAdamW(
        offloaded.parameters(), directory, budget_bytes, lr=1e-3, sync_to_disk=sync_to_disk
    ) as off:
        times["offload"] = timed_steps(offloaded, off)
        chunks = math.ceil(n_params / off.chunk)
    adamw, offload = statistics.median(times["adamw"]), statistics.median(times["offload"])
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(reference.parameters(), offloaded.parameters(), strict=True)
    )
    return {
        "n_params": n_params,
        "state_bytes": state_bytes(n_params),
        "budget_bytes": budget_bytes,
        "chunks": chunks,
        "adamw_step_s": adamw,
        "offload_step_s": offload,
        "ratio": offload / adamw,
        "adamw_best_s": min(times["adamw"]),
        "offload_best_s": min(times["offload"]),
        "adamw_times_s": times["adamw"],
        "offload_times_s": times["offload"],
        "max_abs_diff": diff,
    }


# --------------------------------------------------------------------------------------------
# Resident memory: does the budget hold? (measured in a fresh child process)
# --------------------------------------------------------------------------------------------
def _rss_growth_here(
    width: int, layers: int, budget_bytes: int, steps: int, drop_pages: bool, optimizer: str
) -> dict:
    """The measurement behind :func:`measure_rss_growth`, in this process (call it in a fresh one)."""
    if optimizer not in ("offload", "torch"):
        raise ValueError(f'optimizer must be "offload" or "torch", got {optimizer!r}')
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width)
    with tempfile.TemporaryDirectory() as directory:
        if optimizer == "offload":
            opt = OffloadedAdamW(model.parameters(), directory, budget_bytes, lr=1e-3)
            opt._drop_pages = drop_pages
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def forward_backward() -> None:
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()

        forward_backward()
        opt.step()
        if optimizer == "offload" and not drop_pages:
            # Start from a clean slate: the first step's pages out, so the growth shows them coming back.
            for f in opt._files.values():
                f.release(0, opt.n_params, drop_pages=True)
        # What forward and backward alone add (weight-gradient temporaries, autograd's buffers):
        # the overhead beside the optimizer's budget, measured, not guessed.
        if not reset_peak_rss():
            return {"error": "cannot reset VmHWM via /proc/self/clear_refs"}
        baseline = rss_bytes()
        for _ in range(steps):
            forward_backward()
        forward_backward_bytes = max(0, peak_rss_bytes() - baseline)
        reset_peak_rss()
        baseline = rss_bytes()
        for _ in range(steps):
            forward_backward()
            opt.step()
        peak = peak_rss_bytes()
        if optimizer == "offload":
            opt.close()
    return {
        "n_params": n_params,
        "state_bytes": state_bytes(n_params),
        "budget_bytes": budget_bytes if optimizer == "offload" else None,
        "growth": peak - baseline,
        "forward_backward": forward_backward_bytes,
        "baseline": baseline,
    }


def measure_rss_growth(
    width: int = 512,
    layers: int = 12,
    budget_bytes: int = 6 << 20,
    steps: int = 2,
    drop_pages: bool = True,
    optimizer: str = "offload",
    timeout: float = 120.0,
) -> dict:
    """Peak resident memory that ``steps`` training steps add, measured in a fresh child process.

    The model is ``layers`` Linear(width, width) on a batch of 4, so its activations are tiny next
    to its parameters. The child builds the model, its gradients and the optimizer, runs one step
    (the allocator warms up, the state files exist), then measures twice from the RSS it then has:

        forward_backward   peak growth over ``steps`` forward+backward passes alone
        growth             peak growth over ``steps`` full steps (forward, backward, optimizer.step)

    With ``optimizer="offload"`` the budget holds when ``growth <= budget_bytes + forward_backward``
    (plus interpreter noise), however large ``state_bytes`` (8 per parameter: m and v) is.
    ``drop_pages=False`` is the control: the chunks' pages stay mapped after use and the growth is
    the whole state. ``optimizer="torch"``: ``torch.optim.AdamW`` in RAM (its state appears in the
    first step, before the baseline: the growth is then only the step's temporaries).

    A child process so that the caller's own allocations (a notebook's, pytest's) do not blur the
    peak. Returns the child's dict, or ``{"error": ...}`` where /proc cannot reset the peak.
    Raises RuntimeError (with the child's stderr) if it fails, TimeoutExpired after ``timeout`` s.
    """
    args = dict(
        width=width,
        layers=layers,
        budget_bytes=budget_bytes,
        steps=steps,
        drop_pages=drop_pages,
        optimizer=optimizer,
    )
    if optimizer not in ("offload", "torch"):
        raise ValueError(f'optimizer must be "offload" or "torch", got {optimizer!r}')
    if optimizer == "offload":
        chunk_elements(budget_bytes)  # a budget below one page fails here, with its message
    proc = subprocess.run(
        [sys.executable, "-m", "minidist.parallel.offload", json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the RSS measurement's child process failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
