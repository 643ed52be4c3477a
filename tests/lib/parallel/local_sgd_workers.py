"""Worker functions and the one-process reference for tests/lib/parallel/test_local_sgd.py.

A run is a plain dict (``case``): inner optimizer ("sgd" or "adamw") and its lr, H, outer lr and
momentum, fragments, delay, mix, quantize, steps. Every rank builds the same tiny MLP from a
rank-specific seed (DiLoCo's broadcast must make them equal) and trains on its own slice of
fixed batches. ``simulate`` is the reference: one process holding p worker copies, written out
with torch.optim.SGD(nesterov=True) as the outer optimizer, its own reading of the schedule and
minidist.quant's round trip for quantized payloads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minidist.parallel import DistributedDataParallel, local_sgd
from minidist.parallel.buckets import allreduce_average
from minidist.quant import dequantize_absmax_int8, dequantize_nf4, quantize_absmax_int8, quantize_nf4

IN, HIDDEN, OUT, BATCH, SEED = 6, 8, 3, 4, 77


def case(**overrides) -> dict:
    base = dict(inner="adamw", inner_lr=0.05, H=3, outer_lr=0.7, mu=0.9, fragments=1, delay=0, mix=0.0,
                quantize=None, steps=9, local_sgd=False, seams=False)  # fmt: skip
    return {**base, **overrides}


CASES = {
    "ddp_equal": case(inner="sgd", inner_lr=0.1, H=1, outer_lr=1.0, mu=0.0, steps=3),
    "diloco": case(),
    "local_sgd": case(H=2, steps=6, local_sgd=True),
    "streaming": case(H=4, fragments=2, delay=1, mix=0.5, steps=11),
    "streaming_now": case(H=4, fragments=2, steps=8),
    # 3 fragments in flight at once (F tau > H), 3 still pending at the end (flush), int8 slices
    "streaming_deep": case(H=4, fragments=4, delay=3, mix=0.5, quantize="int8", steps=10),
    # the seams: a plain SGD outer step (momentum ignored) and every fragment launched every H steps
    "seams": case(H=3, fragments=3, steps=6, seams=True),
    "int8": case(quantize="int8", steps=6),
    "nf4": case(quantize="nf4", steps=6),
    **{f"H{h}": case(inner="sgd", H=h, steps=16) for h in (1, 4, 16)},
}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batches(p: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (steps, p, BATCH, IN), y (steps, p, BATCH, OUT): rank r's batch of step t is [t, r]."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(steps, p, BATCH, IN, generator=gen), torch.randn(steps, p, BATCH, OUT, generator=gen)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def inner_optimizer(c: dict, model: nn.Module) -> torch.optim.Optimizer:
    if c["inner"] == "sgd":
        return torch.optim.SGD(model.parameters(), lr=c["inner_lr"])
    return torch.optim.AdamW(model.parameters(), lr=c["inner_lr"])


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sgd_outer_step(global_params, momentum, delta, lr, mu) -> None:
    """A student's outer step, for the seam: plain SGD, no momentum."""
    global_params.sub_(delta, alpha=lr)


def all_at_once(t: int, inner_steps: int, fragments: int) -> list[int]:
    """A schedule for the seam: every fragment after every H-th step (DiLoCo, cut in pieces)."""
    return list(range(fragments)) if t % inner_steps == 0 else []


def run_case(comm, c: dict) -> dict:
    """Train one case on this rank: final parameters, the schedule's counters, bytes per step."""
    model = make_model(SEED + 1000 * comm.rank)
    opt = inner_optimizer(c, model)
    if c["local_sgd"]:
        trainer = local_sgd.LocalSGD(model, comm, opt, c["H"])
    else:
        seams = dict(outer_step=sgd_outer_step, schedule=all_at_once) if c["seams"] else {}
        trainer = local_sgd.DiLoCo(model, comm, opt, c["H"], c["outer_lr"], c["mu"], c["fragments"],
                                   c["quantize"], delay=c["delay"], mix=c["mix"], **seams)  # fmt: skip
    xs, ys = batches(comm.world_size, c["steps"])
    sent, in_flight = [], []
    for t in range(c["steps"]):
        before = comm.stats.bytes_sent
        trainer.step(loss_fn, (xs[t, comm.rank], ys[t, comm.rank]))
        sent.append(comm.stats.bytes_sent - before)
        in_flight.append(len(trainer._in_flight))
    trainer.flush()
    return dict(params=flat(model), global_params=trainer.global_params.clone(), sent=sent,
                launched=trainer.launched, applied=trainer.applied, bounds=trainer.bounds,
                in_flight=in_flight)  # fmt: skip


def run_ddp_sgd(comm, c: dict) -> torch.Tensor:
    """The library's DDP with SGD on the same slices (the H = 1 comparison)."""
    model = make_model(SEED + 1000 * comm.rank)
    hook = functools.partial(allreduce_average, algorithm="ring")
    ddp = DistributedDataParallel(model, comm, comm_hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=c["inner_lr"])
    xs, ys = batches(comm.world_size, c["steps"])
    for t in range(c["steps"]):
        opt.zero_grad()
        F.mse_loss(ddp(xs[t, comm.rank]), ys[t, comm.rank]).backward()
        opt.step()
    return flat(model)


