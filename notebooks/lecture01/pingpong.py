"""Workers for lecture 01, section 3: how long does a message take?"""

import time

import torch


def ping_pong(comm, sizes, repeats):
    """Rank 0 sends n bytes to rank 1, which sends them straight back.

    Returns, on rank 0, the best one-way time (half the fastest round trip) in
    seconds for each size in `sizes`; `repeats[i]` round trips are timed for size i.
    """
    assert comm.world_size == 2, "ping-pong needs exactly 2 ranks"
    peer = 1 - comm.rank
    one_way = []
    for n, reps in zip(sizes, repeats, strict=True):
        buf = torch.zeros(n, dtype=torch.uint8)
        samples = []
        for _ in range(2 + reps):  # 2 untimed warm-up round trips (first touch of memory)
            start = time.perf_counter()
            if comm.rank == 0:
                comm.send(buf, peer)
                comm.recv(buf, peer)
            else:
                comm.recv(buf, peer)
                comm.send(buf, peer)
            samples.append((time.perf_counter() - start) / 2)
        one_way.append(min(samples[2:]))  # noise only ever adds time
    return one_way if comm.rank == 0 else None
