"""Lecture 6's compression experiment: BERT MLM on 2 ranks, once per row of the ablation.

``compare_hooks(cfg)`` trains the same BERT (``cfg.model``, real MLM batches of the
course text, the same batches for every row) for ``cfg.steps`` steps through our
``DistributedDataParallel`` over the emulated 10 Gbit/s link (shm underneath, so
every byte goes through point-to-point messages and is counted), once per row of
``minidist.parallel.compression.ablation`` (dense, DGC, DGC with one component removed,
bf16, sign EF: which hook, and which optimizer goes with it, is decided there, in
``RowTrainer``).

Per row: the mean training loss of the last ``loss_window`` steps (both ranks' losses),
relative to dense; bytes sent per rank per step after the warm-up (measured with
``comm.stats``) and the formula; the compression ratio dense bytes / row bytes; the median
step time over the emulated link and, in two short runs with the compressors at their final
sparsity, on shm and over a slower emulated link (``slow_link_gbps``, 1 Gbit/s: the paper's
case); and the time spent in the hook per step (``TimedHook``: compression, communication
and decompression -- the part of the step that differs between rows). The tables and the
command line are ``minidist.bench.compression``.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import asdict

import torch

from minidist import data
from minidist.comm import Communicator
from minidist.models import bert
from minidist.parallel.compression.ablation import ROWS, CompressionBench, RowTrainer, formula_bytes
from minidist.transport.emulated import ETHERNET_10G, EmulatedLinkComm

GBIT = 1.25e8  # bytes per second of 1 Gbit/s


def _batches(cfg: CompressionBench, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of shape [steps, p * batch, seq]: real MLM batches, fixed seed."""
    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, seq_len=128, split="train")[:, : cfg.seq]
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = steps * cfg.world_size * cfg.batch
    chosen = blocks[torch.randint(len(blocks), (rows,), generator=gen)]
    masked = data.mask_tokens(chosen, tok, gen)
    shape = (steps, cfg.world_size * cfg.batch, cfg.seq)
    return masked.input_ids.view(shape), masked.labels.view(shape)


def _worker(
    comm: Communicator, cfg: CompressionBench, rows, steps: int, link_Bps: float, final: bool
) -> dict:
    """Train every row for ``steps`` steps, in turn, on this rank (over an emulated link of
    ``link_Bps`` bytes/s with Ethernet's latency; 0: straight on shm)."""
    if link_Bps:
        comm = EmulatedLinkComm(comm, ETHERNET_10G.alpha_s, link_Bps)
    make_bert = functools.partial(bert.BertForMLM, bert.CONFIGS[cfg.model])
    trainers = [RowTrainer(comm, cfg, row, final, make_bert) for row in rows]
    ids, labels = _batches(cfg, steps)
    mine = slice(comm.rank * cfg.batch, (comm.rank + 1) * cfg.batch)
    comm.barrier()
    for step in range(steps):
        for trainer in trainers:
            trainer.step(step, ids[step, mine], labels[step, mine])
    return {row.label: trainer.result() for row, trainer in zip(rows, trainers)}


def _launch(cfg: CompressionBench, rows, steps: int, link_Bps: float, final: bool) -> dict:
    import minidist as md

    outs = md.launch(
        _worker,
        cfg.world_size,
        args=(cfg, rows, steps, link_Bps, final),
        transport="shm",
        threads_per_worker=1,
        timeout=120 + 10 * len(rows) * steps,
    )
    merged = {}
    for row in rows:
        per_rank = [out[row.label] for out in outs]
        merged[row.label] = {
            **per_rank[0],
            "losses": [statistics.mean(values) for values in zip(*(r["losses"] for r in per_rank))],
            "step_s": max(r["step_s"] for r in per_rank),
            "bytes_per_step": statistics.mean(r["bytes_per_step"] for r in per_rank),
        }
    return merged


def compare_hooks(
    cfg: CompressionBench = CompressionBench(),  # noqa: B008 (frozen: one shared default is safe)
    rows=ROWS,
    timing: bool = True,
) -> dict:
    """Train every row (emulated 10G link) and, if ``timing``, time each on shm. See the module doc."""
    trained = _launch(cfg, rows, cfg.steps, GBIT * 10, final=False)
    shm = _launch(cfg, rows, cfg.timing_steps, 0.0, final=True) if timing else {}
    slow = {}
    if timing and cfg.slow_link_gbps:
        slow = _launch(cfg, rows, cfg.timing_steps, GBIT * cfg.slow_link_gbps, final=True)
    dense = trained[rows[0].label]
    dense_loss = statistics.mean(dense["losses"][-cfg.loss_window :])
    results = []
    for row in rows:
        r = trained[row.label]
        loss = statistics.mean(r["losses"][-cfg.loss_window :])
        results.append(
            {
                "label": row.label,
                "loss": loss,
                "loss_vs_dense": loss / dense_loss - 1.0,
                "bytes_per_step": r["bytes_per_step"],
                "formula_bytes": formula_bytes(cfg, row, r["numel"]),
                "ratio": dense["bytes_per_step"] / r["bytes_per_step"],
                "step_s_10g": r["step_s"],
                "step_s_shm": shm[row.label]["step_s"] if timing else math.nan,
                "hook_s_10g": r["hook_s"],
                "hook_s_shm": shm[row.label]["hook_s"] if timing else math.nan,
                "step_s_slow": slow[row.label]["step_s"] if slow else math.nan,
                "hook_s_slow": slow[row.label]["hook_s"] if slow else math.nan,
                "losses": r["losses"],
            }
        )
    return {"config": asdict(cfg), "numel": dense["numel"], "rows": results}


__all__ = ["GBIT", "ROWS", "CompressionBench", "compare_hooks"]  # ROWS, CompressionBench: from ablation
