"""Lecture 02, section 7: the workers of section 1 as a script that runs anywhere.

Run it as a module from notebooks/ (so that `lecture02` is importable):

python -m lecture02.job                         # one machine: md.launch starts 4 ranks
torchrun --nproc-per-node 4 -m lecture02.job    # torchrun starts 4 ranks, md.launch joins them
"""

import os

import minidist as md
from lecture02.api import tour

if __name__ == "__main__":
    under_torchrun = "WORLD_SIZE" in os.environ  # torchrun sets it (and RANK, MASTER_ADDR, ...)
    outs = md.launch(tour, world_size=None if under_torchrun else 4, transport="torch")
    if int(os.environ.get("RANK", 0)) == 0:  # every rank got every rank's results; one prints
        for name, value in outs[-1].items():
            print(f"rank {len(outs) - 1} {name}: {value.tolist()}")
