"""Seconds of one training step, a formula per parallelism (alpha-beta for every message).

Each function prices one kind of work on one device; ``layout.predict`` adds them up for a
layout. Notation: alpha (latency) and W (bandwidth, bytes/s one way) of the link a group uses,
e the bytes of one activation or gradient element, d the hidden size, n a token count.

    compute          FLOPs / (peak x mfu)
    allreduce (ring) 2 (p-1) alpha + 2 (p-1)/p x bytes / W        collectives.cost_model, "ring"
    allgather (ring) (p-1) alpha + (p-1)/p x bytes / W             (and reduce-scatter)
    TP               4 allreduces of n d e per layer per microbatch (2 forward, 2 backward)
    PP               1F1B over unequal stages: sum of slots + (m-1) x the slowest slot;
                     activations fill and drain the pipe: 2 (p-1) (alpha + n d e / W)
    DP               allreduce of the stage's gradients, hidden behind backward up to overlap
    ZeRO             1, 2: reduce-scatter + allgather = one allreduce's bytes; 3: one more allgather
    CP               ring K/V: 3 (c-1) messages of 2 n d e / c per layer, behind attention compute
    EP               4 all-to-alls per MoE layer (dispatch, combine; forward and backward)

Not modelled: kernels that wait on memory bandwidth, congestion, the network's switches.
"""

from __future__ import annotations

from collections.abc import Sequence

from minidist.collectives import cost_model
from minidist.transport.emulated import LinkSpec

__all__ = [
    "allgather_s",
    "allreduce_s",
    "compute_s",
    "context_parallel_s",
    "data_parallel_s",
    "expert_parallel_s",
    "exposed_s",
    "pipeline_s",
    "pipeline_p2p_s",
    "tensor_parallel_s",
]


def compute_s(flops: float, flops_per_s: float) -> float:
    """Seconds of arithmetic: ``flops / flops_per_s`` (flops_per_s = peak x mfu of one device)."""
    return flops / flops_per_s


def allreduce_s(nbytes: float, p: int, link: LinkSpec) -> float:
    """A ring allreduce of ``nbytes`` on ``p`` ranks: 2 (p-1) alpha + 2 (p-1)/p nbytes / W.

    The ring of ``collectives.cost_model.predict`` with no reduction term (gamma = 0: a GPU adds
    faster than a link delivers). 0 on one rank."""
    model = cost_model.AlphaBeta(alpha=link.alpha_s, beta=1.0 / link.bandwidth_Bps, gamma=0.0)
    return cost_model.predict("ring", p, nbytes, model)


def allgather_s(nbytes: float, p: int, link: LinkSpec) -> float:
    """A ring allgather (or reduce-scatter) of ``nbytes`` in all: (p-1) alpha + (p-1)/p nbytes / W.
    Half an allreduce."""
    if p == 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.bandwidth_Bps


def tensor_parallel_s(
    tokens: float, hidden: int, layers: int, tp: int, element_bytes: int, link: LinkSpec
) -> float:
    """Megatron TP on one microbatch: 4 allreduces of ``tokens x hidden x element_bytes`` a layer.

        layers x 4 x [2 (t-1) alpha + 2 (t-1)/t x n d e / W]

    Forward: g after attention and after the MLP; backward: f before each (``parallel.tensor``).
    Sequence parallelism swaps each for a reduce-scatter + allgather: the same bytes. Nothing
    hides them: the next matmul needs the sum. The embedding's and the loss's small collectives
    are left out."""
    return layers * 4 * allreduce_s(tokens * hidden * element_bytes, tp, link)


def pipeline_s(slots: Sequence[float], microbatches: int) -> float:
    """1F1B (or GPipe) over stages whose microbatch takes ``slots[s]`` (forward + backward):

        sum_s slots[s] + (m - 1) x max_s slots[s]

    The first microbatch crosses every stage (the sum), then the slowest stage sets the pace for
    the other m - 1. With p equal slots t: (m + p - 1) t, i.e. the bubble fraction
    (p-1)/(m+p-1) of ``pipeline.bubble_formula``."""
    return sum(slots) + (microbatches - 1) * max(slots)


def pipeline_p2p_s(tokens: float, hidden: int, pp: int, element_bytes: int, link: LinkSpec) -> float:
    """Activations between stages on the critical path: 2 (p-1) (alpha + n d e / W).

    The first microbatch's activations cross p-1 boundaries forward, the last one's gradients
    p-1 backward; the other sends travel while stages compute (``isend``)."""
    return 2 * (pp - 1) * (link.alpha_s + tokens * hidden * element_bytes / link.bandwidth_Bps)


def data_parallel_s(grad_bytes: float, group: int, link: LinkSpec, zero_stage: int = 0) -> float:
    """Synchronising gradients over the ``group`` ranks holding the same weights.

    zero 0       allreduce(G)                                2 (q-1) alpha + 2 (q-1)/q G / W
    zero 1, 2    reduce-scatter(G) + allgather(weights)      the same bytes
    zero 3       + an allgather of the weights for backward  1.5 x that (Rajbhandari et al.
                                                             2020, sec. 7: 3 Psi against 2 Psi)
    """
    t = allreduce_s(grad_bytes, group, link)
    return 1.5 * t if zero_stage == 3 else t


def exposed_s(communication: float, hidden_behind: float) -> float:
    """What overlap leaves on the critical path: max(0, communication - compute it can hide behind)."""
    return max(0.0, communication - hidden_behind)


def context_parallel_s(
    tokens: float, hidden: int, layers: int, cp: int, tp: int, element_bytes: int, link: LinkSpec
) -> float:
    """Ring attention on one microbatch, ``tokens`` = this rank's tokens (sequence / cp):

        layers x 3 (c-1) x [alpha + 2 n d e / (t W)]

    Each layer's forward passes its K and V blocks (2 n d e, split over t heads) c-1 times
    around the ring; backward passes them again with their gradients (2x). Ring attention
    overlaps each transfer with the attention on the block in hand: ``layout`` takes
    ``exposed_s(this, attention compute)``."""
    if cp == 1:
        return 0.0
    return (
        layers * 3 * (cp - 1) * (link.alpha_s + 2 * tokens * hidden * element_bytes / tp / link.bandwidth_Bps)
    )


def expert_parallel_s(
    tokens: float, hidden: int, moe_layers: int, ep: int, top_k: int, element_bytes: int, link: LinkSpec
) -> float:
    """Expert parallel on one microbatch: 4 all-to-alls per MoE layer (dispatch and combine,
    forward and backward), each sending (ep-1)/ep of the routed tokens' vectors:

        moe_layers x 4 x [(e-1) alpha + (e-1)/e x n k d e_b / W]

    (pairwise exchange: e-1 messages; n tokens, top_k copies each). Balanced routing assumed."""
    if ep == 1:
        return 0.0
    nbytes = tokens * top_k * hidden * element_bytes
    return moe_layers * 4 * ((ep - 1) * link.alpha_s + (ep - 1) / ep * nbytes / link.bandwidth_Bps)
