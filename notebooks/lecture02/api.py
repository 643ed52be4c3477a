"""Workers for lecture 02, section 1: every collective once, on tiny tensors."""

import torch

import minidist as md


def tour(comm):
    """Call each collective of minidist once; return what this rank ends up with."""
    r, p = comm.rank, comm.world_size
    out = {}

    grad = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)  # rank r's "gradient"
    out["allreduce sum"] = md.allreduce(comm, grad.clone(), op="sum")
    out["allreduce avg"] = md.allreduce(comm, grad.clone(), op="avg")
    out["allreduce max"] = md.allreduce(comm, torch.tensor([float(r)]), op="max")

    weights = torch.tensor([0.5, -0.5]) if r == 0 else torch.zeros(2)
    out["broadcast from 0"] = md.broadcast(comm, weights, src=0)  # everyone gets rank 0's

    out["reduce to 0"] = md.reduce(comm, grad.clone(), dst=0)  # only rank 0 gets the sum

    out["allgather"] = md.allgather(comm, torch.tensor([r, 10 * r]))  # shape (p, 2)

    rows = torch.arange(p, dtype=torch.float32).repeat_interleave(2).view(p, 2) + r
    out["reduce_scatter"] = md.reduce_scatter(comm, rows)  # row `r` of the sum, shape (1, 2)

    md.barrier(comm)  # nobody leaves before everyone has arrived
    return out
