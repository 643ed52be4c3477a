"""Workers for lecture 01, section 1: what a worker process can change in its parent."""

import os

counter = 0  # a module-level global: every process has its own copy


def bump_counter(comm):
    """Add 1 to this process's copy of `counter`; return (value seen, value after)."""
    global counter
    seen = counter
    counter += 1
    return seen, counter


def write_rank(comm, shared, plain, array):
    """Write rank + 1 into slot `rank` of two tensors and a numpy array."""
    for container in (shared, plain, array):
        container[comm.rank] = comm.rank + 1


def leave_notes(comm, folder, conn):
    """Two ways to leave a message that the parent can read: a file and a pipe."""
    with open(os.path.join(folder, f"rank{comm.rank}.txt"), "w") as f:
        f.write(f"rank {comm.rank} was here")
    conn.send_bytes(f"rank {comm.rank} says hi".encode())
