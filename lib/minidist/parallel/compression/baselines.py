"""Two simple gradient compressors as DDP communication hooks: bf16 and 1-bit sign.

``bf16_allreduce`` -- cast the bucket to bfloat16, sum-allreduce *in bf16* (the
bytes on the wire are halved: 2 per entry instead of 4; the partial sums along
the ring are rounded to bf16 too), cast back, divide by N. Stateless.

``SignErrorFeedback`` -- EF-SignSGD (Karimireddy et al., 2019), per bucket::

    p     = grad + e                  e: the error kept from the last step
    scale = mean(|p|)                 one float32 per bucket
    sent  = scale * sign(p)           sign(0) = +1
    e     = p - sent                  error feedback: what the 1-bit message got wrong

    averaged = (sum over ranks of scale_r * sign(p_r)) / N

The message is 4 bytes of scale and one bit per entry (packed 8 to a byte), so
32x fewer bytes than float32; one allgather carries it (N-1 messages of
4 + ceil(n/8) bytes sent per rank on the ring). Use it with the optimizer's usual
momentum (the compressed average is a gradient estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...collectives import allgather, allreduce
from ...comm import Communicator, DerivedWork, Handle

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class CastBackWork(DerivedWork):
    """Handle of ``bf16_allreduce``: ``wait()`` copies the bf16 sum into the float bucket, / N."""

    def __init__(self, work: Handle, low: torch.Tensor, flat: torch.Tensor, world_size: int) -> None:
        super().__init__(work)
        self.low, self.flat, self.world_size = low, flat, world_size

    def finish(self, _result: torch.Tensor | None) -> torch.Tensor:
        return self.flat.copy_(self.low).div_(self.world_size)


def bf16_allreduce(
    comm: Communicator, flat_grad: torch.Tensor, bucket_index: int, algorithm: str = "auto"
) -> CastBackWork:
    """DDP comm hook: the average of every rank's ``flat_grad`` with the sum done in bfloat16.
    Bytes on the wire: half of the float32 allreduce (ring: 2(N-1)/N * n * 2)."""
    low = flat_grad.to(torch.bfloat16)
    work = allreduce(comm, low, op="sum", algorithm=algorithm, async_op=True)
    return CastBackWork(work, low, flat_grad, comm.world_size)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """One bit per entry (1: value >= 0), 8 to a uint8, the first entry in the highest bit."""
    bits = (values >= 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """+1.0 / -1.0 (float32) for each of the first ``numel`` bits of ``pack_signs``'s output."""
    bits = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)) != 0
    return bits.flatten()[:numel].to(torch.float32) * 2.0 - 1.0


def sign_compress(error: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One EF-sign step: updates ``error`` in place, returns the uint8 message [scale (4) | bits]."""
    corrected = grad + error
    scale = corrected.abs().mean().reshape(1).to(torch.float32)
    signs = torch.where(corrected >= 0, 1.0, -1.0).to(corrected.dtype)
    error.copy_(corrected - scale * signs)
    return torch.cat([scale.view(torch.uint8), pack_signs(corrected)])


def sign_decompress_sum(gathered: torch.Tensor, numel: int) -> torch.Tensor:
    """The sum over ranks (in rank order) of scale_r * sign_r; ``gathered`` is (N, 4 + ceil(n/8))."""
    total = torch.zeros(numel, dtype=torch.float32, device=gathered.device)
    for message in gathered:
        scale = message[:4].clone().view(torch.float32)  # rows of odd length: realign
        total.add_(unpack_signs(message[4:], numel) * scale)
    return total


class SignWork(DerivedWork):
    """Handle of a sign-compressed bucket: ``wait()`` = sum of scale_r * sign_r / N."""

    def __init__(self, work: Handle, numel: int, world_size: int) -> None:
        super().__init__(work)
        self.numel, self.world_size = numel, world_size

    def finish(self, gathered: torch.Tensor) -> torch.Tensor:
        return sign_decompress_sum(gathered, self.numel).div_(self.world_size)


@dataclass(eq=False)
class SignErrorFeedback:
    """EF-SignSGD comm hook; ``errors[bucket_index]`` is the error kept per bucket (float32)."""

    errors: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, comm: Communicator, flat_grad: torch.Tensor, bucket_index: int) -> SignWork:
        if flat_grad.dtype != torch.float32:
            raise TypeError(f"SignErrorFeedback expects float32 gradients, got {flat_grad.dtype}")
        error = self.errors.get(bucket_index)
        if error is None:
            error = self.errors[bucket_index] = torch.zeros_like(flat_grad)
        message = sign_compress(error, flat_grad)
        return SignWork(allgather(comm, message, async_op=True), flat_grad.numel(), comm.world_size)


__all__ = [
    "CastBackWork",
    "SignErrorFeedback",
    "SignWork",
    "bf16_allreduce",
    "pack_signs",
    "sign_compress",
    "sign_decompress_sum",
    "unpack_signs",
]
