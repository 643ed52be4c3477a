"""Workers for tests/test_zero.py (and the model-parallel bench): ZeRO 1/2/3 and FSDP2 on a tiny DecoderLM.

A run is a plain dict (``config``) so the single-process reference and the ranks build the same
model (same seed) and the same data (rank r takes rows r*batch .. (r+1)*batch of each step's batch).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from minidist import memory
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.parallel import zero


def config(**overrides) -> dict:
    base = dict(
        world_size=2, stage=1, steps=10, batch=2, seq=8, seed=0, lr=1e-2, weight_decay=0.1,
        vocab=64, hidden=32, layers=2, heads=2, device="cpu", prefetch=True, dtype="float32",
    )  # fmt: skip
    base.update(overrides)
    return base


def model_config(cfg: dict) -> TransformerConfig:
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
    torch.manual_seed(cfg["seed"])
    return DecoderLM(model_config(cfg)).to(cfg["device"], getattr(torch, cfg["dtype"]))


def make_data(cfg: dict) -> torch.Tensor:
    """(steps, world_size * batch, seq) token ids."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (cfg["steps"], cfg["world_size"] * cfg["batch"], cfg["seq"])
    return torch.randint(0, cfg["vocab"], shape, generator=g)


def _my_rows(ids: torch.Tensor, rank: int, cfg: dict) -> torch.Tensor:
    b = cfg["batch"]
    return ids[rank * b : (rank + 1) * b].to(cfg["device"])


def _adamw(params, cfg):
    return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])


def reference(cfg: dict) -> dict[str, torch.Tensor]:
    """One process, the concatenated batch, plain AdamW."""
    model = make_model(cfg)
    opt = _adamw(model.parameters(), cfg)
    for ids in make_data(cfg):
        ids = ids.to(cfg["device"])
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def train_zero(comm, cfg: dict) -> dict:
    """Stage 1, 2 (ZeroOptimizer) or 3 (FullyShardedModule + AdamW on the shards).

    Returns the final full parameters, the bytes this rank sent in the last step (stats reset
    before its forward), what it holds after the last step (before zero_grad) by kind, the
    padded parameter count, step times and, for stage 3, the peak number of gathered units."""
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
        mine = _my_rows(ids, comm.rank, cfg)
        comm.reset_stats()
        t0 = time.perf_counter()
        runner(mine, labels=mine).loss.backward()
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
    }


def train_fsdp2(comm, cfg: dict) -> dict:
    """torch's FSDP2 (``fully_shard``) on the same model and data; needs transport="torch".

    Each block and the final norm are their own group; the root group holds the embeddings
    (the word table is tied to the output, which the root's forward uses)."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(cfg)
    for block in model.transformer.blocks:
        fully_shard(block)
    fully_shard(model.transformer.final_norm)
    fully_shard(model)
    opt = _adamw(model.parameters(), cfg)
    times = []
    for ids in make_data(cfg):
        mine = _my_rows(ids, comm.rank, cfg)
        t0 = time.perf_counter()
        model(mine, labels=mine).loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
        if len(times) == 1:
            base = _start_peak()
    peak = memory.peak_rss_bytes() - base
    state = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {"state": state, "step_s": statistics.median(times[1:] or times), "peak_rss_growth": peak}


def _start_peak() -> int:
    """After the warm-up step: the RSS now, and the peak reset to it (``minidist.memory``)."""
    gc.collect()
    memory.reset_peak_rss()
    return memory.rss_bytes()


def compare_with_fsdp2(comm, cfg: dict) -> dict:
    """Ours (stage 3) then FSDP2 in the same launch (transport="torch"), same model and data.

    Per rank: final full parameters, median step seconds (first step left out) and the peak RSS
    growth over the steps after the first (``minidist.memory.peak_rss_bytes`` above the RSS
    after the warm-up step: what the step itself allocates, gathered weights and activations)."""
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
    }


def mismatched_shapes(comm, cfg: dict) -> None:
    """Rank 1 builds a wider model: construction must fail on every rank with a clear error."""
    wider = {**cfg, "hidden": cfg["hidden"] * 2} if comm.rank == 1 else cfg
    model = make_model(wider)
    if cfg["stage"] == 3:
        zero.FullyShardedModule(model, comm)
    else:
        zero.ZeroOptimizer(model.parameters(), comm, stage=cfg["stage"], lr=1e-3)


def crash_in_step(comm, cfg: dict) -> None:
    """Rank 1 dies before its first backward; rank 0 waits in a collective until the launch timeout."""
    model = make_model(cfg)
    sharded = zero.FullyShardedModule(model, comm)
    ids = _my_rows(make_data(cfg)[0], comm.rank, cfg)
    if comm.rank == 1:
        raise RuntimeError("rank 1 crashed on purpose")
    sharded(ids, labels=ids).loss.backward()
