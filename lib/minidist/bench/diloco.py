"""``python -m minidist.bench diloco``: DiLoCo against DDP at equal tokens, and over slow links.

One launch of ``workers`` ranks (shm) trains the course decoder (``models.decoder``, "tiny" by
default) on the course text (``data.lm_dataset``: blocks of the Wikipedia corpus cut to ``seq``
tokens, the same batches for every variant: worker r's batch of step t is fixed by the seed),
once per variant, from the same initial weights, for the same number of steps:

* **DDP**: the library's ``DistributedDataParallel`` (one ring allreduce of the gradients per
  step), AdamW on the averaged gradient -- global batch ``workers x batch`` sequences;
* **DiLoCo H** for each H in ``hs``: ``parallel.local_sgd.DiLoCo`` with the same AdamW on each
  worker's own ``batch`` sequences, outer Nesterov lr 0.7, momentum 0.9 (the paper's values;
  its H is 500, on runs of 88,000 steps -- ours are a few hundred steps, so H is scaled down);
* **DiLoCo H int8 / nf4**: the same at ``quantized_h`` with the pseudo-gradients sent quantized
  (``local_sgd.payload``: allgathered codes and scales, dequantized and averaged locally);
* **Streaming DiLoCo** (``streaming`` = H, F, tau, mix): F fragments on staggered schedules,
  each exchange applied tau steps after its launch and merged with weight mix.

Equal tokens: every variant sees ``steps x workers x batch x seq`` training tokens. Rank 0
measures the held-out loss (the "eval" split) every ``eval_every`` steps on the parameters a
variant *has* at that point: DDP's, and DiLoCo's global parameters (the last outer step's).
Bytes are counted (``comm.stats``, training only), in all and for the largest single exchange
(the peak: a rank's bytes from an exchange's launch to its apply), beside the formulas.

Time, on the emulated clock (``local_sgd.timing``): a step's compute is ``6 N T`` FLOPs on a
stated GPU (``gpu_tflops`` x ``mfu``); a sync is one average of the model's pseudo-gradient
(``local_sgd.average_async``: the fp32 ring allreduce, DDP's too, or the quantized allgathers)
**measured** over ``EmulatedLinkComm`` at each link speed, beside the alpha-beta prediction::

    time to target = t* x compute_s + (launches by t*) x max(0, sync_s / F - tau x compute_s)

(``local_sgd.time_to_target``: DDP a sync every step, DiLoCo every H steps, none hidden;
Streaming a fragment of 1/F of the model, tau steps of compute hidden behind it). Two targets:
the highest final held-out loss among the variants (every variant reaches it) and DDP's loss at
half the run (stricter: "not reached" where a variant misses it); steps to them are resolved to
``eval_every``. The overlap model is checked against one measured run: DiLoCo and Streaming
DiLoCo for ``2H + tau`` steps over ``EmulatedLinkComm`` at the slowest link, each step the
6 N T of ``check_tokens`` tokens waited on the clock (``clock.TimedLayer``: N real parameters
that the syncs carry, a compute that only waits). Only ratios from one run are claimed.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import clock
from ..comm import Communicator
from ..parallel import local_sgd
from ..transport.emulated import ETHERNET_10G, EmulatedLinkComm
from ._util import out_dir, save_json

GBIT = 1.25e8  # bytes per second of 1 Gbit/s


@dataclass(frozen=True)
class DilocoBench:
    model: str = "tiny"  # models.decoder.CONFIGS
    workers: int = 2
    batch: int = 4  # sequences per worker per step
    seq: int = 32
    steps: int = 300
    hs: tuple[int, ...] = (1, 10, 50, 100)
    quantized: tuple[str, ...] = ("int8", "nf4")  # pseudo-gradient payloads, run at quantized_h
    quantized_h: int = 50
    streaming: tuple = (50, 5, 5, 0.5)  # H, F, tau, mix of the Streaming row; () for none
    inner_lr: float = 1e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    eval_every: int = 25
    eval_blocks: int = 32
    links_gbit: tuple[float, ...] = (1.0, 0.1)
    gpu_tflops: float = 125.0  # V100 tensor cores
    mfu: float = 0.4
    repeats: int = 3  # emulated syncs measured per link (median)
    check_tokens: int = 65536  # the overlap check's tokens a step: 6 N T of compute that tau steps hide
    seed: int = 0


def _data(cfg: DilocoBench, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training ids (steps, p, batch, seq) drawn with a fixed seed, and held-out ids."""
    from ..data import lm_dataset, load_tokenizer

    tok = load_tokenizer()
    train = lm_dataset(tok, seq_len=128, split="train")[:, : cfg.seq]
    held_out = lm_dataset(tok, seq_len=128, split="eval")[: cfg.eval_blocks, : cfg.seq]
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randint(len(train), (cfg.steps * p * cfg.batch,), generator=gen)
    return train[rows].view(cfg.steps, p, cfg.batch, cfg.seq), held_out


