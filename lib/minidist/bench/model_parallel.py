"""``python -m minidist.bench model_parallel``: tensor, pipeline and ZeRO/FSDP on one decoder, 2 ranks.

Every row trains the same ``DecoderLM`` (default vocab 8192, d 256, 4 layers, 4 heads, seq 64) from
the same weights on the same global batch of 2 x ``batch`` sequences per step with AdamW, so the
last-step losses printed agree and the step times compare "one global batch" each:

* ``DP (our DDP)`` -- the reference line: ``parallel.ddp.DistributedDataParallel``, ``batch`` rows
  per rank, gradients allreduced (2 (p-1)/p x gradient bytes per rank);
* ``TP-2`` -- ``TensorParallelDecoderLM.from_dense``: both ranks see all rows, each holds half of
  every big matrix; bytes per rank vs :func:`tp_traffic_formula` (2 allreduces of b s d per layer
  forward, 2 backward, plus the embedding's, the logits' f and the cross-entropy's two small ones),
  and ``tensor.count_collectives`` vs the same counts;
* ``PP GPipe``, ``PP 1F1B`` -- ``models.stages.split_decoder`` into 2 stages, ``microbatches``
  microbatches, ``pipeline.run_pipeline`` + ``stages.sync_tied_gradients``: bytes vs
  :func:`pp_traffic_formula` (activations forward, their gradients back, the tied table's gradient
  swap), microbatches in flight vs ``pipeline.peak_in_flight`` of the schedule, and the bubble of
  the real (unbalanced) stages from ``pipeline.timeline_of``;
* ``ZeRO-1/2/3`` -- ``zero.ZeroOptimizer`` (stages 1, 2) and ``zero.FullyShardedModule`` (3), as
  in :func:`train_zero`: bytes vs ``zero.traffic_formula``;
* ``ZeRO-3 (gloo)`` and ``FSDP2 (torch, gloo)`` -- :func:`compare_with_fsdp2`: ours and torch's
  ``fully_shard`` in one launch on a gloo group, the ours / FSDP2 ratios of step time and peak RSS.

The rows down to ZeRO-3 run in ONE launch, interleaved (one step of each per round, a barrier
before each step) so that load drifting on a shared machine slows them alike; for their memory
the ZeRO stages run again alone (:func:`train_zero`, 3 steps: a peak RSS of their own).

A second table puts the model states each rank holds after the step (parameters + gradients +
AdamW state, ``memory.tensor_bytes``) next to ``memory.estimate(precision="fp32", dp/tp/pp,
zero_stage, stage=rank)``, and the peak RSS growth of the ZeRO/FSDP2 steps next to the
calculator's activations. A third measures the pipeline bubble with sleep-timed stages
(``pipeline.measure_bubble``: sleeping takes no CPU, so 2 busy cores still show the schedule)
against ``(p - 1) / (m + p - 1)``. Results: bench-results/model_parallel.json.

This module also holds the **run functions** that the ZeRO tests, notebook 08 and this bench
share. A run is a plain dict (:func:`config`) so that the single-process :func:`reference` and
every rank build the same model (same seed) and read the same data (rank r takes rows
``r*batch .. (r+1)*batch`` of each step's global batch)::

    cfg = config(stage=2, dtype="float64")
    outs = md.launch(train_zero, 2, args=(cfg,), transport="pipe", timeout=90)
    want = reference(cfg)                        # one process, the concatenated batch
    outs[0]["state"]  == want                    # to float64 rounding
    outs[0]["bytes_sent"] == zero.traffic_formula(2, outs[0]["padded_numel"], 2, 8)
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from minidist import memory
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.parallel import zero

from ..comm import Communicator

# --------------------------------------------------------------------------------------------
# Shared run functions (tests/lib/parallel/test_zero.py, notebook 08, the bench below)
# --------------------------------------------------------------------------------------------


def config(**overrides) -> dict:
    """The run description, a plain dict (it travels to the ranks by pickle).

    Defaults are a tiny decoder (vocab 64, hidden 32, 2 layers, 2 heads, seq 8), 2 ranks with 2
    samples each, 10 AdamW steps, ZeRO stage 1, float32 on the CPU. Any key can be overridden:
    ``config(stage=3, dtype="float64", prefetch=False)``."""
    base = dict(
        world_size=2, stage=1, steps=10, batch=2, seq=8, seed=0, lr=1e-2, weight_decay=0.1,
        vocab=64, hidden=32, layers=2, heads=2, device="cpu", prefetch=True, dtype="float32",
    )  # fmt: skip
    unknown = set(overrides) - set(base)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(base)}")
    base.update(overrides)
    return base


def model_config(cfg: dict) -> TransformerConfig:
    """The pre-LN causal decoder that ``cfg`` describes (max_positions = seq)."""
    return TransformerConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        n_layers=cfg["layers"],
        n_heads=cfg["heads"],
        max_positions=cfg["seq"],
        causal=True,
        pre_ln=True,
        embedding_layernorm=False,
        layer_norm_eps=1e-5,
    )


def make_model(cfg: dict) -> DecoderLM:
    """A fresh ``DecoderLM``, seeded with ``cfg["seed"]``: the same weights in every process."""
    torch.manual_seed(cfg["seed"])
    return DecoderLM(model_config(cfg)).to(cfg["device"], getattr(torch, cfg["dtype"]))


def make_data(cfg: dict) -> torch.Tensor:
    """Uniform token ids, shape (steps, world_size * batch, seq): every step's global batch."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (cfg["steps"], cfg["world_size"] * cfg["batch"], cfg["seq"])
    return torch.randint(0, cfg["vocab"], shape, generator=g)


