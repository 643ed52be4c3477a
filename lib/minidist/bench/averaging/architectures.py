"""Who averages the gradients, measured: one BERT step per architecture over the emulated link.

``compare_architectures`` launches, per (architecture, workers n, servers k), n workers that
train BERT through ``DistributedDataParallel`` with the architecture's hook
(``parallel.averaging.make_hook``) and k summation servers (``serve_summation``); it reports
the bytes a worker and a server send per step (``comm.stats``) beside the formula
(``averaging.expected_bytes``), and the step and hook times beside the link-time model
(``averaging.push_pull_seconds``).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ...comm import Communicator
from ...parallel.timed_hook import TimedHook
from .._util import print_table
from .common import AveragingBench, _batches

DEFAULT_CONFIGS = (
    *(("ring", n, 0) for n in (2, 3, 4)),
    *(("sharded", n, 0) for n in (2, 3, 4)),
    *(("central", n, 0) for n in (2, 3, 4)),
    *(("byteps", n, k) for n in (2, 3, 4) for k in (1, 2)),
)


def _architecture_worker(comm: Communicator, cfg: AveragingBench, arch: str, n: int, k: int) -> dict:
    from ...models import bert
    from ...parallel import averaging
    from ...parallel.ddp import DistributedDataParallel
    from ...parallel.group import SubComm
    from ...transport.emulated import ETHERNET_10G, EmulatedLinkComm

    comm = EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, cfg.gbit_per_s * 1.25e8)
    if comm.rank >= n:
        report = averaging.serve_summation(comm, list(range(n)))
        return {"role": "server", "stats": vars(report.stats), "rounds": report.rounds}
    hook = TimedHook(averaging.make_hook(arch, comm, n, k))
    try:
        group = SubComm(comm, range(n))
        torch.manual_seed(cfg.seed)
        model = bert.BertForMLM(bert.CONFIGS[cfg.model])
        ddp = DistributedDataParallel(model, group, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        ids, labels = _batches(cfg.model, (cfg.steps + 1) * cfg.batch * n, cfg.seq, cfg.seed)
        times, hook_s, sent, received = [], [], [], []
        for step in range(cfg.steps + 1):
            rows = slice((step * n + comm.rank) * cfg.batch, (step * n + comm.rank + 1) * cfg.batch)
            before, hook_before, start = comm.stats, hook.seconds, time.perf_counter()
            ddp(ids[rows], labels=labels[rows]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step:  # step 0 warms up
                times.append(time.perf_counter() - start)
                hook_s.append(hook.seconds - hook_before)
                delta = comm.stats - before
                sent.append(delta.bytes_sent)
                received.append(delta.bytes_received)
        numel = sum(p.numel() for p in model.parameters())
    finally:
        hook.inner.close()
    return {
        "role": "worker",
        "step_s": statistics.median(times),
        "hook_s": statistics.median(hook_s),
        "sent": statistics.mean(sent),
        "received": statistics.mean(received),
        "numel": numel,
    }


def compare_architectures(
    cfg: AveragingBench = AveragingBench(),  # noqa: B008 (frozen: one shared default is safe)
    configs=DEFAULT_CONFIGS,
) -> list[dict]:
    """One launch per (architecture, workers, servers); see the module docstring."""
    import minidist as md

    from ...parallel import averaging
    from ...transport.emulated import ETHERNET_10G

    rows = []
    for arch, n, k in configs:
        servers = averaging.servers_for(arch, k)
        outs = md.launch(
            _architecture_worker,
            n + servers,
            args=(cfg, arch, n, k),
            transport="shm",
            threads_per_worker=1,
            timeout=300,
        )
        workers = outs[:n]
        numel = workers[0]["numel"]
        grad_bytes = 4 * numel
        if arch == "ring":
            want_worker, want_server = 2 * (n - 1) / n * grad_bytes, math.nan
        else:
            expected = averaging.expected_bytes([numel], arch, n, k)
            want_worker = expected["worker 0"][0]
            want_server = expected["server 0"][0] if servers else math.nan
        steps = cfg.steps + 1
        server_sent = (
            statistics.mean(o["stats"]["bytes_sent"] / steps for o in outs[n:]) if servers else math.nan
        )
        rows.append(
            {
                "architecture": arch,
                "workers": n,
                "servers": servers,
                "grad_MB": grad_bytes / 1e6,
                "worker_sent_MB": statistics.mean(o["sent"] for o in workers) / 1e6,
                "worker_formula_MB": want_worker / 1e6,
                "server_sent_MB": server_sent / 1e6,
                "server_formula_MB": want_server / 1e6,
                "step_s": max(o["step_s"] for o in workers),
                "hook_s": max(o["hook_s"] for o in workers),
                "model_hook_s": averaging.push_pull_seconds(
                    [numel], arch, n, k, ETHERNET_10G.alpha_s, cfg.gbit_per_s * 1.25e8
                ),
            }
        )
    return rows


def print_architecture_table(rows: list[dict], gbit_per_s: float = 10.0) -> str:
    headers = ["who averages", "n", "S", "worker MB/step", "formula", "server MB/step", "formula"]
    headers += ["step ms", "hook ms", "link model ms"]
    table = [
        [
            r["architecture"],
            r["workers"],
            r["servers"],
            r["worker_sent_MB"],
            r["worker_formula_MB"],
            r["server_sent_MB"],
            r["server_formula_MB"],
            1e3 * r["step_s"],
            1e3 * r["hook_s"],
            1e3 * r["model_hook_s"],
        ]
        for r in rows
    ]
    title = (
        f"bytes sent per step by one worker / one server; times over the emulated {gbit_per_s:g} Gbit/s link"
    )
    return print_table(headers, table, title)
