"""Workers for lecture 01, section 2: who am I?"""

import os


def whoami(comm):
    print(f"hello from rank {comm.rank} of {comm.world_size}")  # shows up in the notebook
    return comm.rank, comm.world_size, comm.local_rank, os.getpid()


def nothing(comm):
    """Do no work at all: timing this measures the cost of starting processes."""
    return comm.rank
