"""Lecture 08, section 2: the training loop of the three ZeRO stages, and what each rank measures."""

import gc
import time

import torch

from minidist import memory
from minidist.models.zero_training import fixed_mmap_threshold, make_data, make_model, my_rows
from minidist.parallel import zero


def train(comm, cfg):
    """Rank body: ``cfg["steps"]`` AdamW steps of a decoder under ZeRO stage ``cfg["stage"]``.

    Returns the bytes sent in the last step, the bytes held after it (by kind), the times of the
    steps after the first (warm-up) one, and the peak resident memory those steps added."""
    fixed_mmap_threshold()  # big blocks go back to the system when freed: the peak RSS follows the tensors
    model = make_model(cfg)  # seeded: the same weights on every rank
    numel = sum(p.numel() for p in model.parameters())
    adamw = dict(lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    if cfg["stage"] in (1, 2):  # the model stays whole; the optimizer shards its state (stage 2: grads too)
        runner = model
        opt = zero.ZeroOptimizer(model.parameters(), comm, stage=cfg["stage"], **adamw)
    else:  # stage 3: the module keeps only its shards, and gathers each unit's weights when it runs
        runner = zero.FullyShardedModule(model, comm, prefetch=cfg["prefetch"])
        opt = torch.optim.AdamW(runner.parameters(), **adamw)
    times = []
    for ids in make_data(cfg):  # each step's global batch: (world_size * batch, seq) token ids
        mine = my_rows(ids, comm.rank, cfg)  # this rank's rows
        comm.reset_stats()
        start = time.perf_counter()
        loss = runner(mine, labels=mine).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        sent, held = comm.stats.bytes_sent, held_bytes(runner, opt)
        opt.zero_grad()
        if len(times) == 1:  # after the warm-up step: the peak of the steps that follow
            gc.collect()
            memory.reset_peak_rss()
            base = memory.rss_bytes()
    padded = opt.padded_numel if cfg["stage"] in (1, 2) else runner.padded_numel
    return {
        "bytes_sent": sent,
        "held": held,
        "step_times": times[1:],
        "peak_rss_growth": memory.peak_rss_bytes() - base,
        "numel": numel,
        "padded_numel": padded,
    }


def held_bytes(runner, opt):
    """Bytes of the distinct tensors this rank holds, by kind: params, grads, optimizer."""
    if isinstance(opt, zero.ZeroOptimizer):
        held = opt.held_tensors()
    else:
        held = {**runner.held_tensors(), "optimizer": [dict(s) for s in opt.state.values()]}
    return {kind: memory.tensor_bytes(tensors) for kind, tensors in held.items()}


def all_stages(comm, cfg, stages=(1, 2, 3)):
    """Rank body: ``train`` for each of ``stages`` in turn, in one launch; {stage: its result}."""
    return {stage: train(comm, {**cfg, "stage": stage}) for stage in stages}
