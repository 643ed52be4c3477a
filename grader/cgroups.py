"""One cgroup (v1) per sandbox: a memory limit, a CPU share and a process count.

Why: the sandboxes of two students run side by side. Without a cgroup, one submission can start
150 busy-looping ``setsid`` processes (the other slot's tests time out), touch gigabytes in many
processes (RLIMIT_AS is per process) or fill a tmpfs (its pages are nobody's). A memory cgroup
charges every page the sandbox's processes touch -- tmpfs and shared memory pages they write
included -- to that sandbox; ``cpu.shares`` splits the CPU between busy sandboxes by group, not by
process count; ``pids.max`` caps forking.

Each group is made UNDER the grader's own cgroup of that controller (read from
``/proc/self/cgroup``), so limits set on the grader (a container's, a systemd slice's) still
apply to its sandboxes. Group names start with :data:`PREFIX`; groups left by a grader that was
killed are removed by :func:`remove_stale` at start.

Only cgroup v1 is handled (the machines this grader runs on); :func:`probe` says which
controllers are usable, and the grader says at start which protections are off.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "pids")
PREFIX = "minidist-grader-"


def _own_path(controller: str) -> Path | None:
    """The directory of this process's cgroup for ``controller`` (None: not mounted as v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            mount = ROOT / controller
            where = mount / path.lstrip("/")
            return where if where.is_dir() else None
    return None


def probe() -> dict[str, bool]:
    """Which controllers can be used here: a test group can be made (and removed) under ours."""
    usable = {}
    for controller in CONTROLLERS:
        parent = _own_path(controller)
        ok = False
        if parent is not None:
            test = parent / f"{PREFIX}probe-{os.getpid()}"
            try:
                test.mkdir()
                ok = True
                test.rmdir()
            except OSError:
                pass
        usable[controller] = ok
    return usable


def remove_stale(prefix: str = PREFIX) -> int:
    """Remove groups named ``prefix*`` under ours left by a killed grader; how many were removed.

    Whatever still runs in one is killed first (the grader that made it is gone). Call it only
    while holding the sandbox-users lock: a grader running beside us would lose its groups.
    """
    removed = 0
    for controller in CONTROLLERS:
        parent = _own_path(controller)
        if parent is None:
            continue
        for child in parent.glob(f"{prefix}*"):
            if child.is_dir():
                group = SandboxGroup(child.name, {controller: child})
                group.kill_all(time.monotonic() + 10)
                removed += group.remove()
    return removed


