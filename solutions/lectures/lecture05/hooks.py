"""Lecture 05, Try it: a DDP comm hook that sends bfloat16 gradients (half the bytes of float32)."""

import torch

import minidist as md


class Bf16Average:
    """The handle bf16_hook returns: wait() writes the bf16 sum / world size back into flat_grad."""

    def __init__(self, work, flat_grad, low, world_size):
        self.work, self.flat_grad, self.low, self.world_size = work, flat_grad, low, world_size

    def wait(self, timeout=None):
        # TRY IT: wait for the allreduce, copy its result into flat_grad, divide by the world size
        self.work.wait(timeout)
        self.flat_grad.copy_(self.low).div_(self.world_size)
        return self.flat_grad


def bf16_hook(comm, flat_grad, bucket_index):
    # TRY IT: start a sum-allreduce of flat_grad in bfloat16; return a Bf16Average
    low = flat_grad.to(torch.bfloat16)
    work = md.allreduce(comm, low, op="sum", async_op=True)
    return Bf16Average(work, flat_grad, low, comm.world_size)
