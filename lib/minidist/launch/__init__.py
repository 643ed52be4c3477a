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

This package: ``worker.py`` (what a started process does), ``failures.py`` (waiting, the root
cause of a failure, killing), and here ``launch`` itself.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.multiprocessing as torch_mp

from .. import transport as transports
from .._output import OutputForwarder
from .._torchrun import launch_under_torchrun
from .failures import _kill_rank, _wait_for_results
from .worker import _ENV_WORKER, WorkerSpec, _worker_main

START_METHODS = ("forkserver", "spawn", "fork")


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
    elastic=None,
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
        elastic: None (default: a dead rank fails the launch), or
            ``minidist.parallel.elastic.Policy(min_size, max_restarts)``: a rank may die, the
            others go on and a replacement may join (see that package; transport="pipe").

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
        if elastic is not None:
            raise ValueError("under torchrun, elasticity is torchrun's: --nnodes=MIN:MAX --max-restarts=N")
        return launch_under_torchrun(
            fn, world_size, tuple(args), kwargs, transport, timeout, device, torchrun
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if elastic is not None:  # duck-typed: this layer does not import minidist.parallel
        options = dict(transport=transport, start_method=start_method, timeout=timeout, device=device)
        options.update(threads_per_worker=threads_per_worker, forward_output=forward_output)
        return elastic._launch(fn, world_size, tuple(args), kwargs, **options)
    _check_function(fn, start_method)
    _check_device(device, world_size, start_method, transport)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = threads_per_worker or max(1, cores // world_size)

    context = torch_mp.get_context(start_method)
    if start_method == "forkserver":
        # Takes effect when the fork server first starts; it then serves every launch. torch._dynamo
        # too: creating any torch.optim optimizer imports it (about 800 modules, ~1 CPU-second),
        # which every worker that trains would otherwise pay again.
        context.set_forkserver_preload(["torch", "minidist", "torch._dynamo"])

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
