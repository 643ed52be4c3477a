"""Child process for tests/test_offload.py: RSS growth of training with the optimizer state on disk.

Run as ``python tests/offload_workers.py JSON`` so that the measurement sees a fresh process (the
pytest process's own allocations would blur it); prints one JSON line with the numbers.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
from torch import nn

from minidist import memory
from minidist.parallel.offload import OffloadedAdamW


def rss_growth(
    width: int, layers: int, budget_bytes: int, steps: int, drop_pages: bool, optimizer: str
) -> dict:
    """Peak RSS minus the RSS at the start of training, over ``steps`` AdamW steps.

    The model is ``layers`` Linear(width, width) on a batch of 4, so its activations are tiny next to
    its parameters; the model, its gradients and the state files exist before the baseline is taken
    and one step has run (the allocator is warm), so the growth is what the steps themselves hold.
    """
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width)
    with tempfile.TemporaryDirectory() as directory:
        if optimizer == "offload":
            opt = OffloadedAdamW(model.parameters(), directory, budget_bytes, lr=1e-3)
            opt._drop_pages = drop_pages
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def train_step() -> None:
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()

        train_step()
        if optimizer == "offload" and drop_pages is False:
            # Start from a clean slate: the first step's pages out, so the growth shows them coming back.
            for f in opt._files.values():
                f.release(0, opt.n_params, drop_pages=True)
        # What forward and backward alone add (weight-gradient temporaries, autograd's buffers):
        # the overhead beside the optimizer's budget, measured, not guessed.
        if not memory.reset_peak_rss():
            return {"error": "cannot reset VmHWM via /proc/self/clear_refs"}
        baseline = memory.rss_bytes()
        for _ in range(steps):
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
        forward_backward = max(0, memory.peak_rss_bytes() - baseline)
        memory.reset_peak_rss()
        baseline = memory.rss_bytes()
        for _ in range(steps):
            train_step()
        peak = memory.peak_rss_bytes()
        if optimizer == "offload":
            opt.close()
    return {
        "n_params": n_params,
        "state_bytes": 8 * n_params,
        "growth": peak - baseline,
        "forward_backward": forward_backward,
        "baseline": baseline,
    }


if __name__ == "__main__":
    print(json.dumps(rss_growth(**json.loads(sys.argv[1]))))