def _make_model(cfg: DilocoBench):
    from ..models.decoder import CONFIGS, DecoderLM

    torch.manual_seed(cfg.seed)
    return DecoderLM(CONFIGS[cfg.model])


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, labels=ids).loss


@torch.no_grad()
def _held_out(model, ids: torch.Tensor) -> float:
    return float(_loss(model, ids))


class Variant(NamedTuple):
    label: str
    h: int | None  # None: DDP
    quantize: str | None = None
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0


def variants(cfg: DilocoBench) -> list[Variant]:
    """Every row, in order."""
    rows = [Variant("DDP", None)] + [Variant(f"DiLoCo H={h}", h) for h in cfg.hs]
    rows += [Variant(f"DiLoCo H={cfg.quantized_h} {q}", cfg.quantized_h, q) for q in cfg.quantized]
    if cfg.streaming:
        h, f, tau, mix = cfg.streaming
        rows.append(Variant(f"Streaming H={h} F={f} tau={tau} mix {mix:g}", h, None, f, tau, mix))
    return rows


def _train(comm: Communicator, cfg: DilocoBench, v: Variant, train, held_out) -> dict:
    """One variant; its held-out curve (rank 0), the bytes it sent training (in all, and in its
    busiest step) and its exchanges as (count, numel) pairs (for the formula)."""
    from ..parallel import DistributedDataParallel
    from ..parallel.buckets import allreduce_average

    model = _make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr)
    if v.h is None:
        hook = functools.partial(allreduce_average, algorithm="ring")
        trained = DistributedDataParallel(model, comm, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        evaluated = model
    else:
        trained = local_sgd.DiLoCo(model, comm, opt, v.h, cfg.outer_lr, cfg.outer_momentum, v.fragments,
                                   v.quantize, delay=v.delay, mix=v.mix)  # fmt: skip
        evaluated = _make_model(cfg)  # holds the global parameters for evaluation
    curve, per_step, before = [], [], comm.stats.bytes_sent
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 and comm.rank == 0:
            if v.h is not None:
                torch.nn.utils.vector_to_parameters(trained.global_params, evaluated.parameters())
            curve.append((step, _held_out(evaluated, held_out)))
        if step == cfg.steps:
            break
        ids = train[step, comm.rank]
        if v.h is None:
            opt.zero_grad(set_to_none=True)
            _loss(trained, ids).backward()
            opt.step()
        else:
            trained.step(_loss, ids)
        per_step.append(comm.stats.bytes_sent - before)  # since the last step (an exchange in flight
        before = comm.stats.bytes_sent  # keeps sending while rank 0 evaluates)
    if v.h is None:
        numel = sum(p.numel() for p in model.parameters())
        exchanges, launches = [(cfg.steps, numel)], list(range(1, cfg.steps + 1))
    else:
        trained.flush()  # fragments still in flight: the rest of their bytes (since the last step)
        per_step[-1] += comm.stats.bytes_sent - before
        exchanges = [(len(t), hi - lo) for t, (lo, hi) in zip(trained.launched, trained.bounds)]
        launches = sorted(t for launched in trained.launched for t in launched)
    # an exchange launched after step t is sent by its apply, tau steps later (async, on the
    # communication thread): its bytes are those of steps t..t+tau (no other exchange runs then
    # while F tau < H)
    peak = max(sum(per_step[t - 1 : t + v.delay]) for t in launches)
    return {"curve": curve, "bytes_sent": sum(per_step), "peak_bytes": peak, "exchanges": exchanges}


def _sync_seconds(comm: Communicator, numel: int, gbit: float, quantize: str | None, repeats: int) -> float:
    """Median seconds of one average of ``numel`` pseudo-gradient values over an emulated link of
    ``gbit`` (``local_sgd.average_async``: the fp32 ring allreduce, or the quantized allgathers)."""
    link = EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, gbit * GBIT)
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats):
        link.barrier()
        start = time.perf_counter()
        local_sgd.average_async(link, delta, quantize).wait()
        times.append(time.perf_counter() - start)
    link.close()
    return statistics.median(times)


