"""The model-parallel bench's launches: every variant trained on 2 ranks, what each rank measured.

``_measure(bench)`` runs them all: DP, TP-2, PP GPipe/1F1B and ZeRO-1/2/3 interleaved in one
launch (``_interleaved_worker``), the ZeRO stages alone and ours vs FSDP2 for their memory and
step times (``_zero_launches``), and the sleep-timed pipeline bubbles. ``report.run`` prints them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minidist import memory
from minidist.models.zero_training import (
    _adamw,
    compare_with_fsdp2,
    config,
    fixed_mmap_threshold,
    fsdp2_model,
    make_data,
    make_model,
    my_rows,
    train_zero,
)
from minidist.parallel import zero

from ...comm import Communicator


@dataclass(frozen=True)
class ModelParallelBench:
    """One decoder, 2 ranks. ``batch`` is per rank for data parallelism: every row trains on
    the same global batch of ``world_size * batch`` sequences per step (DP and ZeRO: ``batch``
    rows on each rank; TP: all rows on both ranks; PP: all rows, cut into ``microbatches``).
    ``steps`` measured steps after ``warmup``. The bubble rows use sleep-timed stages
    (``t_forward``, ``t_backward`` seconds) for each m in ``bubble_microbatches``."""

    vocab: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 64
    batch: int = 4
    steps: int = 10
    warmup: int = 1
    microbatches: int = 4
    bubble_microbatches: tuple[int, ...] = (2, 8)
    t_forward: float = 0.05
    t_backward: float = 0.1
    fsdp2: bool = True
    world_size: int = 2
    lr: float = 1e-3

    def run_config(self, **overrides) -> dict:
        """The :func:`config` dict of this bench (float32), ``overrides`` on top."""
        base = dict(
            world_size=self.world_size, steps=self.warmup + self.steps, batch=self.batch,
            seq=self.seq, vocab=self.vocab, hidden=self.hidden, layers=self.layers,
            heads=self.heads, lr=self.lr,
        )  # fmt: skip
        return config(**{**base, **overrides})


def _held(params, opt) -> int:
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    params = [p.detach() for p in params]  # tensor_bytes of a Parameter would count its .grad too
    state = [dict(s) for s in opt.state.values()]  # the values: opt.state's keys are the parameters
    return memory.tensor_bytes(params) + memory.tensor_bytes(grads) + memory.tensor_bytes(state)


def _interleaved_worker(comm: Communicator, bench: ModelParallelBench) -> dict:
    """DP (our DDP), TP-2, PP GPipe, PP 1F1B and ZeRO-1/2/3 in one launch, interleaved: one step
    of each per round, a barrier before each step, so that load that drifts slows every variant
    alike. Per variant: step times, bytes sent in the last step, loss; model states held after
    the last step (DP, TP, PP; the ZeRO rows' memory comes from their own launches)."""
    from minidist.models.stages import next_token_loss, split_decoder, sync_tied_gradients
    from minidist.models.tp_decoder import TensorParallelDecoderLM
    from minidist.parallel import pipeline as pp
    from minidist.parallel import tensor as tp
    from minidist.parallel.ddp import DistributedDataParallel

    torch.set_num_threads(1)
    fixed_mmap_threshold()
    cfg = bench.run_config()
    rank, world, m = comm.rank, comm.world_size, bench.microbatches
    data = make_data(cfg)

    def my_step(state, ids):  # data parallel: this rank's rows
        mine = my_rows(ids, rank, cfg)
        loss = state["net"](mine, labels=mine).loss
        loss.backward()
        return float(loss.detach())

    def tp_step(state, ids):  # tensor parallel: every row on every rank
        loss = state["net"](ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    def pp_step(state, ids):
        out = pp.run_pipeline(
            state["net"], comm, state["schedule"][rank],
            inputs=ids if rank == 0 else None, targets=ids if rank == world - 1 else None,
            loss_fn=next_token_loss,
        )  # fmt: skip
        sync_tied_gradients(state["net"], comm)
        state["result"] = out
        return out.loss

    variants = {
        "DP (our DDP)": {"net": DistributedDataParallel(make_model(cfg), comm), "step": my_step},
        "TP-2": {"net": TensorParallelDecoderLM.from_dense(make_model(cfg), comm), "step": tp_step},
    }
    for name, fn in (("PP GPipe", pp.gpipe), ("PP 1F1B", pp.one_f_one_b)):
        variants[name] = {
            "net": split_decoder(make_model(cfg), world)[rank], "step": pp_step, "schedule": fn(world, m)
        }  # fmt: skip
    for state in variants.values():
        state["opt"] = _adamw(state["net"].parameters(), cfg)
    for stage in (1, 2):
        model = make_model(cfg)
        opt = zero.ZeroOptimizer(
            model.parameters(), comm, stage=stage, optimizer=torch.optim.AdamW,
            lr=cfg["lr"], weight_decay=cfg["weight_decay"],
        )  # fmt: skip
        variants[f"ZeRO-{stage}"] = {"net": model, "opt": opt, "step": my_step, "sharded": True}
    sharded = zero.FullyShardedModule(make_model(cfg), comm, prefetch=True)
    opt = _adamw(sharded.parameters(), cfg)
    variants["ZeRO-3"] = {"net": sharded, "opt": opt, "step": my_step, "sharded": True}
    for state in variants.values():
        state["times"] = []
    for step, ids in enumerate(data):
        for name, state in variants.items():
            comm.barrier()
            comm.reset_stats()
            tp.reset_collective_counts(comm)
            t0 = time.perf_counter()
            state["loss"] = state["step"](state, ids)
            state["opt"].step()
            elapsed = time.perf_counter() - t0
            state["bytes_sent"] = comm.stats.bytes_sent
            if not state.get("sharded"):
                state["held"] = _held(state["net"].parameters(), state["opt"])
            state["opt"].zero_grad()
            if step >= bench.warmup:
                state["times"].append(elapsed)
            if name == "TP-2":
                state["collectives"] = tp.count_collectives(comm)
    out = {}
    for name, state in variants.items():
        row = {k: state[k] for k in ("times", "bytes_sent", "loss") if k in state}
        row["held"] = state.get("held")
        if "collectives" in state:
            row["collectives"] = state["collectives"]
        if "result" in state:
            row["peak_in_flight"] = state["result"].peak_in_flight
            row["pipeline"] = state["result"]
        if name == "ZeRO-3":
            row["padded_numel"] = state["net"].padded_numel
        elif name.startswith("ZeRO"):
            row["padded_numel"] = state["opt"].padded_numel
        out[name] = row
    return out


def _one_thread(comm: Communicator, fn, cfg: dict):
    """``fn(comm, cfg)`` with one torch thread per rank, as in the interleaved launch (2 ranks on
    2 cores: more threads would only fight over the cores)."""
    torch.set_num_threads(1)
    return fn(comm, cfg)


def _zero3_vs_fsdp2_worker(comm: Communicator, bench: ModelParallelBench) -> dict:
    """Ours (ZeRO-3) and FSDP2 on gloo in one launch, interleaved step by step (for step times;
    their memory comes from :func:`compare_with_fsdp2`, where each runs on its own)."""
    torch.set_num_threads(1)
    fixed_mmap_threshold()
    cfg = bench.run_config()
    ours = zero.FullyShardedModule(make_model(cfg), comm, prefetch=True)
    theirs = fsdp2_model(cfg)
    variants = {
        "ZeRO-3 (gloo)": (ours, _adamw(ours.parameters(), cfg)),
        "FSDP2 (torch, gloo)": (theirs, _adamw(theirs.parameters(), cfg)),
    }
    out = {name: {"times": []} for name in variants}
    for step, ids in enumerate(make_data(cfg)):
        mine = my_rows(ids, comm.rank, cfg)
        for name, (net, opt) in variants.items():
            comm.barrier()
            t0 = time.perf_counter()
            loss = net(mine, labels=mine).loss
            loss.backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            opt.zero_grad()
            out[name]["loss"] = float(loss.detach())
            if step >= bench.warmup:
                out[name]["times"].append(elapsed)
    return out


def _zero_launches(bench: ModelParallelBench) -> dict:
    """Memory of ZeRO-1/2/3 (one launch each, pipe transport, 3 steps: RSS peaks of their own),
    of ours vs FSDP2 (one launch on gloo, ours stage 3 then FSDP2, 3 steps each), and the step
    times of ours vs FSDP2 (one launch on gloo, interleaved)."""
    import minidist as md

    rows = {}
    for stage in (1, 2, 3):
        cfg = bench.run_config(stage=stage, steps=3)  # the peak over steps 2 and 3
        print(f"ZeRO-{stage} alone (memory) ...", flush=True)
        rows[f"ZeRO-{stage}"] = md.launch(
            _one_thread, bench.world_size, args=(train_zero, cfg), transport="pipe", timeout=300
        )
    if bench.fsdp2:
        print("ours (ZeRO-3) then torch FSDP2 on gloo (memory) ...", flush=True)
        rows["FSDP2"] = md.launch(
            _one_thread,
            bench.world_size,
            args=(compare_with_fsdp2, bench.run_config(steps=3)),
            transport="torch",
            timeout=300,
        )
        print("ours (ZeRO-3) and torch FSDP2 on gloo, interleaved (step times) ...", flush=True)
        rows["FSDP2 interleaved"] = md.launch(
            _zero3_vs_fsdp2_worker, bench.world_size, args=(bench,), transport="torch", timeout=600
        )
    return rows


def _measure(bench: ModelParallelBench):
    """The launches: interleaved rows, ZeRO memory and FSDP2, sleep-timed bubbles."""
    import minidist as md
    from minidist.parallel import pipeline as pp

    p = bench.world_size
    print(
        f"DP, TP-2, PP GPipe, PP 1F1B, ZeRO-1/2/3 interleaved in one launch "
        f"({bench.warmup + bench.steps} steps each) ...",
        flush=True,
    )
    par = md.launch(_interleaved_worker, p, args=(bench,), transport="pipe", timeout=600)
    zero_runs = _zero_launches(bench)
    bubbles = {}
    for name, fn in (("GPipe", pp.gpipe), ("1F1B", pp.one_f_one_b)):
        for mb in bench.bubble_microbatches:
            print(f"bubble {name} m={mb} (sleep-timed stages) ...", flush=True)
            res = pp.measure_bubble(
                p, mb, fn, bench.t_forward, bench.t_backward, transport="pipe", timeout=120
            )
            bubbles[(name, mb)] = {k: res[k] for k in ("measured", "formula", "simulated", "wall_s")}
    return par, zero_runs, bubbles
