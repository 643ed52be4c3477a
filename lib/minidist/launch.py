"""``launch``: run one function in N processes, each with a communicator.

::

    outs = md.launch(worker, world_size=4, args=(2.0,), transport="shm", timeout=60)

What happens, in order:

1. the transport's shared resources are created here, in the launcher
   (pipes, shared-memory mailboxes, or a TCP rendezvous store);
2. N processes start -- by default from a *fork server* that has already
   imported torch and minidist, so a worker starts in milliseconds instead of
   the second or two a fresh ``import torch`` costs;
3. each worker puts itself in its own process group (so we can kill it *and*
   anything it started), asks the kernel to kill it if its parent dies, routes
   its stdout/stderr back to us (so ``print`` in a worker shows up in your
   notebook, prefixed with its rank), builds its communicator and calls
   ``fn(comm, *args)``;
4. we wait for every rank's result, its exception, its death, or the timeout,
   whichever comes first. On the first failure the others are killed and a
   ``WorkerError`` names the rank and shows its traceback. On timeout each stuck
   rank is asked for its Python stack (``faulthandler`` on SIGUSR1) before it
   is killed, and ``LaunchTimeout`` shows where every rank was waiting.

Whatever happens -- success, failure, timeout, Ctrl-C / "interrupt kernel" --
every process we started is gone when ``launch`` returns or raises.

Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) nothing
is started: this process *is* one rank, the communicator is the torch
transport, and ``launch`` returns every rank's result, gathered from all
machines. The same script thus runs on a laptop and on a cluster.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from . import transport as transports
from ._output import OutputForwarder
from ._stacks import collect_stacks
from ._torchrun import launch_under_torchrun
from .errors import LaunchTimeout, WorkerError

START_METHODS = ("forkserver", "spawn", "fork")
_ENV_WORKER = "MINIDIST_WORKER"  # set inside our workers: a nested launch is not torchrun
_FAILURE_GRACE = 0.3  # seconds to collect other failures before choosing the root cause


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
def _check_function(fn: Callable, start_method: str) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, got {type(fn).__name__}")
    if start_method == "fork":
        return
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{qualname!r} is a lambda or a function defined inside another function; worker "
            f"processes started with {start_method!r} find functions by module and name, so define "
            "it at the top level of a module (or use start_method='fork')"
        )
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{qualname!r} is defined in this notebook (module __main__), which a worker started "
            f"with start_method={start_method!r} cannot import. Move the function into a .py file "
            "next to the notebook (e.g. with %%writefile workers.py), import it from there and "
            "pass that; or use start_method='fork' (Linux/macOS only; re-run the definition "
            "cell after each edit)."
        )


def _signal_description(code: int) -> str:
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hints = {
        "SIGKILL": " (killed from outside; often the out-of-memory killer)",
        "SIGSEGV": " (a segmentation fault in native code)",
        "SIGBUS": " (bus error: shared memory full? check the size of /dev/shm)",
        "SIGABRT": " (aborted by native code)",
    }
    return f"was killed by {name}{hints.get(name, '')}"


def _kill_rank(process) -> None:
    pid = process.pid
    if pid is None:
        return
    for kill in (os.killpg, os.kill):  # the group first: also what the worker started
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _failure_from_message(rank: int, message: bytes):
    info = json.loads(message[1:].decode())
    return {
        "rank": rank,
        "message": f"{info['type']}: {info['message']}",
        "exc_type": info["type"],
        "remote_traceback": info["traceback"],
        "exitcode": None,
    }


def _choose_root_cause(failures: list[dict]) -> WorkerError:
    """The first failure that is not a mere consequence (a peer that lost its partner)."""
    consequences = ("PeerError", "MessageMismatch")
    causes = [f for f in failures if f["exc_type"] not in consequences and f["exc_type"] != ""]
    deaths = [f for f in failures if f["exc_type"] == ""]
    # a rank that saw a disagreement comes before one that then lost its partner (PeerError)
    mismatches = [f for f in failures if f["exc_type"] == "MessageMismatch"]
    primary = (causes or deaths or mismatches or failures)[0]
    others = {f["rank"]: f["message"] for f in failures if f is not primary}
    return WorkerError(
        primary["rank"],
        primary["message"],
        exc_type=primary["exc_type"],
        remote_traceback=primary["remote_traceback"],
        exitcode=primary["exitcode"],
        other_failures=others,
    )


def launch(
    fn: Callable,
    world_size: int | None = None,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    transport: str = "shm",
    start_method: str = "forkserver",
    timeout: float | None = 60.0,
    device: str = "cpu",
    threads_per_worker: int | None = None,
    forward_output: bool = True,
) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    Args:
        fn: a function defined at the top level of an importable module (not in a
            notebook, unless ``start_method="fork"``); its first argument is the
            rank's ``Communicator``.
        world_size: number of ranks (under torchrun: None, or the same as WORLD_SIZE).
        transport: "shm" (default, fastest on one machine), "pipe" or "torch".
        start_method: "forkserver" (default), "spawn" or "fork".
        timeout: seconds before every rank still running is killed and
            ``LaunchTimeout`` is raised (None: wait forever -- not recommended).
        device: "cpu" or "cuda" (rank r uses ``cuda:local_rank``; with fewer GPUs than
            ranks, the shm and pipe transports share them round-robin, ``cuda:local_rank % count``;
            NCCL under the torch transport needs one GPU per rank).
        threads_per_worker: torch intra-op threads per rank (default: cores / ranks).
        forward_output: show workers' stdout/stderr here, prefixed with the rank.

    Tensors in ``args`` are shared, not copied, with the forkserver and spawn start
    methods (torch moves them into shared memory): a worker that writes into one
    changes it for everyone, the launcher included. With ``fork`` each worker gets
    a private copy. Pass ``t.clone()`` when a worker must not touch your tensor.

    Returns:
        ``outs`` with ``outs[r]`` the value rank r's ``fn`` returned.

    Raises:
        WorkerError: a rank raised, exited or was killed; the others were killed.
        LaunchTimeout: ranks were still running after ``timeout`` seconds.
    """
    kwargs = dict(kwargs or {})
    if transport not in transports.TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {transports.TRANSPORTS}")
    if start_method not in START_METHODS:
        raise ValueError(f"unknown start_method {start_method!r}; choose one of {START_METHODS}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of extra arguments, got {type(args).__name__}")
    torchrun = transports.torch_dist.torchrun_environment()
    if torchrun is not None and _ENV_WORKER not in os.environ:
        return launch_under_torchrun(
            fn, world_size, tuple(args), kwargs, transport, timeout, device, torchrun
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    _check_function(fn, start_method)
    _check_device(device, world_size, start_method, transport)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = threads_per_worker or max(1, cores // world_size)

    context = torch_mp.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when the fork server first starts; it then serves every launch.
        context.set_forkserver_preload(["torch", "minidist"])

    shared, keepalive = transports.setup(transport, world_size)
    stack_dir = tempfile.mkdtemp(prefix="minidist-stacks-")
    processes, result_readers, child_ends = [], [], []
    forwarder = OutputForwarder() if forward_output else None
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            result_readers.append(reader)
            out_ends = [None, None]
            if forwarder is not None:
                for index, err in ((0, False), (1, True)):
                    out_r, out_w = context.Pipe(duplex=False)
                    forwarder.add(rank, out_r, err)
                    out_ends[index] = out_w
            spec = WorkerSpec(
                rank=rank,
                world_size=world_size,
                local_rank=rank,
                transport=transport,
                device=device,
                timeout=timeout,
                threads=threads,
                stack_file=os.path.join(stack_dir, f"rank{rank}.txt"),
                forward_output=forwarder is not None,
                foreign_fds=transports.foreign_fds(transport, shared, rank) if start_method == "fork" else (),
            )
            resources = transports.share_with_rank(transport, shared, rank, world_size)
            process = context.Process(
                target=_worker_main,
                args=(spec, fn, tuple(args), kwargs, writer, resources, *out_ends),
                name=f"minidist-rank{rank}",
            )
            try:
                process.start()
            except RuntimeError as error:  # a multiprocessing.Lock() from the default context
                if "SemLock" not in str(error):
                    raise
                raise ValueError(
                    f"could not send an argument to the worker processes: {error}. Objects from "
                    "multiprocessing (Lock, Queue, Event, ...) must be created with the same start "
                    f"method as the workers: multiprocessing.get_context({start_method!r}).Lock()."
                ) from error
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                raise ValueError(
                    f"could not send the function or its arguments to the worker processes: "
                    f"{error}. Arguments must be picklable (tensors, numbers, lists, dicts, "
                    "objects of classes defined in a module)."
                ) from error
            processes.append(process)
            child_ends += [writer, *[e for e in out_ends if e is not None]]
        for end in child_ends:  # the children hold their copies; EOF works only if we drop ours
            end.close()
        child_ends = []
        transports.release_launcher_copies(transport, shared)  # the same for the transport's pipes
        if forwarder is not None:
            forwarder.start()
        return _wait_for_results(processes, result_readers, timeout, stack_dir)
    finally:
        for process in processes:
            _kill_rank(process)
        for process in processes:
            process.join(timeout=5.0)
        for conn in [*result_readers, *child_ends]:
            conn.close()
        if forwarder is not None:
            forwarder.stop()
        if transport == "pipe":
            for conn in [*shared["readers"].values(), *shared["writers"].values()]:
                conn.close()
        del keepalive
        shutil.rmtree(stack_dir, ignore_errors=True)


def _wait_for_results(processes, readers, timeout, stack_dir) -> list:
    world_size = len(processes)
    results: dict[int, Any] = {}
    failures: list[dict] = []
    pending = set(range(world_size))
    reader_rank = {reader: rank for rank, reader in enumerate(readers)}
    sentinel_rank = {process.sentinel: rank for rank, process in enumerate(processes)}
    open_readers = set(readers)
    deadline = None if timeout is None else time.monotonic() + timeout
    first_failure_at = None

    started: set[int] = set()

    def take(rank: int, message: bytes) -> None:
        if message == b"S":
            started.add(rank)
            return
        pending.discard(rank)
        if message[:1] == b"R":
            try:
                results[rank] = pickle.loads(message[1:])
            except Exception as error:
                failures.append(
                    {
                        "rank": rank,
                        "message": f"its return value could not be unpickled here: {error!r}",
                        "exc_type": type(error).__name__,
                        "remote_traceback": "",
                        "exitcode": None,
                    }
                )
        else:
            failures.append(_failure_from_message(rank, message))

    while pending:
        now = time.monotonic()
        if first_failure_at is not None and now - first_failure_at > _FAILURE_GRACE:
            break
        wait_for = None if deadline is None else deadline - now
        if first_failure_at is not None:
            wait_for = max(0.0, first_failure_at + _FAILURE_GRACE - now)
        if wait_for is not None and wait_for <= 0 and first_failure_at is None:
            stuck = sorted(pending)
            stacks = collect_stacks(processes, stuck, [f"{stack_dir}/rank{r}.txt" for r in range(world_size)])
            raise LaunchTimeout(stuck, stacks, timeout)
        watch = [r for r in open_readers if reader_rank[r] in pending]
        watch += [p.sentinel for r, p in enumerate(processes) if r in pending]
        for ready in multiprocessing.connection.wait(watch, timeout=wait_for):
            if ready in reader_rank:
                rank = reader_rank[ready]
                try:
                    take(rank, ready.recv_bytes())
                except (EOFError, OSError):
                    open_readers.discard(ready)
            else:
                rank = sentinel_rank[ready]
                if rank not in pending:
                    continue
                reader = readers[rank]
                with contextlib.suppress(EOFError, OSError):
                    while rank in pending and reader.poll(0):  # sent just before exiting
                        take(rank, reader.recv_bytes())
                if rank not in pending:
                    continue
                processes[rank].join(timeout=1.0)
                code = processes[rank].exitcode
                pending.discard(rank)
                if code is not None and code < 0:
                    what = _signal_description(code)
                elif rank not in started:
                    what = (
                        f"exited with code {code} while starting, before it could run your function: "
                        "see the error printed above (a script that calls launch() needs "
                        "`if __name__ == '__main__':` around that call)"
                    )
                else:
                    what = f"exited with code {code} without returning a result (did it call os._exit()?)"
                failures.append(
                    {"rank": rank, "message": what, "exc_type": "", "remote_traceback": "", "exitcode": code}
                )
        if failures and first_failure_at is None:
            first_failure_at = time.monotonic()
    if failures:
        raise _choose_root_cause(failures)
    return [results[rank] for rank in range(world_size)]


def _check_device(device: str, world_size: int, start_method: str, transport: str = "torch") -> None:
    kind = torch.device(device).type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but torch sees no CUDA GPU here; use device='cpu'")
    if transport == "torch" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"world_size={world_size} ranks need one GPU each under the torch transport (NCCL refuses "
            f"two ranks on one GPU), but {torch.cuda.device_count()} are visible; lower world_size, "
            "use transport='shm' or 'pipe' (ranks then share GPUs), or use device='cpu'"
        )
    if start_method == "fork":
        raise ValueError("CUDA does not work in forked processes; use start_method='forkserver' or 'spawn'")
