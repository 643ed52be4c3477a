"""Workers for lecture 01, section 4: a race condition and two fixes."""

import time


def count_unsafely(comm, counter, n):
    """Add 1 to counter[0], n times: read, add, write back. Not safe!"""
    comm.barrier()  # start together, so that the loops really overlap
    start = time.perf_counter()
    for _ in range(n):
        value = counter[0].item()  # 1. read
        counter[0] = value + 1  # 2. write back; another rank may have written in between
    return time.perf_counter() - start


def count_in_place(comm, counter, n):
    """The same with `+=`: one line of Python, still read-add-write inside torch."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        counter[0] += 1
    return time.perf_counter() - start


def count_with_lock(comm, counter, n, lock):
    """Fix 1: only one rank at a time may do the read-add-write."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        with lock:
            value = counter[0].item()
            counter[0] = value + 1
    return time.perf_counter() - start


def count_own_slot(comm, counters, n):
    """Fix 2: nothing is shared; each rank counts in its own slot, we add them up at the end."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        value = counters[comm.rank].item()
        counters[comm.rank] = value + 1
    return time.perf_counter() - start