def _key(quantize: str | None) -> str:
    return quantize or "fp32"


def _timed_run(comm: Communicator, cfg: DilocoBench, v: Variant, numel: int, compute_s: float, gbit) -> float:
    """Seconds of 2H + tau DiLoCo steps of a ``numel``-parameter model whose step waits
    ``compute_s`` on the clock, over an emulated link of ``gbit`` (None: the plain comm)."""
    link = comm if gbit is None else EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, gbit * GBIT)
    model = torch.nn.Sequential(clock.TimedLayer(numel, compute_s / 3, 2 * compute_s / 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    trainer = local_sgd.DiLoCo(model, link, opt, v.h, cfg.outer_lr, cfg.outer_momentum, v.fragments,
                               delay=v.delay, mix=v.mix)  # fmt: skip
    x = torch.zeros(1)
    link.barrier()
    start = time.perf_counter()
    for _ in range(2 * v.h + v.delay):
        trainer.step(lambda m, b: m(b).sum(), x)
    trainer.flush()
    link.barrier()
    elapsed = time.perf_counter() - start
    if link is not comm:
        link.close()
    return elapsed


def bench_worker(comm: Communicator, cfg: DilocoBench) -> dict:
    torch.set_num_threads(1)
    train, held_out = _data(cfg, comm.world_size)
    runs = {v.label: _train(comm, cfg, v, train, held_out) for v in variants(cfg)}
    numel = sum(p.numel() for p in _make_model(cfg).parameters())
    payloads = [None, *cfg.quantized]
    sync_s = {
        _key(q): {g: _sync_seconds(comm, numel, g, q, cfg.repeats) for g in cfg.links_gbit} for q in payloads
    }
    check = {}
    if cfg.streaming:  # the overlap model against a measured run: DiLoCo and Streaming, fp32
        compute_s = local_sgd.step_compute_s(numel, cfg.check_tokens, cfg.gpu_tflops * 1e12 * cfg.mfu)
        for v in (Variant("DiLoCo", cfg.streaming[0]), variants(cfg)[-1]):
            check[v.label] = {
                "link": _timed_run(comm, cfg, v, numel, compute_s, min(cfg.links_gbit)),
                "no link": _timed_run(comm, cfg, v, numel, compute_s, None),
            }
    return {"runs": runs, "numel": numel, "sync_s": sync_s, "check": check}


def run(cfg: DilocoBench = DilocoBench(), out: str | None = None) -> dict:  # noqa: B008 (frozen)
    import minidist as md

    timeout = 180 + 2 * cfg.steps * len(variants(cfg)) + 30 * cfg.repeats * len(cfg.links_gbit) * 3
    outs = md.launch(bench_worker, cfg.workers, args=(cfg,), transport="shm", threads_per_worker=1,
                     timeout=timeout)  # fmt: skip
    from .diloco_tables import print_tables, summarise

    result = summarise(cfg, outs)
    print_tables(result)
    save_json(out_dir(out), "diloco", result)
    return result


def add_parser(sub) -> None:
    d = DilocoBench()
    parser = sub.add_parser("diloco", help="DiLoCo vs DDP: held-out loss at equal tokens, time on slow links")
    parser.add_argument("--model", default=d.model, help=f"decoder config (default {d.model})")
    parser.add_argument("--workers", type=int, default=d.workers)
    parser.add_argument("--batch", type=int, default=d.batch, help="sequences per worker per step")
    parser.add_argument("--seq", type=int, default=d.seq)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--hs", type=int, nargs="+", default=list(d.hs), help="inner steps H per variant")
    parser.add_argument(
        "--quantized", nargs="*", default=list(d.quantized), help="int8 nf4, at --quantized-h"
    )
    parser.add_argument("--quantized-h", type=int, default=d.quantized_h)
    parser.add_argument(
        "--streaming", type=float, nargs="*", default=list(d.streaming), help="H F tau mix (none: no row)"
    )
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--links", type=float, nargs="+", default=list(d.links_gbit), help="Gbit/s")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    cfg = DilocoBench(model=args.model, workers=args.workers, batch=args.batch, seq=args.seq,
                      steps=args.steps, hs=tuple(args.hs), quantized=tuple(args.quantized),
                      quantized_h=args.quantized_h, eval_every=args.eval_every,
                      streaming=(*map(int, args.streaming[:3]), *args.streaming[3:]),
                      links_gbit=tuple(args.links), repeats=args.repeats)  # fmt: skip
    run(cfg, args.out)
