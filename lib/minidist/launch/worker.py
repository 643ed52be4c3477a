"""The worker side of ``launch``: what each started process does before and around ``fn``.

It puts itself in its own process group and asks the kernel to kill it if its parent dies,
routes its output back to the launcher, builds its communicator, calls ``fn(comm, *args)``
and sends back the result or the exception. The launcher side: ``minidist.launch``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass

import torch

from .. import transport as transports

_ENV_WORKER = "MINIDIST_WORKER"  # set inside our workers: a nested launch is not torchrun


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    local_rank: int
    transport: str
    device: str
    timeout: float | None
    threads: int
    stack_file: str
    forward_output: bool
    foreign_fds: tuple[int, ...] = ()  # other ranks' pipe ends, inherited under fork


# --- the worker side ---------------------------------------------------------------
def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when our parent process dies (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _release_fork_server() -> None:
    """Drop our copy of the fork server's "alive" pipe.

    multiprocessing hands every forked worker the write end of that pipe; the
    fork server exits when all write ends are closed. If workers keep theirs,
    a launcher killed with SIGKILL leaves fork server and workers keeping each
    other alive forever. Without it, the fork server exits with the launcher
    and PR_SET_PDEATHSIG then kills the workers.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _worker_main(spec: WorkerSpec, fn, args, kwargs, result_conn, resources, out_conn, err_conn):
    os.environ[_ENV_WORKER] = "1"
    for fd in spec.foreign_fds:  # else a peer's exit would not close its pipes (see transport)
        with contextlib.suppress(OSError):
            os.close(fd)
    result_conn.send_bytes(b"S")  # "started": the launcher can tell start-up failures apart
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # our own process group: the launcher kills the whole group
    _die_with_parent()
    _release_fork_server()
    if spec.forward_output:
        os.dup2(out_conn.fileno(), 1)
        os.dup2(err_conn.fileno(), 2)
        out_conn.close()
        err_conn.close()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True)
    stack_file = open(spec.stack_file, "w")  # noqa: SIM115 -- must stay open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(spec.threads)
    comm = None
    try:
        device = torch.device(spec.device)
        if device.type == "cuda":
            # One GPU per rank when there are enough; otherwise ranks share GPUs round-robin
            # (allowed for shm and pipe, which stage through the CPU; see _check_device).
            device = torch.device("cuda", spec.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        # No per-operation timeout: the launcher watches the whole run and, on timeout,
        # shows where each rank is stuck -- more useful than one rank's TimeoutError.
        comm = transports.connect(
            spec.transport, spec.rank, spec.world_size, resources, spec.local_rank, device, None
        )
        value = fn(comm, *args, **kwargs)
        try:
            message = b"R" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"rank {spec.rank} returned a {type(value).__name__} that cannot be pickled "
                f"({error}); return tensors, numbers, lists or dicts of them"
            ) from error
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: report, don't vanish
        message = (
            b"E"
            + json.dumps(
                {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
            ).encode()
        )
    result_conn.send_bytes(message)
    result_conn.close()
    if comm is not None:
        with contextlib.suppress(Exception):
            comm.close()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# --- the launcher side ---------------------------------------------------------------
