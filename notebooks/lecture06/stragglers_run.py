"""Lecture 06, section 5: three workers, one of them slow: wait for it, or drop it.

World: 3 workers + 1 aggregator (used by "drop" only; it waits at the barriers otherwise).
The model is the small classifier of section 1, so a step is mostly the straggler's sleep.
"""

import math
import time

import torch
import torch.nn.functional as F

from minidist.optim import large_batch as lb
from minidist.parallel import stragglers
from minidist.parallel.ddp import DistributedDataParallel
from minidist.parallel.group import SubComm

MODES = (
    ("wait, nobody slow", "sync", False),
    ("wait for the slow rank", "sync", True),
    ("drop the slowest", "drop", True),
)


def train(comm, n, mode, slow, cfg, steps, batch, delay_s, jitter_s):
    workers = SubComm(comm, range(n))
    hook = stragglers.DeadlineAveraging(comm, list(range(n)), aggregator=n) if mode == "drop" else None
    sleeper = stragglers.SlowRank(n - 1, delay_s, jitter_s, seed=0) if slow else None
    problem = lb.make_problem(cfg)
    model = lb.make_model(cfg)
    try:
        ddp = DistributedDataParallel(model, workers, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        times = []
        workers.barrier()
        for step in range(steps):
            start = time.perf_counter()
            if sleeper is not None:
                sleeper.sleep(comm.rank, step)  # sleeps only on the slow rank
            rows = slice((step * n + comm.rank) * batch, (step * n + comm.rank + 1) * batch)
            F.cross_entropy(ddp(problem.train_x[rows]), problem.train_y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        ddp.remove_hooks()
    finally:
        if hook is not None:
            hook.close()
    with torch.no_grad():
        loss = F.cross_entropy(model(problem.eval_x), problem.eval_y).item()
    used = [n - 1 in who for who in hook.contributors] if hook is not None else [True] * steps
    return {"times": times, "eval_loss": loss, "slow_used": used}


def all_modes(comm, n, cfg, steps, batch, delay_s, jitter_s):
    out = {}
    for label, mode, slow in MODES:
        comm.barrier()
        if comm.rank < n:
            out[label] = train(comm, n, mode, slow, cfg, steps, batch, delay_s, jitter_s)
        elif mode == "drop":  # the aggregator: closes each round with the first n-1 pushes
            policy = stragglers.DeadlinePolicy(min_workers=n - 1, deadline_s=0.0)
            report = stragglers.serve_deadline_aggregator(comm, list(range(n)), policy)
            out[label] = {"discarded": report.discarded, "rounds": report.rounds}
    comm.barrier()
    return out
