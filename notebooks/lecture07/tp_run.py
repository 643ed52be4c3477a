"""Lecture 07, section 3: one training step of a decoder split over the ranks by tensor parallelism."""

import torch

from minidist.models import decoder
from minidist.models.tp_decoder import TensorParallelDecoderLM
from minidist.parallel import tensor as tp


def tp_step(comm, cfg, state, ids):
    """Forward + backward of the TP copy of the dense model ``state`` on ``ids`` (labels = ids).

    Returns the loss, the full logits (gathered after counting), the collectives counted
    forward and backward, and this rank's gradient of every parameter by its dense name
    (a shard for the split matrices, the whole gradient for the replicated ones).
    """
    dense = decoder.DecoderLM(cfg)
    dense.load_state_dict(state)
    model = TensorParallelDecoderLM.from_dense(dense, comm)
    out = model(ids, labels=ids)
    out.loss.backward()
    counts = tp.count_collectives(comm)  # before gather_logits, which is one more allgather
    logits = model.gather_logits(out.logits.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"loss": out.loss.item(), "logits": logits, "counts": counts, "grads": grads}


def collective_counts(comm, cfgs, ids):
    """The collectives of one forward + backward of a TP decoder for each config (fresh weights)."""
    counts = []
    for cfg in cfgs:
        torch.manual_seed(0)
        model = TensorParallelDecoderLM.from_dense(decoder.DecoderLM(cfg), comm)
        tp.reset_collective_counts(comm)
        model(ids, labels=ids).loss.backward()
        counts.append(tp.count_collectives(comm))
    return counts
