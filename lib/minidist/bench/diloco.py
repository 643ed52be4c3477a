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
  (``local_sgd.payload``: allgathered codes and scales, dequantized and averaged locally).

Equal tokens: every variant sees ``steps x workers x batch x seq`` training tokens. Rank 0
measures the held-out loss (the "eval" split) every ``eval_every`` steps on the parameters a
variant *has* at that point: DDP's, and DiLoCo's global parameters (the last outer step's).

Time, on the emulated clock (``minidist.clock``, ``transport.emulated``): a step's compute is
``6 N T`` FLOPs on a stated GPU (N parameters, T tokens a worker, ``gpu_tflops`` x ``mfu``), a
sync is one average of the model's pseudo-gradient (``local_sgd.average_async``: the fp32 ring
allreduce, DDP's too, or the quantized allgathers) **measured** over ``EmulatedLinkComm`` at
each link speed, beside the alpha-beta prediction. DDP pays a sync every
step, DiLoCo every H steps (no overlap assumed in either: DDP could hide at most its compute,
which is far shorter here)::

    time to target = (steps until the held-out loss <= target) x compute_s + (syncs by then) x sync_s

The target is the highest final held-out loss among the variants (so every variant reaches it;
steps to it are resolved to ``eval_every``). Bytes are counted (``comm.stats``, training only)
and printed beside the ring formula. Only ratios from one run are claimed.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..collectives import cost_model
from ..comm import Communicator
from ..parallel import local_sgd
from ..transport.emulated import ETHERNET_10G, EmulatedLinkComm
from ._util import human_bytes, out_dir, print_table, save_json

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
    inner_lr: float = 1e-3
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    eval_every: int = 25
    eval_blocks: int = 32
    links_gbit: tuple[float, ...] = (1.0, 0.1)
    gpu_tflops: float = 125.0  # V100 tensor cores
    mfu: float = 0.4
    repeats: int = 3  # emulated syncs measured per link (median)
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


def variants(cfg: DilocoBench) -> list[tuple[str, int | None, str | None]]:
    """(label, H or None for DDP, quantize) of every row, in order."""
    return ([("DDP", None, None)] + [(f"DiLoCo H={h}", h, None) for h in cfg.hs]
            + [(f"DiLoCo H={cfg.quantized_h} {q}", cfg.quantized_h, q) for q in cfg.quantized])  # fmt: skip


def _train(comm: Communicator, cfg: DilocoBench, h: int | None, quantize, train, held_out) -> dict:
    """One variant (h None: DDP); its held-out curve (rank 0) and the bytes it sent training."""
    from ..parallel import DistributedDataParallel
    from ..parallel.buckets import allreduce_average

    model = _make_model(cfg)
    if h is None:
        hook = functools.partial(allreduce_average, algorithm="ring")
        trained = DistributedDataParallel(model, comm, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr)
        evaluated = model
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner_lr)
        trained = local_sgd.DiLoCo(model, comm, opt, h, cfg.outer_lr, cfg.outer_momentum, quantize=quantize)
        evaluated = _make_model(cfg)  # holds the global parameters for evaluation
    curve, sent = [], 0
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 and comm.rank == 0:
            if h is not None:
                torch.nn.utils.vector_to_parameters(trained.global_params, evaluated.parameters())
            curve.append((step, _held_out(evaluated, held_out)))
        if step == cfg.steps:
            break
        ids = train[step, comm.rank]
        before = comm.stats.bytes_sent
        if h is None:
            opt.zero_grad(set_to_none=True)
            _loss(trained, ids).backward()
            opt.step()
        else:
            trained.step(_loss, ids)
        sent += comm.stats.bytes_sent - before
    return {"curve": curve, "bytes_sent": sent, "syncs": cfg.steps if h is None else cfg.steps // h}


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


def bench_worker(comm: Communicator, cfg: DilocoBench) -> dict:
    torch.set_num_threads(1)
    train, held_out = _data(cfg, comm.world_size)
    runs = {label: _train(comm, cfg, h, q, train, held_out) for label, h, q in variants(cfg)}
    numel = sum(p.numel() for p in _make_model(cfg).parameters())
    payloads = [None, *cfg.quantized]
    sync_s = {
        _key(q): {g: _sync_seconds(comm, numel, g, q, cfg.repeats) for g in cfg.links_gbit} for q in payloads
    }
    return {"runs": runs, "numel": numel, "sync_s": sync_s}


def summarise(cfg: DilocoBench, outs: list[dict]) -> dict:
    """Rows per variant: held-out loss, bytes (counted, formula), time to target per link."""
    p, numel = len(outs), outs[0]["numel"]
    tokens = cfg.steps * p * cfg.batch * cfg.seq
    compute_s = 6 * numel * cfg.batch * cfg.seq / (cfg.gpu_tflops * 1e12 * cfg.mfu)
    alpha = ETHERNET_10G.alpha_s
    sync_s, predicted = {}, {}
    for q in [None, *cfg.quantized]:  # the slowest rank's median; the alpha-beta prediction
        sync_s[_key(q)] = {g: max(o["sync_s"][_key(q)][g] for o in outs) for g in cfg.links_gbit}
        predicted[_key(q)] = {  # ring allreduce, or two ring allgathers (codes, scales): 2(p-1) messages
            g: cost_model.predict("ring", p, 4 * numel, cost_model.AlphaBeta(alpha, 1 / (g * GBIT), 0.0))
            if q is None else (p - 1) * (2 * alpha + local_sgd.payload_bytes(numel, q) / (g * GBIT))
            for g in cfg.links_gbit
        }  # fmt: skip
    target = max(run["curve"][-1][1] for run in outs[0]["runs"].values())  # every variant gets there
    rows = []
    for label, h, q in variants(cfg):
        run, every = outs[0]["runs"][label], h or 1
        reached = next((step for step, loss in run["curve"] if loss <= target), None)
        formula = [run["syncs"] * local_sgd.sync_bytes(numel, p, r, q) for r in range(p)]
        row = dict(label=label, h=every, quantize=q, final_loss=run["curve"][-1][1], syncs=run["syncs"],
                   bytes_sent=[o["runs"][label]["bytes_sent"] for o in outs], formula_bytes=formula,
                   bytes_per_token=formula[0] / tokens, steps_to_target=reached,
                   curve=run["curve"])  # fmt: skip
        for g in cfg.links_gbit:
            row[f"time_s_{g:g}G"] = (
                math.nan if reached is None else reached * compute_s + (reached // every) * sync_s[_key(q)][g]
            )
        rows.append(row)
    return dict(config=asdict(cfg), workers=p, numel=numel, tokens=tokens, compute_s=compute_s, target=target,
                sync_s=sync_s, predicted_sync_s=predicted, rows=rows)  # fmt: skip


def print_tables(result: dict) -> None:
    rows, links = result["rows"], result["config"]["links_gbit"]
    ddp = rows[0]
    print_table(
        ["variant", "held-out loss", "vs DDP", "syncs", "bytes/token", "counted = formula", "steps to target"]
        + [f"time {g:g} Gbit/s" for g in links] + [f"DDP / this {g:g}G" for g in links],
        [[r["label"], r["final_loss"], f"{100 * (r['final_loss'] / ddp['final_loss'] - 1):+.1f}%", r["syncs"],
          human_bytes(int(r["bytes_per_token"])), str(r["bytes_sent"] == r["formula_bytes"]),
          r["steps_to_target"] if r["steps_to_target"] is not None else "not reached"]
         + [r[f"time_s_{g:g}G"] for g in links] + [ddp[f"time_s_{g:g}G"] / r[f"time_s_{g:g}G"] for g in links]
         for r in rows],
        title=f"{result['workers']} workers, {result['numel']:,} parameters, "
        f"{result['tokens']:,} tokens each; "
        f"target = the worst final held-out loss ({result['target']:.3f}); compute "
        f"{result['compute_s'] * 1e6:.1f} us a step",
    )  # fmt: skip
    print_table(
        ["payload", "link", "sync measured (s)", "predicted (s)", "measured / predicted"],
        [[q, f"{g:g} Gbit/s", result["sync_s"][q][g], result["predicted_sync_s"][q][g],
          result["sync_s"][q][g] / result["predicted_sync_s"][q][g]]
         for q in result["sync_s"] for g in links],
        title="one average of the model's pseudo-gradient over the emulated link (slowest rank, median; "
        "fp32: the ring allreduce, DDP's too)",
    )  # fmt: skip


def run(cfg: DilocoBench = DilocoBench(), out: str | None = None) -> dict:  # noqa: B008 (frozen)
    import minidist as md

    timeout = 120 + 2 * cfg.steps * len(variants(cfg)) + 30 * cfg.repeats * len(cfg.links_gbit) * 3
    outs = md.launch(bench_worker, cfg.workers, args=(cfg,), transport="shm", threads_per_worker=1,
                     timeout=timeout)  # fmt: skip
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
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--links", type=float, nargs="+", default=list(d.links_gbit), help="Gbit/s")
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    cfg = DilocoBench(model=args.model, workers=args.workers, batch=args.batch, seq=args.seq,
                      steps=args.steps, hs=tuple(args.hs), quantized=tuple(args.quantized),
                      quantized_h=args.quantized_h, eval_every=args.eval_every,
                      links_gbit=tuple(args.links), repeats=args.repeats)  # fmt: skip
    run(cfg, args.out)
