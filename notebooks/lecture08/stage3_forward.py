"""Lecture 08, Try it 3: stage 3's forward written by hand, and the rank body that checks it."""

import time
import weakref

import torch

import minidist as md
from minidist.clock import wait
from minidist.transport.emulated import EmulatedLinkComm


def gathered_forward(comm: md.Communicator, shards: list, x: torch.Tensor, layer, prefetch: bool = False):
    """Stage 3's forward through layers whose weights are sharded: ``x`` after the last layer.

    ``shards[i]``: this rank's 1/N of layer i's flattened weight. For each layer: allgather its
    whole weight (flat), ``x = layer(i, x, weight)``, drop the weight (one at a time). With
    ``prefetch``, layer i + 1's allgather is issued before layer i runs (two at a time).
    """
    # md.allgather(comm, t) -> (N, *t.shape); with async_op=True it returns at once, .wait() gives it
    raise NotImplementedError("TODO(Try it 3): gather, run, drop; with prefetch, issue the next gather first")


def check_gathered_forward(comm, forward, layers, width, t_layer, alpha_s, bandwidth_Bps) -> dict:
    """Rank body of the check: ``forward`` (your ``gathered_forward``) over ``layers`` layers of
    width x width weights, each computing for ``t_layer`` s (emulated), over an emulated link,
    without and with prefetch (each run twice, the second kept). Returns the unsharded output and,
    per setting, the output, the seconds, what was sent, and the most earlier weights alive at once."""
    link = EmulatedLinkComm(comm, alpha_s, bandwidth_Bps)
    g = torch.Generator().manual_seed(0)  # the same weights and input on every rank
    weights = [torch.randn(width * width, generator=g) / width**0.5 for _ in range(layers)]
    x = torch.randn(4, width, generator=g)
    k = width * width // comm.world_size
    shards = [w[comm.rank * k : (comm.rank + 1) * k].clone() for w in weights]
    runs = {}
    for prefetch in (False, True, False, True):
        alive, most_alive = [], [0]

        def layer(i, h, weight, alive=alive, most_alive=most_alive):
            most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(weight))
            wait(t_layer)  # the layer's compute, emulated
            return torch.tanh(h @ weight.view(width, width).T)

        link.barrier()
        link.reset_stats()
        start = time.perf_counter()
        y = forward(link, shards, x, layer, prefetch)
        seconds = time.perf_counter() - start
        stats = link.stats.copy()
        runs[prefetch] = {"output": y, "seconds": seconds, "most_alive": most_alive[0], "sent": stats}
    link.close()
    dense = x
    for w in weights:
        dense = torch.tanh(dense @ w.view(width, width).T)
    return {"dense": dense, "runs": runs}
