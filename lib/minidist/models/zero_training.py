"""ZeRO on a decoder: the training run that the ZeRO tests and the benchmark share.

(Lecture 08 writes its own loop out, in ``lecture08/zero_runs.py``, from the pieces here:
:func:`config`, :func:`make_model`, :func:`make_data`, :func:`my_rows`, :func:`reference`.)

``train_zero(comm, cfg)`` is the rank body: it builds a ``DecoderLM``, wraps it in
``parallel.zero.ZeroOptimizer`` (stages 1, 2) or ``parallel.zero.FullyShardedModule`` (stage 3)
and trains it with AdamW, measuring the bytes each rank sends and holds, the step time and the
peak resident memory. ``reference(cfg)`` is the same training in one process;
``compare_with_fsdp2`` runs ours and torch's FSDP2 (``fully_shard``) on the same model and data.

A run is a plain dict (:func:`config`) so that the single-process :func:`reference` and
every rank build the same model (same seed) and read the same data (rank r takes rows
``r*batch .. (r+1)*batch`` of each step's global batch)::

    cfg = config(stage=2, dtype="float64")
    outs = md.launch(train_zero, 2, args=(cfg,), transport="pipe", timeout=90)
    want = reference(cfg)                        # one process, the concatenated batch
    outs[0]["state"]  == want                    # to float64 rounding
    outs[0]["bytes_sent"] == zero.traffic_formula(2, outs[0]["padded_numel"], 2, 8)

It lives with the models because it builds one; the ZeRO algorithms themselves are in
``minidist.parallel.zero``, and ``python -m minidist.bench model_parallel`` measures and prints.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time

import torch

from minidist._proc import peak_rss_bytes, reset_peak_rss, rss_bytes
from minidist.measure import tensor_bytes
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.parallel import zero

from ..comm import Communicator

__all__ = [
    "compare_with_fsdp2",
    "config",
    "fixed_mmap_threshold",
    "fsdp2_model",
    "make_data",
    "make_model",
    "model_config",
    "my_rows",
    "reference",
    "train_fsdp2",
    "train_zero",
]


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
    * ``step_s``: median step seconds, the first (warm-up) step left out; ``step_times``: those steps';
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
        holding = {kind: tensor_bytes(ts) for kind, ts in held().items()}
        opt.zero_grad()
        if len(times) == 1:
            base = _start_peak()
    peak = peak_rss_bytes() - base
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
        "step_times": times[1:] or times,
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
    ``step_s``, ``step_times``, ``peak_rss_growth`` and ``loss`` measured as in :func:`train_zero`."""
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
    peak = peak_rss_bytes() - base
    state = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {
        "state": state,
        "step_s": statistics.median(times[1:] or times),
        "step_times": times[1:] or times,
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
    reset_peak_rss()
    return rss_bytes()


def compare_with_fsdp2(comm: Communicator, cfg: dict) -> dict:
    """Rank body: ours (stage 3) then FSDP2 in the same launch (``transport="torch"``), same
    model and data.

    Per rank: final full parameters of both (``ours``, ``fsdp2``), median step seconds (first
    step left out; ``ours_step_times``, ``fsdp2_step_times``: each step's) and the peak RSS
    growth over the steps after the first (``minidist.memory.peak_rss_bytes`` above the RSS
    after the warm-up step: what the step itself allocates, gathered weights and activations),
    plus ours' ``bytes_sent``/``held``."""
    ours = train_zero(comm, {**cfg, "stage": 3})
    gc.collect()
    theirs = train_fsdp2(comm, cfg)
    return {
        "ours": ours["state"],
        "fsdp2": theirs["state"],
        "ours_step_s": ours["step_s"],
        "fsdp2_step_s": theirs["step_s"],
        "ours_step_times": ours["step_times"],
        "fsdp2_step_times": theirs["step_times"],
        "ours_peak_rss_growth": ours["peak_rss_growth"],
        "fsdp2_peak_rss_growth": theirs["peak_rss_growth"],
        "ours_loss": ours["loss"],
        "fsdp2_loss": theirs["loss"],
        "ours_bytes_sent": ours["bytes_sent"],
        "ours_held": ours["held"],
        "padded_numel": ours["padded_numel"],
    }
