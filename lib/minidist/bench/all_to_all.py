"""All-to-all benchmark: ours (pairwise exchange, every transport) vs torch.distributed gloo.

    python -m minidist.bench all_to_all --world-size 4 [--max-size 4MiB]

Also part of ``python -m minidist.bench collectives``: the same launches as the allreduce
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

``run`` also times the equal form over an emulated 10 Gbit/s link (``ETHERNET_10G``) and
prints it beside the cost model's (p-1)(alpha + beta S/p): measure, model, reconcile.
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from ._util import KIB, MIB, human_bytes, out_dir, print_table, save_json, size_range

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


def emulated_worker(comm: Communicator, sizes, repeats: int) -> dict[int, float]:
    """Seconds per equal all-to-all over an emulated 10 Gbit/s link wrapping ``comm``."""
    import minidist as md
    from minidist.transport.emulated import ETHERNET_10G, EmulatedLinkComm

    from .collectives import _time

    slow = EmulatedLinkComm(comm, *ETHERNET_10G)
    p = comm.world_size
    out = {}
    for size in sizes:
        t = torch.zeros(p, max(size // 4 // p, 1))
        out[size] = _time(lambda: md.all_to_all(slow, t), comm.barrier, 3, repeats)
    return out


def run(
    world_size: int = 2,
    max_size: int = 4 * MIB,
    transports=("shm", "pipe", "torch"),
    repeats: int = 3,
    out: str | None = None,
    scale: float = 1.0,
) -> dict:
    import minidist as md

    sizes = size_range(KIB, max_size)
    if "torch" not in transports:
        transports = (*transports, "torch")  # gloo's rows
    seconds: dict[str, dict[int, float]] = {}
    for transport in transports:
        print(f"measuring {transport} ...", flush=True)
        outs = md.launch(
            all_to_all_worker,
            world_size,
            args=(sizes, repeats, transport == "torch", scale),
            transport=transport,
            timeout=3000,
        )
        for name in outs[0]:
            key = name if name.startswith("gloo") else f"{name}/{transport}"
            seconds[key] = {s: max(o[name][s] for o in outs) for s in sizes}
    seconds = {k: seconds[k] for k in sorted(seconds, key=lambda k: (k.startswith("gloo"), k))}
    report(seconds, sizes, world_size)
    emulated_sizes = [s for s in (64 * KIB, MIB, 4 * MIB) if s <= max_size] or [max_size]
    outs = md.launch(
        emulated_worker, world_size, args=(emulated_sizes, repeats), transport="shm", timeout=600
    )
    emulated = reconcile(outs, world_size)
    save_json(
        out_dir(out),
        f"all_to_all_p{world_size}",
        {
            "world_size": world_size,
            "sizes": sizes,
            "seconds": {k: {str(s): v for s, v in d.items()} for k, d in seconds.items()},
            "emulated": {str(s): v for s, v in emulated.items()},
        },
    )
    return {"sizes": sizes, "seconds": seconds, "emulated": emulated}


def reconcile(outs: list[dict[int, float]], world_size: int) -> dict[int, dict[str, float]]:
    """The emulated link's times (``emulated_worker``, one dict per rank; the slowest rank
    counts) beside ``cost_model.predict("all_to_all", ...)`` for the same link; printed."""
    from ..collectives import cost_model
    from ..transport.emulated import ETHERNET_10G

    model = cost_model.AlphaBeta(alpha=ETHERNET_10G.alpha_s, beta=1 / ETHERNET_10G.bandwidth_Bps)
    emulated = {}
    for size in outs[0]:
        measured = max(o[size] for o in outs)
        predicted = cost_model.predict("all_to_all", world_size, size, model)
        emulated[size] = {"measured_s": measured, "predicted_s": predicted}
    print()
    print_table(
        ["size", "measured us", "predicted us", "measured / predicted"],
        [
            [
                human_bytes(s),
                v["measured_s"] * 1e6,
                v["predicted_s"] * 1e6,
                v["measured_s"] / v["predicted_s"],
            ]
            for s, v in emulated.items()
        ],
        title=f"equal all_to_all over an emulated 10 Gbit/s link (alpha 15 us), {world_size} ranks: "
        "measured vs the cost model's (p-1)(alpha + beta S/p)",
    )
    return emulated
