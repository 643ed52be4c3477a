"""``python -m minidist.bench averaging``: who averages the gradients, and stragglers.

``compare_architectures(cfg)`` runs the same BERT step (``cfg.model``, AdamW, one
bucket allreduced after backward) with its gradients averaged four ways
(``parallel.averaging``: central server, sharded server on every node, ring
allreduce, BytePS with 1-2 CPU summation servers) for 2-4 workers, over the emulated
10 Gbit/s link (shm underneath; servers are processes of the same launch). Per row:
bytes sent per step by a worker and by a server, measured with ``comm.stats``, next to
the formula (``averaging.expected_bytes``: M out and in for a central-server worker,
n*M for the server, 2(n-1)/n*M for a sharded/ring worker, BytePS in between); the
median step time and time in the hook, and the link-time model of the hook
(``push_pull_seconds``).

``compare_stragglers(cfg)`` trains BERT on 3 workers with rank 2 sleeping
``straggler_s`` (+ seeded jitter) before every step after the first: synchronous DDP (ring) without and
with the straggler, and "drop the slowest" (``parallel.stragglers``: an aggregator
closes each round with the first 2 of 3 pushes). Median step time of the on-time
ranks, mean loss of the last steps, how often the slow rank's gradient was used.

The machine is small and shared: compare rows of one run, not numbers across runs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..comm import Communicator, DerivedWork, Handle
from ._util import out_dir, print_table, save_json

DEFAULT_CONFIGS = (
    *(("ring", n, 0) for n in (2, 3, 4)),
    *(("sharded", n, 0) for n in (2, 3, 4)),
    *(("central", n, 0) for n in (2, 3, 4)),
    *(("byteps", n, k) for n in (2, 3, 4) for k in (1, 2)),
)


@dataclass(frozen=True)
class AveragingBench:
    model: str = "mini"
    batch: int = 2  # per worker
    seq: int = 32
    steps: int = 4  # measured, after one warm-up step
    lr: float = 1e-3
    seed: int = 0
    gbit_per_s: float = 10.0  # the emulated link (10: ETHERNET_10G's bandwidth; its alpha either way)
    # stragglers
    straggler_model: str = "tiny"
    straggler_workers: int = 3
    straggler_steps: int = 21  # the first one warms up
    straggler_batch: int = 8
    straggler_s: float = 0.5
    straggler_jitter_s: float = 0.2
    loss_window: int = 8


def _batches(model: str, rows: int, seq: int, seed: int):
    """Real MLM batches of the course text: (input_ids, labels), ``rows`` samples of ``seq``."""
    from .. import data

    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, seq_len=128, split="train")[:, :seq]
    gen = torch.Generator().manual_seed(seed)
    masked = data.mask_tokens(blocks[torch.randint(len(blocks), (rows,), generator=gen)], tok, gen)
    return masked.input_ids, masked.labels


class _TimedHook:
    """Adds up the seconds spent in the hook (call + wait): with one bucket launched after
    backward, the communication time of the step."""

    def __init__(self, inner) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, comm: Communicator, flat, bucket_index):
        start = time.perf_counter()
        work = self.inner(comm, flat, bucket_index)
        self.seconds += time.perf_counter() - start
        return _TimedWork(work, self)

    def close(self) -> None:
        self.inner.close()


class _TimedWork(DerivedWork):
    """The hook's handle, with the time spent in ``wait()`` added to the hook's ``seconds``."""

    def __init__(self, work: Handle, hook: _TimedHook) -> None:
        super().__init__(work)
        self.hook = hook

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        start = time.perf_counter()
        result = super().wait(timeout)
        self.hook.seconds += time.perf_counter() - start
        return result


def _architecture_worker(comm: Communicator, cfg: AveragingBench, arch: str, n: int, k: int) -> dict:
    from ..models import bert
    from ..parallel import averaging
    from ..parallel.ddp import DistributedDataParallel
    from ..parallel.group import SubComm
    from ..transport.emulated import ETHERNET_10G, EmulatedLinkComm

    comm = EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, cfg.gbit_per_s * 1.25e8)
    if comm.rank >= n:
        report = averaging.serve_summation(comm, list(range(n)))
        return {"role": "server", "stats": vars(report.stats), "rounds": report.rounds}
    hook = _TimedHook(averaging.make_hook(arch, comm, n, k))
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
        hook.close()
    return {
        "role": "worker",
        "step_s": statistics.median(times),
        "hook_s": statistics.median(hook_s),
        "sent": statistics.mean(sent),
        "received": statistics.mean(received),
        "numel": numel,
    }


def compare_architectures(cfg: AveragingBench = AveragingBench(), configs=DEFAULT_CONFIGS) -> list[dict]:
    """One launch per (architecture, workers, servers); see the module docstring."""
    import minidist as md

    from ..parallel import averaging
    from ..transport.emulated import ETHERNET_10G

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


# --- stragglers ---------------------------------------------------------------------------------
def _straggler_worker(comm: Communicator, cfg: AveragingBench, mode: str, with_straggler: bool) -> dict:
    from ..models import bert
    from ..parallel import stragglers
    from ..parallel.ddp import DistributedDataParallel
    from ..parallel.group import SubComm

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


def compare_stragglers(cfg: AveragingBench = AveragingBench()) -> list[dict]:
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


def run(cfg: AveragingBench = AveragingBench(), out: str | None = None, stragglers: bool = True) -> dict:
    """Both tables (what ``python -m minidist.bench averaging`` prints); JSON saved to ``out``."""
    load_before = os.getloadavg()
    print(
        f"who averages: BERT {cfg.model}, batch {cfg.batch}x{cfg.seq} per worker, {cfg.gbit_per_s:g} Gbit/s"
    )
    arch_rows = compare_architectures(cfg)
    print_architecture_table(arch_rows, cfg.gbit_per_s)
    result = {"config": asdict(cfg), "architectures": arch_rows}
    if stragglers:
        straggler_rows = compare_stragglers(cfg)
        print_straggler_table(straggler_rows, cfg)
        result["stragglers"] = straggler_rows
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    result["load"] = [load_before, load_after]
    save_json(out_dir(out), f"averaging_{cfg.model}_{cfg.gbit_per_s:g}gbit", result)
    return result


def add_parser(sub) -> None:
    parser = sub.add_parser("averaging", help="central PS, sharded PS, ring, BytePS; stragglers (BERT)")
    parser.add_argument("--model", default=AveragingBench.model, help="BERT config: tiny, mini (default)")
    parser.add_argument("--steps", type=int, default=AveragingBench.steps)
    parser.add_argument("--gbit", type=float, default=10.0, help="emulated link bandwidth (default 10)")
    parser.add_argument("--no-stragglers", action="store_true", help="skip the straggler table")
    parser.add_argument("--out", default=None)


def main(args) -> None:
    cfg = AveragingBench(model=args.model, steps=args.steps, gbit_per_s=args.gbit)
    run(cfg, args.out, stragglers=not args.no_stragglers)
