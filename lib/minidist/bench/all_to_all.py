"""All-to-all benchmark: ours (pairwise exchange, every transport) vs torch.distributed gloo.

Part of ``python -m minidist.bench collectives``: the same launches as the allreduce
rows measure these, on the same sizes (S = the bytes each rank sends *and keeps*,
its whole input). What gloo offers for all-to-all (torch 2.13):

* ``dist.all_to_all_single(out, t)``: equal splits -- our equal form's baseline;
* ``dist.all_to_all_single(out, t, output_split_sizes, input_split_sizes)``: uneven
  splits, but both sides must pass the sizes (gloo does not exchange them) -- the
  baseline of our list form with ``recv_sizes=``;
* ``dist.all_to_all(outs, ins)`` with lists works only when every tensor has the same
  size (uneven ones raise "ProcessGroupGloo::alltoall: invalid tensor size"), so it
  adds nothing to ``all_to_all_single`` and is not measured.

Rows (float32; "x gloo" = gloo's time / ours, against the gloo row of the same form):

    equal/<transport>    md.all_to_all(comm, t), t of shape (p, S/4p)     vs gloo equal
    split/<transport>    md.all_to_all(comm, pieces, recv_sizes=...)      vs gloo split
    counts/<transport>   the same pieces without recv_sizes: one exchange of counts first
                         (p-1 more messages of 8 bytes) -- what MoE dispatch pays

Uneven pieces: rank r sends rank j a share proportional to 1 + (r+j) mod p of its S bytes.
busbw = algbw (p-1)/p (nccl-tests' all-to-all convention: the own piece does not move).
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from ._util import human_bytes, print_table

FORMS = ("equal", "split", "counts")


def split_numels(numel: int, p: int, sender: int) -> list[int]:
    """How many float32 elements ``sender`` sends to each rank (uneven; the same total on every rank)."""
    weights = [1 + (sender + j) % p for j in range(p)]
    return [numel * w // sum(weights) for w in weights]


def all_to_all_worker(comm: Communicator, sizes, repeats: int, with_gloo: bool, scale: float) -> dict:
    """Seconds per all-to-all for each form and size (this rank's view); with ``with_gloo``
    (the torch transport) also gloo's ``all_to_all_single``, equal and uneven."""
    import minidist as md

    from .collectives import _time, iterations_for

    p, rank = comm.world_size, comm.rank
    names = [*FORMS, *(["gloo equal", "gloo split"] if with_gloo else [])]
    out: dict[str, dict[int, float]] = {name: {} for name in names}
    for size in sizes:
        numel = max(size // 4 // p, 1) * p
        iterations = iterations_for(size, scale)
        t = torch.zeros(p, numel // p)
        send = split_numels(numel, p, rank)
        recv = [split_numels(numel, p, i)[rank] for i in range(p)]
        pieces = [torch.zeros(n) for n in send]
        runs = {
            "equal": lambda: md.all_to_all(comm, t),
            "split": lambda: md.all_to_all(comm, pieces, recv_sizes=recv),
            "counts": lambda: md.all_to_all(comm, pieces),
        }
        if with_gloo:
            import torch.distributed as dist

            flat, flat_out = t.view(-1), torch.empty(numel)
            joined, joined_out = torch.zeros(sum(send)), torch.empty(sum(recv))
            runs["gloo equal"] = lambda: dist.all_to_all_single(flat_out, flat)
            runs["gloo split"] = lambda: dist.all_to_all_single(
                joined_out, joined, output_split_sizes=recv, input_split_sizes=send
            )
        for name in names:
            barrier = torch.distributed.barrier if name.startswith("gloo") else comm.barrier
            out[name][size] = _time(runs[name], barrier, iterations, repeats)
    return out


def report(seconds: dict[str, dict[int, float]], sizes, world_size: int) -> list[list]:
    """Print the table (ours per form and transport, then gloo's) and return its rows."""
    factor = (world_size - 1) / world_size
    rows = []
    for name, per_size in seconds.items():
        form = name.split("/")[0]
        gloo = seconds["gloo split" if form in ("split", "counts", "gloo split") else "gloo equal"]
        for size in sizes:
            t = per_size[size]
            algbw = size / t / 1e9
            rows.append([name, human_bytes(size), t * 1e6, algbw, algbw * factor, gloo[size] / t])
    print()
    print_table(
        ["form/transport", "size", "time us", "algbw GB/s", "busbw GB/s", "x gloo"],
        rows,
        title=f"all_to_all of float32, {world_size} ranks, S bytes per rank (busbw = algbw (p-1)/p; "
        "x gloo = gloo all_to_all_single time / ours, same form; gloo: all_to_all_single equal and "
        "with split sizes; its list all_to_all needs equal sizes)",
    )
    return rows
