"""Stragglers, measured: synchronous DDP waits for the slowest rank; "drop the slowest" does not.

``compare_stragglers`` trains BERT on ``cfg.straggler_workers`` workers, the last one
sleeping ``straggler_s`` (+ seeded jitter) before every step after the first: synchronous
DDP (ring) without and with that straggler, and ``parallel.stragglers``' deadline
aggregator that closes each round with the first n-1 of n pushes. It reports the on-time
ranks' median step time, their mean loss over the last steps and how often the slow rank's
gradient was used.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ...comm import Communicator
from .._util import print_table
from .common import AveragingBench, _batches


def _straggler_worker(comm: Communicator, cfg: AveragingBench, mode: str, with_straggler: bool) -> dict:
    from ...models import bert
    from ...parallel import stragglers
    from ...parallel.ddp import DistributedDataParallel
    from ...parallel.group import SubComm

    n = cfg.straggler_workers
    if comm.rank == n:  # the aggregator of "drop"
        policy = stragglers.DeadlinePolicy(min_workers=n - 1, deadline_s=0.0)
        report = stragglers.serve_deadline_aggregator(comm, list(range(n)), policy)
        return {"role": "aggregator", "discarded": report.discarded, "rounds": report.rounds}
    slow = (
        stragglers.SlowRank(n - 1, cfg.straggler_s, cfg.straggler_jitter_s, cfg.seed)
        if with_straggler
        else None
    )
    hook = stragglers.DeadlineAveraging(comm, list(range(n)), aggregator=n) if mode == "drop" else None
    try:
        group = SubComm(comm, range(n))
        torch.manual_seed(cfg.seed)
        model = bert.BertForMLM(bert.CONFIGS[cfg.straggler_model])
        ddp = DistributedDataParallel(model, group, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        b, steps = cfg.straggler_batch, cfg.straggler_steps
        ids, labels = _batches(cfg.straggler_model, steps * b * n, cfg.seq, cfg.seed)
        times, losses = [], []
        for step in range(steps):
            if step == 1:  # step 0 (no sleep) warmed up every rank; start the measured steps together
                group.barrier()
            start = time.perf_counter()
            if slow is not None and step > 0:
                slow.sleep(comm.rank, step)
            rows = slice((step * n + comm.rank) * b, (step * n + comm.rank + 1) * b)
            loss = ddp(ids[rows], labels=labels[rows]).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    finally:
        if hook is not None:
            hook.close()
    used = [n - 1 in mask for mask in hook.contributors[1:]] if hook is not None else [True] * (steps - 1)
    return {"role": "worker", "times": times, "losses": losses, "slow_used": used}


def compare_stragglers(
    cfg: AveragingBench = AveragingBench(),  # noqa: B008 (frozen: one shared default is safe)
) -> list[dict]:
    import minidist as md

    rows = []
    n = cfg.straggler_workers
    for label, mode, slow in (
        ("synchronous, no straggler", "sync", False),
        (f"synchronous, rank {n - 1} sleeps {cfg.straggler_s:g} s", "sync", True),
        (f"drop the slowest (first {n - 1} of {n})", "drop", True),
    ):
        world = n + (mode == "drop")
        outs = md.launch(
            _straggler_worker,
            world,
            args=(cfg, mode, slow),
            transport="shm",
            threads_per_worker=1,
            timeout=400,
        )
        on_time = outs[: n - 1]
        window = cfg.loss_window
        rows.append(
            {
                "setting": label,
                "step_s": statistics.median(t for o in on_time for t in o["times"][1:]),
                "slow_step_s": statistics.median(outs[n - 1]["times"][1:]),
                "loss_last": statistics.mean(x for o in on_time for x in o["losses"][-window:]),
                "slow_used": sum(outs[0]["slow_used"]) / len(outs[0]["slow_used"]),
            }
        )
    return rows


def print_straggler_table(rows: list[dict], cfg: AveragingBench) -> str:
    headers = [
        "setting",
        "on-time step ms",
        "slow rank step ms",
        f"loss (last {cfg.loss_window})",
        "slow grad used",
    ]
    table = [
        [
            r["setting"],
            1e3 * r["step_s"],
            1e3 * r["slow_step_s"],
            r["loss_last"],
            f"{100 * r['slow_used']:.0f}%",
        ]
        for r in rows
    ]
    title = (
        f"stragglers: BERT {cfg.straggler_model}, {cfg.straggler_workers} workers, "
        f"{cfg.straggler_steps} steps, shm"
    )
    return print_table(headers, table, title)