def every_case(comm) -> dict:
    """One launch runs every case (and DDP) in turn."""
    outs = {name: run_case(comm, c) for name, c in CASES.items()}
    outs["ddp"] = run_ddp_sgd(comm, CASES["ddp_equal"])
    return outs


# ------------------------------------------------------------------ the one-process reference


def round_trip(delta: torch.Tensor, quantize: str | None) -> torch.Tensor:
    """What a worker's delta becomes after the payload's quantization (blocks of 64)."""
    if quantize is None:
        return delta
    n, block = delta.numel(), local_sgd.BLOCK
    padded = F.pad(delta, (0, (-n) % block)).view(-1, block)
    if quantize == "int8":
        return dequantize_absmax_int8(*quantize_absmax_int8(padded)).reshape(-1)[:n]
    return dequantize_nf4(quantize_nf4(delta, block=block, double_quant=False))


def set_slice(model: nn.Module, lo: int, hi: int, values: torch.Tensor) -> None:
    v = flat(model)
    v[lo:hi] = values
    torch.nn.utils.vector_to_parameters(v, model.parameters())


def simulate(c: dict, p: int) -> dict:
    """p workers in one process; outer step by torch.optim.SGD(nesterov) on a global copy."""
    workers = [make_model(SEED) for _ in range(p)]  # rank 0's weights, as the broadcast leaves them
    opts = [inner_optimizer(c, m) for m in workers]
    n = flat(workers[0]).numel()
    F_, H = c["fragments"], c["H"]
    bounds = [(f * n // F_, (f + 1) * n // F_) for f in range(F_)]
    outer_lr, mu = (1.0, 0.0) if c["local_sgd"] else (c["outer_lr"], c["mu"])
    globals_, outer = [], []
    for lo, hi in bounds:
        g = nn.Parameter(flat(workers[0])[lo:hi].clone())
        globals_.append(g)
        outer.append(torch.optim.SGD([g], lr=outer_lr, momentum=mu, nesterov=mu > 0))
    pending = []  # (apply after step, fragment, averaged delta)
    xs, ys = batches(p, c["steps"])
    for t in range(1, c["steps"] + 1):
        for r, (m, o) in enumerate(zip(workers, opts)):
            o.zero_grad()
            loss_fn(m, (xs[t - 1, r], ys[t - 1, r])).backward()
            o.step()
        for item in [x for x in pending if x[0] == t]:
            pending.remove(item)
            _apply(c, workers, bounds, globals_, outer, *item[1:])
        for f in range(F_):
            offset = (f + 1) * H // F_
            if t >= offset and (t - offset) % H == 0:
                lo, hi = bounds[f]
                deltas = [round_trip(globals_[f].detach() - flat(m)[lo:hi], c["quantize"]) for m in workers]
                pending.append((t + c["delay"], f, sum(deltas[1:], deltas[0]) / p))
                if c["delay"] == 0:
                    _apply(c, workers, bounds, globals_, outer, *pending.pop()[1:])
    for item in pending:
        _apply(c, workers, bounds, globals_, outer, *item[1:])
    return dict(params=[flat(m) for m in workers], global_params=torch.cat([g.detach() for g in globals_]))


def _apply(c, workers, bounds, globals_, outer, f, averaged) -> None:
    globals_[f].grad = averaged.clone()
    outer[f].step()
    lo, hi = bounds[f]
    for m in workers:
        set_slice(m, lo, hi, c["mix"] * flat(m)[lo:hi] + (1 - c["mix"]) * globals_[f].detach())


def simulate_local_sgd(c: dict, p: int) -> torch.Tensor:
    """Plain local SGD in one process: every H steps each worker's parameters become the mean."""
    workers = [make_model(SEED) for _ in range(p)]
    opts = [inner_optimizer(c, m) for m in workers]
    xs, ys = batches(p, c["steps"])
    for t in range(1, c["steps"] + 1):
        for r, (m, o) in enumerate(zip(workers, opts)):
            o.zero_grad()
            loss_fn(m, (xs[t - 1, r], ys[t - 1, r])).backward()
            o.step()
        if t % c["H"] == 0:
            mean = torch.stack([flat(m) for m in workers]).mean(0)
            for m in workers:
                torch.nn.utils.vector_to_parameters(mean.clone(), m.parameters())
    return flat(workers[0])


def simulate_ddp_sgd(c: dict, p: int) -> torch.Tensor:
    """One process, the whole batch (p x BATCH rows) per step, SGD: what DDP computes."""
    model = make_model(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=c["inner_lr"])
    xs, ys = batches(p, c["steps"])
    for t in range(c["steps"]):
        opt.zero_grad()
        F.mse_loss(model(xs[t].reshape(-1, IN)), ys[t].reshape(-1, OUT)).backward()
        opt.step()
    return flat(model)