def my_rows(ids: torch.Tensor, rank: int, cfg: dict) -> torch.Tensor:
    """Rank ``rank``'s slice of one step's global batch, on ``cfg["device"]``."""
    b = cfg["batch"]
    return ids[rank * b : (rank + 1) * b].to(cfg["device"])


def _adamw(params, cfg):
    return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])


def reference(cfg: dict) -> dict[str, torch.Tensor]:
    """One process, the concatenated global batch, plain AdamW: the final parameters by name.

    Data parallelism (with or without ZeRO) averages the ranks' gradients, which equals the
    gradient of the mean loss over the concatenated batch, so every sharded run must end here."""
    model = make_model(cfg)
    opt = _adamw(model.parameters(), cfg)
    for ids in make_data(cfg):
        ids = ids.to(cfg["device"])
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def train_zero(comm: Communicator, cfg: dict) -> dict:
    """Rank body (``md.launch(train_zero, 2, args=(cfg,))``): ZeRO stage 1 or 2
    (``zero.ZeroOptimizer``) or stage 3 (``zero.FullyShardedModule`` + AdamW on the shards).

    Returns a dict:

    * ``state``: the final full parameters by name (stage 3 gathers them);
    * ``bytes_sent``: what this rank sent in the last step (stats reset before its forward),
      to compare with ``zero.traffic_formula(stage, padded_numel, world, dtype_bytes)``;
    * ``held``: bytes this rank holds after the last step (before zero_grad) by kind
      (params, grads, optimizer), to compare with ``memory.estimate(..., zero_stage=stage)``;
    * ``padded_numel`` (the flat count the shards are cut from) and ``numel`` (the model's);
    * ``step_s``: median step seconds, the first (warm-up) step left out;
    * ``peak_gathered_units``: stage 3 only, most units gathered at once (2 with prefetch);
    * ``peak_rss_growth``: peak RSS over the steps after the first, above the RSS after it
      (with :func:`fixed_mmap_threshold`, so that it is the peak of the step's live tensors);
    * ``loss``: this rank's loss in the last step (mean over its rows)."""
    fixed_mmap_threshold()
    model = make_model(cfg)
    stage = cfg["stage"]
    if stage in (1, 2):
        opt = zero.ZeroOptimizer(
            model.parameters(), comm, stage=stage, optimizer=torch.optim.AdamW,
            lr=cfg["lr"], weight_decay=cfg["weight_decay"],
        )  # fmt: skip
        runner, held, padded = model, opt.held_tensors, opt.padded_numel
    else:
        runner = zero.FullyShardedModule(model, comm, prefetch=cfg["prefetch"])
        opt = _adamw(runner.parameters(), cfg)
        padded = runner.padded_numel

        def held():
            return {**runner.held_tensors(), "optimizer": [dict(s) for s in opt.state.values()]}

    times = []
    for ids in make_data(cfg):
        mine = my_rows(ids, comm.rank, cfg)
        comm.reset_stats()
        t0 = time.perf_counter()
        loss = runner(mine, labels=mine).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        sent = comm.stats.bytes_sent
        holding = {kind: memory.tensor_bytes(ts) for kind, ts in held().items()}
        opt.zero_grad()
        if len(times) == 1:
            base = _start_peak()
    peak = memory.peak_rss_bytes() - base
    if stage in (1, 2):
        state = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    else:
        state = {n: t.cpu() for n, t in runner.full_state().items()}
    return {
        "state": state,
        "bytes_sent": sent,
        "held": holding,
        "padded_numel": padded,
        "numel": sum(p.numel() for p in make_model(cfg).parameters()),
        "step_s": statistics.median(times[1:] or times),
        "peak_gathered_units": getattr(runner, "peak_gathered_units", None),
        "peak_rss_growth": peak,
        "loss": float(loss.detach()),
    }


