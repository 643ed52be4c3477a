"""Workers for lecture 04, section 5: independent single-process trainers, side by side."""

from minidist import glove


def train_alone(comm, pairs, config):
    """Train a table of my own with the single-process trainer; return my pairs per second.

    The ranks share nothing but the read-only pairs: with 2 ranks on 2 cores this measures
    what the cores can do at the same time when they never touch each other's rows.
    """
    comm.barrier()  # start together
    return glove.train_single(pairs, config).pairs_per_second
