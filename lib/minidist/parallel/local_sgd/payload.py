"""Averaging the pseudo-gradients: full precision (one allreduce) or quantized (one allgather).

``average_async(comm, delta, quantize)`` starts the exchange and returns a ``PendingAverage``
whose ``wait()`` gives (1/p) sum_i delta_i (quantized: of the dequantized deltas) -- the same
tensor, bit for bit, on every rank.

* ``quantize=None``: ``md.allreduce(op="avg", algorithm="ring", async_op=True)`` of the fp32
  delta. A rank sends 2(p-1)/p x 4n bytes (``cost_model.bytes_sent``, exact).
* ``"int8"``: absmax int8 (``minidist.quant.quantize_absmax_int8``) in blocks of ``BLOCK``
  values, one fp32 scale each: B ceil(n/B) + 4 ceil(n/B) bytes of payload (the last block padded).
* ``"nf4"`` (4 bits): ``minidist.quant.quantize_nf4`` (NormalFloat codes, two a byte, one fp32
  absmax a block, no double quantization): B/2 ceil(n/B) + 4 ceil(n/B) bytes. (Streaming DiLoCo sends
  4-bit floats, E3M0; NF4 is the 4-bit format this library has.)

Why not allreduce the codes? A sum of int8 codes with different scales means nothing, and a
ring allreduce adds partial sums at every hop, which would have to be re-quantized each time
(error compounding over p-1 hops). So every rank **allgathers** the payloads (codes and scales,
two ring allgathers), dequantizes the p rows and averages them itself, in rank order (so every
rank gets the same bits). A rank sends (p-1) x payload bytes: less than the fp32 ring's
2(p-1)/p x 4n while p < 8 (int8) or p < 16 (nf4), ignoring scales -- an allgather grows with p,
an allreduce does not. Each worker's own delta enters the average dequantized too.
"""

from __future__ import annotations

import math

import torch

from minidist.collectives import allgather, allreduce, cost_model
from minidist.comm import Communicator
from minidist.quant import (
    NF4Tensor,
    dequantize_absmax_int8,
    dequantize_nf4,
    quantize_absmax_int8,
    quantize_nf4,
)

__all__ = ["BLOCK", "QUANTIZE", "PendingAverage", "average_async", "payload_bytes", "sync_bytes"]

BLOCK = 64  #: values per scale, int8 and nf4 alike
QUANTIZE = (None, "int8", "nf4")


def payload_bytes(numel: int, quantize: str | None) -> int:
    """Bytes one rank contributes for a delta of ``numel`` values: 4n (fp32), B ceil(n/B) + 4 ceil(n/B)
    (int8), or B/2 ceil(n/B) + 4 ceil(n/B) (nf4): both pad the last block to B values."""
    blocks = math.ceil(numel / BLOCK)
    if quantize is None:
        return 4 * numel
    if quantize == "int8":
        return blocks * BLOCK + 4 * blocks  # the padding of the last block travels too
    if quantize == "nf4":
        return blocks * BLOCK // 2 + 4 * blocks
    raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")


def sync_bytes(numel: int, p: int, rank: int, quantize: str | None) -> int:
    """Bytes rank ``rank`` sends to average a delta of ``numel`` fp32 values over ``p`` ranks."""
    if quantize is None:
        return cost_model.bytes_sent("ring", p, rank, numel, 4)
    return (p - 1) * payload_bytes(numel, quantize)


class PendingAverage:
    """An exchange in flight; ``wait()`` returns the averaged delta (fp32, the input's shape)."""

    def __init__(self, works: list, finish) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> torch.Tensor:
        return self._finish(*[w.wait() for w in self._works])


def _padded_blocks(delta: torch.Tensor) -> torch.Tensor:
    flat = delta.reshape(-1).float()
    extra = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, extra)).view(-1, BLOCK)


def average_async(comm: Communicator, delta: torch.Tensor, quantize: str | None = None) -> PendingAverage:
    """Start averaging ``delta`` (a flat fp32 tensor, not modified) over the ranks; see the module."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE} (None sends fp32), got {quantize!r}")
    n, p = delta.numel(), comm.world_size
    if quantize is None:
        work = allreduce(comm, delta.clone(), op="avg", algorithm="ring", async_op=True)
        return PendingAverage([work], lambda averaged: averaged)
    if quantize == "int8":
        codes, scales = quantize_absmax_int8(_padded_blocks(delta))  # (blocks, B) int8, (blocks, 1)
        works = [allgather(comm, codes, async_op=True), allgather(comm, scales, async_op=True)]

        def finish(all_codes: torch.Tensor, all_scales: torch.Tensor) -> torch.Tensor:
            total = torch.zeros_like(_padded_blocks(delta))
            for r in range(p):  # rank order: every rank adds the same numbers in the same order
                total += dequantize_absmax_int8(all_codes[r], all_scales[r])
            return (total / p).reshape(-1)[:n]

        return PendingAverage(works, finish)
    q = quantize_nf4(delta.reshape(-1).float(), block=BLOCK, double_quant=False)
    works = [allgather(comm, q.packed, async_op=True), allgather(comm, q.absmax, async_op=True)]

    def finish_nf4(all_packed: torch.Tensor, all_absmax: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(n, device=delta.device)
        for r in range(p):
            row = NF4Tensor(packed=all_packed[r], shape=q.shape, block=BLOCK, dtype=torch.float32)
            row.absmax = all_absmax[r]
            total += dequantize_nf4(row)
        return total / p

    return PendingAverage(works, finish_nf4)