def fsdp2_model(cfg: dict) -> DecoderLM:
    """:func:`make_model` wrapped by torch's FSDP2 (``fully_shard``; needs a process group).

    Each block and the final norm are their own group; the root group holds the embeddings
    (the word table is tied to the output, which the root's forward uses)."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(cfg)
    for block in model.transformer.blocks:
        fully_shard(block)
    fully_shard(model.transformer.final_norm)
    fully_shard(model)
    return model


def train_fsdp2(comm: Communicator, cfg: dict) -> dict:
    """Rank body: torch's FSDP2 (:func:`fsdp2_model`) on the same model and data; needs
    ``transport="torch"`` (a gloo process group). Returns ``state``,
    ``step_s``, ``peak_rss_growth`` and ``loss`` measured as in :func:`train_zero`."""
    fixed_mmap_threshold()
    model = fsdp2_model(cfg)
    opt = _adamw(model.parameters(), cfg)
    times = []
    for ids in make_data(cfg):
        mine = my_rows(ids, comm.rank, cfg)
        t0 = time.perf_counter()
        loss = model(mine, labels=mine).loss
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
        if len(times) == 1:
            base = _start_peak()
    peak = memory.peak_rss_bytes() - base
    state = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {
        "state": state,
        "step_s": statistics.median(times[1:] or times),
        "peak_rss_growth": peak,
        "loss": float(loss.detach()),
    }


def fixed_mmap_threshold(threshold: int = 64 << 10) -> bool:
    """Make this process's peak RSS follow its live tensors (glibc only; False elsewhere).

    glibc serves big blocks with mmap, but raises that threshold each time such a block is freed;
    from then on freed memory is reused from the heap and a step's RSS peak depends on history
    (two ranks doing the same work measured 32 and 94 MiB). ``mallopt(M_MMAP_THRESHOLD, 64 KiB)``
    fixes the threshold: every block over 64 KiB is an mmap returned to the system when freed, so
    ``memory.peak_rss_bytes`` above the RSS between steps is the step's peak of live tensors
    (the two ranks then agree to about 1 MiB). Call it first thing in a rank."""
    m_mmap_threshold = -3  # from malloc.h
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, threshold))
    except (OSError, AttributeError):
        return False


def _start_peak() -> int:
    """After the warm-up step: the RSS now, and the peak reset to it (``minidist.memory``)."""
    gc.collect()
    memory.reset_peak_rss()
    return memory.rss_bytes()


def compare_with_fsdp2(comm: Communicator, cfg: dict) -> dict:
    """Rank body: ours (stage 3) then FSDP2 in the same launch (``transport="torch"``), same
    model and data.

    Per rank: final full parameters of both (``ours``, ``fsdp2``), median step seconds (first
    step left out) and the peak RSS growth over the steps after the first
    (``minidist.memory.peak_rss_bytes`` above the RSS after the warm-up step: what the step
    itself allocates, gathered weights and activations), plus ours' ``bytes_sent``/``held``."""
    ours = train_zero(comm, {**cfg, "stage": 3})
    gc.collect()
    theirs = train_fsdp2(comm, cfg)
    return {
        "ours": ours["state"],
        "fsdp2": theirs["state"],
        "ours_step_s": ours["step_s"],
        "fsdp2_step_s": theirs["step_s"],
        "ours_peak_rss_growth": ours["peak_rss_growth"],
        "fsdp2_peak_rss_growth": theirs["peak_rss_growth"],
        "ours_loss": ours["loss"],
        "fsdp2_loss": theirs["loss"],
        "ours_bytes_sent": ours["bytes_sent"],
        "ours_held": ours["held"],
        "padded_numel": ours["padded_numel"],
    }


# --------------------------------------------------------------------------------------------
# The bench
# --------------------------------------------------------------------------------------------


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


