"""Worker functions for tests/lib/parallel/test_pipeline.py (importable by md.launch workers).

Every rank builds the same tiny DecoderLM from the same seed (float64, so one process and the
pipeline agree to ~1e-12), keeps its stage, runs one pipeline step and returns its gradients
under the DecoderLM's parameter names.
"""

from __future__ import annotations

import torch

from minidist.models import decoder, stages
from minidist.parallel import pipeline as pp

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 4, 32, 2, 37, 8


def tiny_model(seed: int = 0) -> decoder.DecoderLM:
    cfg = decoder._decoder(LAYERS, HIDDEN, HEADS, vocab=VOCAB, positions=16)
    torch.manual_seed(seed)
    return decoder.DecoderLM(cfg).double()


def batch(size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(seed))


def reference(batch_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, whole batch: the loss and every parameter's gradient."""
    model = tiny_model()
    ids = batch(batch_size)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def schedule_of(name: str, p: int, m: int, chunks: int = 1):
    if name == "gpipe":
        return pp.gpipe(p, m)
    if name == "1f1b":
        return pp.one_f_one_b(p, m)
    return pp.interleaved_one_f_one_b(p, m, chunks)


def pipeline_step(comm, name: str, m: int, batch_size: int, chunks: int = 1) -> dict:
    """One step of schedule ``name`` from fresh weights: loss, gradients by name, peak, action times."""
    p, r = comm.world_size, comm.rank
    schedule = schedule_of(name, p, m, chunks)
    mine = stages.split_decoder(tiny_model(), p, chunks)[r]
    ids = batch(batch_size)
    out = pp.run_pipeline(
        mine,
        comm,
        schedule[r],
        inputs=ids if r == 0 else None,
        targets=ids if r == p - 1 else None,
        loss_fn=stages.next_token_loss,
        dtype=torch.float64,
    )
    stages.sync_tied_gradients(mine, comm)
    grads = {}
    for module in mine if chunks > 1 else [mine]:
        for local, param in module.named_parameters():
            grads[module.original_names[local]] = param.grad.clone()
    return {
        "loss": out.loss,
        "grads": grads,
        "peak": out.peak_in_flight,
        "actions": [(a, s + out.origin_s, e + out.origin_s) for a, s, e in out.actions],
    }


def pipeline_steps(comm, names: list[str], m: int, batch_size: int, chunks: int = 1) -> dict:
    """``pipeline_step`` for each schedule name in one launch (launches are the slow part of a test)."""
    return {name: pipeline_step(comm, name, m, batch_size, chunks) for name in names}


class _Crash(torch.nn.Module):
    def forward(self, x):
        raise RuntimeError("stage 1 crashed on purpose")


def crashing_stage(comm) -> None:
    """Rank 1's stage raises in its first forward; rank 0 then waits for a gradient that never comes."""
    module = _Crash() if comm.rank == 1 else torch.nn.Linear(4, 4)
    pp.run_pipeline(
        module,
        comm,
        pp.gpipe(2, 2)[comm.rank],
        inputs=torch.zeros(2, 4),
        targets=torch.zeros(2, 4),
        loss_fn=lambda y, t: ((y - t) ** 2).mean(),
    )


def deadlocked(comm) -> None:
    """Stage 0 waits for B0 before sending F1, stage 1 does F1 before B0 -- each waits on the other."""
    schedule = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]]
    module = torch.nn.Linear(4, 4)
    pp.run_pipeline(
        module,
        comm,
        schedule[comm.rank],
        inputs=torch.zeros(2, 4),
        targets=torch.zeros(2, 4),
        loss_fn=lambda y, t: ((y - t) ** 2).mean(),
    )
