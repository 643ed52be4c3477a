"""The launcher side of a failure: wait for every rank, find the first failure, kill the rest.

``_wait_for_results`` waits for each rank's result, exception, death or the timeout; on the
first failure it collects the others for a moment (``_FAILURE_GRACE``), names the root cause
(``_choose_root_cause``: the rank that failed first, not the ones that then lost their peer)
and kills every process; on a timeout it asks each stuck rank for its stack first.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection
import os
import pickle
import signal
import time
from typing import Any

from .._stacks import collect_stacks
from ..errors import LaunchTimeout, WorkerError

_FAILURE_GRACE = 0.3  # seconds to collect other failures before choosing the root cause


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