# --- formulas: payload bytes one rank sends per step (p = 2: every allreduce algorithm sends n) ---


def allreduce_bytes(n_bytes: float, world: int) -> float:
    """Bytes one rank sends in an allreduce of ``n_bytes``: the ring's 2 (p-1)/p n.

    For p = 2 every algorithm of ``minidist.collectives`` (ring, butterfly, tree, star) sends
    exactly n: one half-exchange each way for the ring, one full message for the others."""
    return 2 * (world - 1) / world * n_bytes


def tp_traffic_formula(
    cfg: TransformerConfig, batch: int, seq: int, world: int, dtype_bytes: int = 4
) -> dict:
    """TP (``TensorParallelDecoderLM``) per step: collective counts and bytes per rank.

    forward:  embedding g (b s d) + 2 per layer (b s d each) + cross-entropy max (b (s-1))
              and [sum exp, target] (2 b (s-1))
    backward: 2 per layer (b s d) + f before the logits (b s d)"""
    bsd, tokens, layers = batch * seq * cfg.hidden_size, batch * (seq - 1), cfg.n_layers
    forward = bsd + 2 * layers * bsd + tokens + 2 * tokens
    backward = 2 * layers * bsd + bsd
    return {
        "forward": 1 + 2 * layers + 2,
        "backward": 2 * layers + 1,
        "bytes": allreduce_bytes((forward + backward) * dtype_bytes, world),
    }


def pp_traffic_formula(
    cfg: TransformerConfig, batch: int, seq: int, microbatches: int, dtype_bytes: int = 4
) -> float:
    """PP with 2 stages per step, bytes per rank: stage 0 sends each microbatch's activations
    (b/m, s, d) forward, stage 1 sends their gradients back (same size), each with a 64-byte
    header (8 int64: kind, microbatch, chunk, shape); then the two copies of the tied word
    table swap gradients (V d each way, ``stages.sync_tied_gradients``)."""
    act = batch // microbatches * seq * cfg.hidden_size * dtype_bytes
    return microbatches * (act + 64) + cfg.vocab_size * cfg.hidden_size * dtype_bytes


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


