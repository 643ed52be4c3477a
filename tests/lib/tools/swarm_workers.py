"""Run in a separate interpreter by test_swarm.py: a swarm client that dies without cleaning up.

    python tests/lib/tools/swarm_workers.py CHECKPOINT_DIR PID_FILE

starts a swarm of two servers, writes their pids to PID_FILE and SIGKILLs itself (no ``finally``,
no ``__exit__``): the servers must notice on their own and exit.
"""

from __future__ import annotations

import os
import signal
import sys

from minidist.serve import swarm


def orphaned_swarm(directory: str, pid_file: str) -> None:
    with swarm.Swarm(directory, [(0, 2), (2, 4)], timeout=60.0) as sw:
        swarm.Client(sw).route()
        with open(pid_file + ".tmp", "w") as f:
            f.write(" ".join(str(pid) for pid in sw.pids()))
        os.replace(pid_file + ".tmp", pid_file)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    orphaned_swarm(sys.argv[1], sys.argv[2])
