"""``md.launch(..., elastic=Policy(...))``: start the ranks, run the coordinator, replace the dead.

The same process machinery as ``minidist.launch`` (``_worker_main``: own process group, killed
with its parent, result and exception sent back), with three differences:

- each rank also gets a *control* pipe (a socket pair, so that file descriptors can travel on
  it) to the coordinator, which runs here, in the loop that waits for the ranks;
- a rank that dies is not a failure of the launch: the coordinator stops waiting for it and,
  while ``max_restarts`` allows, a replacement of the same slot starts (incarnation + 1) with no
  pipes at all -- the coordinator hands it fresh ones when it joins a quorum;
- a rank that *raises* is a bug, not a lost machine: the launch fails as usual (WorkerError).

Returns ``outs[slot]``: what the slot's last incarnation returned (None if it died for good).
A replacement's output is not forwarded (it prints straight to the launcher's terminal).
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import time

import torch.multiprocessing as torch_mp

from ... import transport as transports
from ..._output import OutputForwarder
from ..._stacks import collect_stacks
from ...errors import LaunchTimeout
from ...launch import _check_function
from ...launch.failures import _choose_root_cause, _failure_from_message, _kill_rank
from ...launch.worker import WorkerSpec, _worker_main
from . import step as step_module
from .coordinator import Coordinator, Member


class _Entry:
    """What an elastic worker process runs: records its control pipe and identity, calls fn."""

    def __init__(self, fn, control, slot: int, incarnation: int, step_timeout=None) -> None:
        self.fn, self.control, self.slot, self.incarnation = fn, control, slot, incarnation
        self.step_timeout = step_timeout

    def __call__(self, comm, *args, **kwargs):
        step_module._CONTEXT = {"control": self.control, "slot": self.slot, "incarnation": self.incarnation}
        if self.step_timeout is not None:
            comm.timeout = self.step_timeout  # a receive gives up on a silent peer (PeerError)
        return self.fn(comm, *args, **kwargs)


def launch_elastic(policy, fn, world_size, args, kwargs, *, transport, start_method, timeout,
                   device, threads_per_worker, forward_output) -> list:  # fmt: skip
    if transport != "pipe":
        raise ValueError(
            f"elastic launches need transport='pipe', got {transport!r}: a dead peer's pipe reports "
            "end-of-file at once, while shared memory has no end-of-file (a dead peer looks slow)"
        )
    if start_method == "fork":
        raise ValueError("elastic launches need start_method='forkserver' or 'spawn' (a forked "
                         "replacement would inherit other ranks' pipe ends)")  # fmt: skip
    if policy.min_size > world_size:
        raise ValueError(f"Policy(min_size={policy.min_size}) is larger than world_size={world_size}")
    _check_function(fn, start_method)
    if device != "cpu":
        raise ValueError("elastic launches run on device='cpu' for now")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = threads_per_worker or max(1, cores // world_size)
    context = torch_mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "minidist"])
    shared, _ = transports.setup("pipe", world_size)
    stack_dir = tempfile.mkdtemp(prefix="minidist-stacks-")
    forwarder = OutputForwarder() if forward_output else None
    coordinator = Coordinator(
        policy.min_size, policy.wait_for_replacements, policy.step_timeout, policy.start_timeout
    )
    procs: dict[int, tuple] = {}  # slot -> (process, result reader, control) of the latest incarnation
    every_process, to_close = [], []

    def start(slot: int, incarnation: int, resources: dict) -> None:
        reader, writer = context.Pipe(duplex=False)
        ours, theirs = context.Pipe(duplex=True)  # a socket pair: can carry file descriptors
        out_ends = [None, None]
        if forwarder is not None and incarnation == 0:
            for index, err in ((0, False), (1, True)):
                out_r, out_ends[index] = context.Pipe(duplex=False)
                forwarder.add(slot, out_r, err)
                to_close.append(out_r)
        spec = WorkerSpec(
            rank=slot, world_size=world_size, local_rank=slot, transport="pipe", device="cpu",
            timeout=timeout, threads=threads, stack_file=os.path.join(stack_dir, f"rank{slot}.txt"),
            forward_output=out_ends[0] is not None,
        )  # fmt: skip
        entry = _Entry(fn, theirs, slot, incarnation, policy.step_timeout)
        process = context.Process(
            target=_worker_main,
            args=(spec, entry, tuple(args), kwargs, writer, resources, *out_ends),
            name=f"minidist-rank{slot}.{incarnation}",
        )
        process.start()
        for end in (writer, theirs, *[e for e in out_ends if e is not None]):
            end.close()
        every_process.append(process)
        procs[slot] = (process, reader, ours)
        to_close.extend([reader, ours])
        peers = {(s, 0) for s in range(world_size) if s != slot} if incarnation == 0 else set()
        coordinator.add(Member(slot, incarnation, ours, healthy=incarnation == 0, peers=peers))

    try:
        for slot in range(world_size):
            start(slot, 0, transports.share_with_rank("pipe", shared, slot, world_size))
        transports.release_launcher_copies("pipe", shared)
        if forwarder is not None:
            forwarder.start()
        return _serve(coordinator, procs, policy, start, timeout, stack_dir, world_size)
    finally:
        for process in every_process:
            _kill_rank(process)
        for process in every_process:
            process.join(timeout=5.0)
        if forwarder is not None:
            forwarder.stop()  # before closing its pipes below: its thread may be reading them
        for conn in to_close:
            conn.close()
        shutil.rmtree(stack_dir, ignore_errors=True)


def _serve(coordinator, procs, policy, start, timeout, stack_dir, world_size) -> list:
    """The launcher's wait loop, with the coordinator inside it."""
    results: dict[int, object] = {}
    restarts = 0
    deadline = None if timeout is None else time.monotonic() + timeout

    def lost(slot: int) -> None:
        """A rank died without a result (or was killed as stuck): start a replacement if allowed."""
        nonlocal restarts
        coordinator.on_death(slot)
        incarnation = coordinator.members[slot].incarnation + 1
        if restarts < policy.max_restarts and not coordinator.done:
            restarts += 1
            start(slot, incarnation, {"writers": {}, "readers": {}})

    def finish(slot: int, message: bytes) -> bool:
        """Take a result message; True if the rank is done (returned or raised)."""
        if message[:1] == b"R":
            results[slot] = pickle.loads(message[1:])
            coordinator.on_death(slot)  # it left: the coordinator no longer waits for it
            return True
        if message[:1] == b"E":
            raise _choose_root_cause([_failure_from_message(slot, message)])
        return False  # b"S": started

    while any(m.alive for m in coordinator.members.values()):
        wait_for = None if deadline is None else deadline - time.monotonic()
        if wait_for is not None and wait_for <= 0:
            stuck = sorted(s for s, m in coordinator.members.items() if m.alive)
            processes = {s: procs[s][0] for s in stuck}
            files = {s: f"{stack_dir}/rank{s}.txt" for s in stuck}
            raise LaunchTimeout(stuck, collect_stacks(processes, stuck, files), timeout)
        for slot in coordinator.overdue():  # stuck (Policy's timeouts): from now on, a death
            _kill_rank(procs[slot][0])
            procs[slot][0].join(timeout=5.0)  # its pipes are closed: the others see end-of-file
            lost(slot)
        for limit in (coordinator.step_timeout, coordinator.start_timeout):
            if limit is not None:  # wake up to check for silent members and stuck starts
                wait_for = limit / 4 if wait_for is None else min(wait_for, limit / 4)
        watch = {}
        for slot, (process, reader, control) in procs.items():
            if coordinator.members[slot].alive:
                for obj, what in ((control, "control"), (reader, "result"), (process.sentinel, "end")):
                    watch[obj] = (what, slot, process)
        for ready in multiprocessing.connection.wait(list(watch), timeout=wait_for):
            what, slot, process = watch[ready]
            if not coordinator.members[slot].alive or procs[slot][0] is not process:
                continue  # a replacement has taken the slot since this wait began
            _, reader, control = procs[slot]
            if what == "control":
                try:
                    coordinator.on_message(slot, control.recv())
                except (EOFError, OSError):
                    pass  # it is ending; its sentinel follows
            elif what == "result":
                try:
                    finish(slot, reader.recv_bytes())
                except (EOFError, OSError):
                    pass
            else:
                while reader.poll(0):  # a result sent just before exiting
                    try:
                        if finish(slot, reader.recv_bytes()):
                            break
                    except (EOFError, OSError):
                        break
                if not coordinator.members[slot].alive:
                    continue
                lost(slot)  # died without a result: a lost rank
        coordinator.progress()
    return [results.get(slot) for slot in range(world_size)]