def run(bench: ModelParallelBench, out: str | None = None) -> dict:
    """Run every variant, print three tables (time and traffic, memory, bubble), save JSON."""
    from minidist.parallel import pipeline as pp

    from ._util import out_dir, print_table, save_json

    p, m = bench.world_size, bench.microbatches
    if p != 2:
        raise ValueError(f"this bench runs 2 ranks (TP-2, 2 stages, ZeRO over 2), got world_size={p}")
    global_batch = p * bench.batch
    if global_batch % m:
        raise ValueError(
            f"the global batch {global_batch} (= {p} x batch {bench.batch}) does not split into "
            f"{m} microbatches; pick a microbatch count that divides it"
        )
    cfg = bench.run_config()
    mcfg = model_config(cfg)
    load_before = os.getloadavg()
    par, zero_runs, bubbles = _measure(bench)
    load_after = os.getloadavg()

    # ---- time and traffic ---------------------------------------------------------------------
    numel = sum(p_.numel() for p_ in make_model(cfg).parameters())
    formulas = {
        "DP (our DDP)": allreduce_bytes(numel * 4, p),
        "TP-2": tp_traffic_formula(mcfg, global_batch, bench.seq, p)["bytes"],
        "PP GPipe": pp_traffic_formula(mcfg, global_batch, bench.seq, m),
        "PP 1F1B": pp_traffic_formula(mcfg, global_batch, bench.seq, m),
    }
    for stage in (1, 2, 3):
        formulas[f"ZeRO-{stage}"] = zero.traffic_formula(stage, par[0][f"ZeRO-{stage}"]["padded_numel"], p, 4)
    rows: dict[str, dict] = {}
    for name in formulas:
        per_rank = [r[name] for r in par]
        step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank)))
        rows[name] = {
            "step_s": step,
            "bytes_sent": [r["bytes_sent"] for r in per_rank],
            "formula": formulas[name],
            "loss": statistics.fmean(r["loss"] for r in per_rank if r["loss"] is not None),
            "held": [r["held"] for r in per_rank] if per_rank[0]["held"] else None,
        }
    tp_counts = par[0]["TP-2"]["collectives"]
    tp_want = tp_traffic_formula(mcfg, global_batch, bench.seq, p)
    rows["TP-2"]["collectives"] = tp_counts
    for name in ("PP GPipe", "PP 1F1B"):
        fn = pp.gpipe if name == "PP GPipe" else pp.one_f_one_b
        tl = pp.timeline_of([r[name]["pipeline"] for r in par])
        rows[name]["peak_in_flight"] = [r[name]["peak_in_flight"] for r in par]
        rows[name]["peak_in_flight_schedule"] = pp.peak_in_flight(fn(p, m))
        rows[name]["bubble_measured"] = tl.bubble_fraction
    for stage in (1, 2, 3):  # memory from the run alone
        outs = zero_runs[f"ZeRO-{stage}"]
        rows[f"ZeRO-{stage}"]["held"] = [
            sum(o["held"][k] for k in ("params", "grads", "optimizer")) for o in outs
        ]
        rows[f"ZeRO-{stage}"]["peak_rss_growth"] = [o["peak_rss_growth"] for o in outs]
    if "FSDP2" in zero_runs:
        outs = zero_runs["FSDP2"]
        timed = zero_runs["FSDP2 interleaved"]
        for name in ("ZeRO-3 (gloo)", "FSDP2 (torch, gloo)"):
            rows[name] = {
                "step_s": statistics.median(max(ts) for ts in zip(*(r[name]["times"] for r in timed))),
                "loss": statistics.fmean(r[name]["loss"] for r in timed),
            }
        rows["ZeRO-3 (gloo)"].update(
            bytes_sent=[o["ours_bytes_sent"] for o in outs],
            formula=zero.traffic_formula(3, outs[0]["padded_numel"], p, 4),
            held=[sum(o["ours_held"][k] for k in ("params", "grads", "optimizer")) for o in outs],
            peak_rss_growth=[o["ours_peak_rss_growth"] for o in outs],
        )
        rows["FSDP2 (torch, gloo)"]["peak_rss_growth"] = [o["fsdp2_peak_rss_growth"] for o in outs]
    dp_step = rows["DP (our DDP)"]["step_s"]
    mib = 1 / (1 << 20)
    table = []
    for name, r in rows.items():
        sent = r.get("bytes_sent")
        formula = r.get("formula")
        table.append([
            name, r["step_s"] * 1e3, r["step_s"] / dp_step,
            f"{max(sent) * mib:.3f}" if sent else "-",
            f"{formula * mib:.3f}" if formula else "-",
            max(sent) / formula if sent and formula else math.nan,
            r["loss"],
        ])  # fmt: skip
    title = (
        f"decoder vocab {bench.vocab}, d {bench.hidden}, {bench.layers} layers, {bench.heads} heads, "
        f"seq {bench.seq}; {p} ranks, global batch {global_batch} per step; median of {bench.steps} "
        f"steps after {bench.warmup}, slowest rank; x DP = step time / the DP row's (rows down to ZeRO-3: "
        "one launch, steps interleaved; the two gloo rows: their own launch, interleaved with each "
        "other: compare them with each other); MiB sent = payload bytes per rank "
        "per step (the more of the two ranks); loss = last step's, mean of ranks (all rows train the same)"
    )
    print()
    text = print_table(
        ["variant", "step ms", "x DP", "MiB sent/rank", "formula MiB", "sent/formula", "loss"], table, title
    )
    print(
        f"TP-2 collectives per step: forward {tp_counts['forward']['allreduce']} allreduces "
        f"(formula {tp_want['forward']}), backward {tp_counts['backward']['allreduce']} "
        f"(formula {tp_want['backward']})"
    )
    for name in ("PP GPipe", "PP 1F1B"):
        r = rows[name]
        print(
            f"{name}, m={m}: peak microbatches in flight per stage {r['peak_in_flight']} "
            f"(schedule: {r['peak_in_flight_schedule']}); bubble on the decoder {r['bubble_measured']:.1%} "
            f"(balanced-stage formula {pp.bubble_formula(p, m):.1%}; stage 1 also computes the "
            f"{bench.vocab}-word head)"
        )

    # ---- memory -------------------------------------------------------------------------------
    def calc(name: str, rank: int) -> dict:
        kw = dict(batch=bench.batch, seq=bench.seq, precision="fp32")
        if name == "DP (our DDP)":
            return memory.estimate(mcfg, dp=p, activations="minidist", **kw)
        if name == "TP-2":
            return memory.estimate(mcfg, **{**kw, "batch": global_batch}, tp=p)
        if name.startswith("PP"):
            return memory.estimate(mcfg, **{**kw, "batch": global_batch // m}, pp=p, stage=rank)
        stage = 3 if name.startswith(("ZeRO-3", "FSDP2")) else int(name[-1])
        return memory.estimate(mcfg, zero_stage=stage, dp=p, activations="minidist", **kw)

    mem_table = []
    for name, r in rows.items():
        ests = [calc(name, rank) for rank in range(p)]
        states = [e["params"] + e["grads"] + e["optimizer"] for e in ests]
        r["calculator"] = ests
        held = r.get("held")
        growth = r.get("peak_rss_growth")
        acts = ests[0]["activations"] if name.startswith(("DP", "ZeRO", "FSDP2")) else math.nan
        mem_table.append([
            name,
            " / ".join(f"{h * mib:.1f}" for h in held) if held else "-",
            " / ".join(f"{s * mib:.1f}" for s in states),
            max(held) / max(states) if held else math.nan,
            " / ".join(f"{g * mib:.1f}" for g in growth) if growth else "-",
            acts * mib,
        ])  # fmt: skip
    print()
    mem_text = print_table(
        [
            "variant",
            "held MiB r0 / r1",
            "calculator MiB",
            "held/calc",
            "peak RSS growth MiB r0 / r1",
            "calc activations MiB",
        ],
        mem_table,
        "model states held after the optimizer step (parameters + gradients + AdamW state, counted from "
        "storages) vs memory.estimate(precision='fp32', dp/tp/pp, zero_stage, stage=rank); peak RSS growth "
        "= peak resident memory during the steps after the first, above the RSS after it (activations, "
        "fresh gradients, gathered units), next to the calculator's activations (activations='minidist', "
        "our DecoderLM exactly; DP/ZeRO rows)",
    )
    if "FSDP2 (torch, gloo)" in rows:
        ours, theirs = rows["ZeRO-3 (gloo)"], rows["FSDP2 (torch, gloo)"]
        print(
            f"ours ZeRO-3 / FSDP2 (gloo, interleaved): step time {ours['step_s'] / theirs['step_s']:.2f}x, "
            f"peak RSS growth {max(ours['peak_rss_growth']) / max(theirs['peak_rss_growth']):.2f}x"
        )

    # ---- bubble -------------------------------------------------------------------------------
    bubble_table = [
        [
            name,
            mb,
            b["measured"],
            b["formula"],
            b["simulated"],
            b["measured"] / b["formula"],
            b["wall_s"] * 1e3,
        ]
        for (name, mb), b in bubbles.items()
    ]
    print()
    bubble_text = print_table(
        ["schedule", "m", "measured", "formula", "simulated", "measured/formula", "makespan ms"],
        bubble_table,
        f"pipeline bubble, 2 stages, sleep-timed (t_F = {bench.t_forward * 1e3:g} ms, t_B = "
        f"{bench.t_backward * 1e3:g} ms): measured 1 - busy / (p x makespan) vs (p-1)/(m+p-1)",
    )
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    directory = out_dir(out)
    save_json(
        directory,
        "model_parallel",
        {
            "config": asdict(bench),
            "load": [load_before, load_after],
            "rows": rows,
            "bubble": [{"schedule": n, "m": mb, **b} for (n, mb), b in bubbles.items()],
            "tables": [text, mem_text, bubble_text],
        },
    )
    return {"rows": rows, "bubble": bubbles}


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "model_parallel", help="TP, PP (GPipe, 1F1B), ZeRO-1/2/3 and FSDP2 on one decoder, 2 ranks"
    )
    d = ModelParallelBench()
    for name in ("vocab", "hidden", "layers", "heads", "seq", "batch", "steps", "warmup", "microbatches"):
        parser.add_argument(
            f"--{name}", type=int, default=getattr(d, name), help=f"default {getattr(d, name)}"
        )
    parser.add_argument("--bubble-microbatches", type=int, nargs="+", default=list(d.bubble_microbatches))
    parser.add_argument("--t-forward", type=float, default=d.t_forward, help="seconds, sleep-timed stages")
    parser.add_argument("--t-backward", type=float, default=d.t_backward)
    parser.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 comparison (gloo)")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    bench = ModelParallelBench(
        vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq,
        batch=args.batch, steps=args.steps, warmup=args.warmup, microbatches=args.microbatches,
        bubble_microbatches=tuple(args.bubble_microbatches), t_forward=args.t_forward,
        t_backward=args.t_backward, fsdp2=not args.no_fsdp2,
    )  # fmt: skip
    run(bench, args.out)
