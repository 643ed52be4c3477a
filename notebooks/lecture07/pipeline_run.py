"""Lecture 07, section 4: one training step of a decoder cut into pipeline stages (rank r = stage r)."""

import torch

from minidist.models import decoder, stages
from minidist.parallel import pipeline as pp


def pipeline_step(comm, cfg, state, ids, microbatches, schedule="1f1b"):
    """Run this rank's stage of ``schedule`` ("gpipe" or "1f1b") on ``ids``; return what it measured.

    Every rank rebuilds the same dense model from ``state`` and keeps its own stage. After the
    step the two copies of the tied word table (first and last stage) add their gradients.
    Returns the loss (last stage), the peak number of microbatches held, and this stage's
    gradients under the dense model's parameter names.
    """
    p, rank = comm.world_size, comm.rank
    model = decoder.DecoderLM(cfg).double()
    model.load_state_dict(state)
    make = pp.gpipe if schedule == "gpipe" else pp.one_f_one_b
    mine = stages.split_decoder(model, p)[rank]
    out = pp.run_pipeline(
        mine,
        comm,
        make(p, microbatches)[rank],
        inputs=ids if rank == 0 else None,
        targets=ids if rank == p - 1 else None,
        loss_fn=stages.next_token_loss,
        dtype=torch.float64,
    )
    stages.sync_tied_gradients(mine, comm)
    grads = {mine.original_names[name]: param.grad.clone() for name, param in mine.named_parameters()}
    return {"loss": out.loss, "peak": out.peak_in_flight, "grads": grads}


def both_schedules(comm, cfg, state, ids, microbatches):
    """``pipeline_step`` under GPipe and under 1F1B, in one launch (a launch costs about a second)."""
    return {name: pipeline_step(comm, cfg, state, ids, microbatches, name) for name in ("gpipe", "1f1b")}