class SandboxGroup:
    """The cgroup directories (one per usable controller) of one sandbox.

    ``procs_files`` go to ``sandbox.Isolation.cgroup_procs``: the sandboxed process writes its
    own pid into each ``cgroup.procs`` before anything else (``sandbox._join_cgroups``, still as
    root), so all it starts is counted and limited. The grader never joins a group itself.
    """

    def __init__(self, name: str, dirs: dict[str, Path]):
        self.name = name
        self.dirs = dirs

    @classmethod
    def create(
        cls, name: str, memory_bytes: int, cpu_shares: int, max_pids: int, prefix: str = PREFIX
    ) -> SandboxGroup:
        """Make the group ``prefix + name`` under our own cgroup of each usable controller and set
        its limits.

        A controller that is not usable here is left out (see :func:`probe`); a limit that
        cannot be written raises (a group without its limit would be a silent hole). Groups made
        outside a grading run (tests) take another ``prefix``: a grader starting beside them
        would otherwise remove them as stale (:func:`remove_stale`), killing their processes.
        """
        group = cls(prefix + name, {})
        try:
            for controller in CONTROLLERS:
                parent = _own_path(controller)
                if parent is None:
                    continue
                path = parent / group.name
                try:
                    path.mkdir()
                except FileExistsError:
                    pass
                except OSError:
                    continue
                group.dirs[controller] = path
            if "memory" in group.dirs:
                memory = group.dirs["memory"]
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                try:  # swap accounting is often off; the memory limit alone then holds
                    (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                except OSError:
                    pass
            if "cpu" in group.dirs:
                (group.dirs["cpu"] / "cpu.shares").write_text(str(cpu_shares))
            if "pids" in group.dirs:
                (group.dirs["pids"] / "pids.max").write_text(str(max_pids))
        except BaseException:
            group.remove()
            raise
        return group

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(str(path) for path in self.dirs.values())

    @property
    def procs_files(self) -> tuple[str, ...]:
        """The ``cgroup.procs`` file of each directory: a pid written there joins the group."""
        return tuple(str(path / "cgroup.procs") for path in self.dirs.values())

    def pids(self) -> set[int]:
        """Every process in the group (any controller: one can be left by a failed join)."""
        found: set[int] = set()
        for path in self.dirs.values():
            try:
                text = (path / "cgroup.procs").read_text()
            except OSError:
                continue
            found.update(int(word) for word in text.split())
        return found

    def kill_all(self, deadline: float) -> int:
        """SIGKILL everything in the group until it is empty or ``deadline`` (monotonic) passes.

        Repeated because a process can fork between the read and the kill; ``pids.max`` bounds
        how many there can be. Returns how many distinct processes were signalled.
        """
        killed: set[int] = set()
        while True:
            pids = self.pids() - {os.getpid()}
            if not pids:
                return len(killed)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                return len(killed)
            time.sleep(0.01)

    def remove(self, timeout: float = 10.0) -> int:
        """Remove every directory (rmdir fails while a dying process is still listed: retry)."""
        removed = 0
        stop = time.monotonic() + timeout
        for controller, path in list(self.dirs.items()):
            while True:
                try:
                    path.rmdir()
                    removed += 1
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > stop:
                        break
                    time.sleep(0.02)
            if not path.exists():
                del self.dirs[controller]
        return removed

    def _memory_value(self, name: str) -> int | None:
        if "memory" not in self.dirs:
            return None
        try:
            return int((self.dirs["memory"] / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def peak_memory(self) -> int | None:
        """The most memory the group held at once, in bytes (None: no memory controller)."""
        return self._memory_value("memory.max_usage_in_bytes")

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the group for its memory limit."""
        if "memory" not in self.dirs:
            return False
        try:
            text = (self.dirs["memory"] / "memory.oom_control").read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False  # no oom_kill counter (kernel < 4.13): failcnt also counts mere reclaim

    def close(self, timeout: float = 30.0) -> None:
        """Kill everything in the group, then remove its directories."""
        self.kill_all(time.monotonic() + timeout)
        self.remove()

    def __enter__(self) -> SandboxGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The working directory on its own size-capped tmpfs: a submission filling its disk gets ENOSPC
# there only, its pages are charged to its memory group, and unmounting removes whatever it left
# (3,000 nested folders included) without walking the tree.

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2


def mount_tmpfs(path: str | os.PathLike, size: str, mode: str = "0755") -> None:
    """Mount a fresh tmpfs of at most ``size`` (e.g. ``"512m"``) on ``path``, nosuid and nodev."""
    data = f"size={size},mode={mode}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mounting a tmpfs on {path}: {os.strerror(errno)}")


def unmount(path: str | os.PathLike) -> None:
    """Detach the mount on ``path`` (lazily: a file still open there does not stop it)."""
    if _libc.umount2(os.fsencode(path), MNT_DETACH) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unmounting {path}: {os.strerror(errno)}")


_stale_lock = threading.Lock()
_stale_done = False


def remove_stale_once() -> int:
    """:func:`remove_stale` the first time it is called in this process (thread-safe: the first
    sandbox of a batch cleans up before any group of this batch exists)."""
    global _stale_done
    with _stale_lock:
        if _stale_done:
            return 0
        _stale_done = True
        return remove_stale()
