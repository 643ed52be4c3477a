"""Local SGD and DiLoCo: train over a slow network by talking once every H steps.

Data parallel (DDP) averages gradients after every step: on a 1 Gbit/s link a 1.5M-parameter
model's 6 MB allreduce takes ~50 ms at p = 2, a GPU's step on it far less. Local SGD lets each worker
take H steps alone and then averages the *parameters*; DiLoCo (Douillard et al. 2023) turns
that average into a pseudo-gradient for an outer optimizer with Nesterov momentum, which is
what lets H reach hundreds of steps (paper: H = 500, outer lr 0.7, momentum 0.9, AdamW inner,
8 workers matching synchronous training with 500x less communication).

    from minidist.parallel import local_sgd
    trainer = local_sgd.DiLoCo(model, comm, inner_optimizer, inner_steps=H, outer_lr=0.7,
                               outer_momentum=0.9, fragments=1, quantize=None)
    loss = trainer.step(loss_fn, batch)         # loss_fn(model, batch) -> scalar tensor

One idea per module:

    outer      the outer step: pseudo-gradient, Nesterov formula, the special cases
               (lr 1 and mu 0: local SGD; + H = 1 and SGD inner: DDP)
    schedule   Streaming DiLoCo's fragments, their staggered schedule and an ASCII timeline
    payload    averaging the pseudo-gradients: fp32 ring allreduce, or int8 / nf4 payloads
               allgathered and dequantized (bytes: ``sync_bytes``, exact)
    diloco     ``DiLoCo`` (and Streaming: ``fragments``, ``delay``, ``mix``) and ``LocalSGD``
    timing     time to a target loss on the emulated clock: 6 N T compute a step, syncs, and
               Streaming's overlap (``step_compute_s``, ``time_to_target``)

``python -m minidist.bench diloco`` measures held-out loss against DDP at equal tokens and the
time to a target loss over emulated 1 Gbit/s and 100 Mbit/s links.
"""

from .diloco import DiLoCo, LocalSGD
from .outer import nesterov_outer_step_
from .payload import BLOCK, QUANTIZE, average_async, payload_bytes, sync_bytes
from .schedule import fragment_bounds, fragment_offsets, fragments_due, timeline
from .timing import step_compute_s, steps_to_target, time_to_target

__all__ = [
    "BLOCK",
    "QUANTIZE",
    "DiLoCo",
    "LocalSGD",
    "average_async",
    "fragment_bounds",
    "fragment_offsets",
    "fragments_due",
    "nesterov_outer_step_",
    "payload_bytes",
    "step_compute_s",
    "steps_to_target",
    "sync_bytes",
    "time_to_target",
    "timeline",
]
