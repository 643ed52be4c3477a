"""Run one command with a student's code in it, confined, limited, and cleaned up completely.

What the child gets (``run``):

* its own session and process group (``start_new_session``), a wall-clock limit, and
  resource limits: CPU seconds, file size (a flood of output stops at ``max_file_bytes``),
  no core dumps, address space, and -- when it runs under its own user id -- a process count;
* when the grader runs as root (``Isolation.enabled``):

  - a private mount namespace in which the course's secrets (``solutions/``, ``grader/``,
    ``.git``, the output folder, the submissions) are covered by empty read-only tmpfs, and
    ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are fresh private tmpfs (nothing is left in the
    real ones: they vanish with the last process of the namespace);
  - its working directory, bind-mounted at ``/var/tmp/work`` (with ``/tmp``, its only writable places);
  - an unprivileged user id of its own (``uid``, one per parallel slot, never shared by two
    running submissions), so it can read or signal no other submission, and the grader can
    find and kill every process it started, even one that left the session.

* stdout and stderr go to pipes that the grader drains, keeping the last ``tail_bytes``
  of each: gigabytes of output cost time, not memory or disk.

``cleanup`` kills the process group, every process of the session, and every process of the
sandbox's user id, until none is left.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 4096, 16384, 1 << 18
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 300.0
    cpu_seconds: int = 600  # per process (RLIMIT_CPU)
    max_file_bytes: int = 256 * 2**20  # RLIMIT_FSIZE (8 ranks' shm workspace is 128 MiB)
    address_space_bytes: int = 4 * 2**30  # RLIMIT_AS, per process
    max_processes: int = 256  # RLIMIT_NPROC (threads count too); only under a private uid
    tail_bytes: int = 64 * 1024  # of stdout/stderr read back
    shm_bytes: int = 1 * 2**30  # size of the private /dev/shm


@dataclass(frozen=True)
class Isolation:
    enabled: bool  # root: namespaces and a private user id
    uid: int | None = None
    gid: int | None = None
    hide: tuple[str, ...] = ()  # folders covered by an empty tmpfs


@dataclass
class RunResult:
    status: str  # "ok" (exited 0), "timeout", "crashed" (non-zero exit or killed)
    returncode: int | None
    seconds: float
    stdout: str = ""  # the last tail_bytes
    stderr: str = ""
    stdout_bytes: int = 0  # how much was written in all
    stderr_bytes: int = 0
    leftovers_killed: int = 0
    notes: list[str] = field(default_factory=list)


def work_mount(workdir: str | Path) -> str:
    """Where the working directory appears inside the sandbox (a fresh tmpfs not above it)."""
    stage = "/tmp" if str(workdir).startswith("/var/tmp/") else "/var/tmp"
    return f"{stage}/work"


def can_isolate() -> bool:
    """Root, and allowed to make a mount namespace (a plain Docker container may not be)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0 if _libc.unshare(CLONE_NEWNS) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def enter(workdir: str, limits: Limits, isolation: Isolation) -> None:
    """Confine, limit and drop privileges -- in the process about to exec the sandboxed command.

    It runs in a fresh interpreter (``python sandbox.py CONFIG -- COMMAND``), not in a
    ``preexec_fn``: forking a multi-threaded grader and running Python before exec can deadlock.
    """
    os.umask(0o022)  # the grader's own umask (077) would make the mount points unreachable
    if isolation.enabled:
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        kept = _hold(_needed_under_tmp())  # the venv and minidist, when the repo is under /tmp
        # A fresh tmpfs replaces /var/tmp (or /tmp), and the working directory is bound into
        # it *before* anything is hidden: the output folder that holds it may be hidden next.
        work = work_mount(workdir)
        stage = os.path.dirname(work)
        _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=1777")
        os.mkdir(work, 0o755)
        _mount(workdir, work, None, MS_BIND)
        _expose(sys.base_prefix, stage)
        for path in isolation.hide:
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
        for path in ("/tmp", "/var/tmp"):
            if path != stage and os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=1777")
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits.shm_bytes},mode=1777")
        for holder, path in kept:  # put them back where the interpreter expects them
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(holder, path, None, MS_BIND | MS_REC)
        os.chdir(work)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
    if isolation.enabled and isolation.uid is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        os.setgroups([])
        os.setgid(isolation.gid)
        os.setuid(isolation.uid)
        if os.getuid() == 0 or os.geteuid() == 0:
            raise OSError("could not drop root privileges")
    PR_SET_PDEATHSIG = 1  # after setuid, which clears it: die with the grader's thread
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _needed_under_tmp() -> list[str]:
    """The virtual environment and the folder minidist is imported from, if they lie
    under /tmp or /var/tmp (a clone there, as CI may make): those are replaced by fresh
    tmpfs in the sandbox, so they are held aside and bound back afterwards."""
    import minidist

    needed = {
        os.path.realpath(sys.prefix),
        os.path.dirname(os.path.dirname(os.path.realpath(minidist.__file__))),
    }
    return sorted(p for p in needed if p.startswith(("/tmp/", "/var/tmp/")))


def _hold(paths: list[str]) -> list[tuple[str, str]]:
    """Bind each path to a holder under a private tmpfs on /mnt, before /tmp is covered."""
    if not paths:
        return []
    os.makedirs("/mnt", exist_ok=True)
    _mount("tmpfs", "/mnt", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    held = []
    for index, path in enumerate(paths):
        holder = f"/mnt/keep{index}"
        os.mkdir(holder, 0o755)
        _mount(path, holder, None, MS_BIND | MS_REC)
        held.append((holder, path))
    return held


def _expose(path: str, stage: str) -> None:
    """Make ``path`` (the Python installation) reachable by the sandbox user, and nothing beside it.

    pyenv puts Python under ``/root``, which only root may enter. Cover the first such
    ancestor with an empty tmpfs (hiding root's home, as it should be) and bind ``path``
    back into it at the same place.
    """
    parts = Path(path).parts
    for depth in range(2, len(parts) + 1):
        ancestor = os.path.join(*parts[:depth])
        if os.stat(ancestor).st_mode & 0o001 == 0:  # others may not traverse it
            keep = os.path.join(stage, ".python")
            os.mkdir(keep, 0o755)
            _mount(path, keep, None, MS_BIND)
            _mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(keep, path, None, MS_BIND)
            return


class _Tail(threading.Thread):
    """Drain a pipe to its end, keeping only the last ``size`` bytes: output floods cost nothing."""

    def __init__(self, pipe, size: int) -> None:
        super().__init__(daemon=True)
        self.pipe, self.size, self.total, self.kept = pipe, size, 0, bytearray()

    def run(self) -> None:
        while chunk := self.pipe.read1(1 << 16):
            self.total += len(chunk)
            self.kept += chunk
            if len(self.kept) > 2 * self.size:
                del self.kept[: -self.size]
        self.pipe.close()

    def text(self) -> str:
        dropped = self.total - min(len(self.kept), self.size)
        prefix = f"[... {dropped} earlier bytes not shown]\n" if dropped > 0 else ""
        return prefix + bytes(self.kept[-self.size :]).decode("utf-8", errors="replace")


def run(command: list[str], workdir: Path, env: dict, limits: Limits, isolation: Isolation) -> RunResult:
    """Run ``command`` in ``workdir`` (``work_mount(workdir)`` when isolated) and clean up after it."""
    start = time.monotonic()
    if isolation.enabled and isolation.uid is not None:
        cleanup(-1, isolation)  # whatever an interrupted earlier run left under this user id
    config = {"workdir": str(workdir), "limits": asdict(limits), "isolation": asdict(isolation)}
    process = subprocess.Popen(
        [sys.executable, "-s", __file__, json.dumps(config), "--", *command],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    tails = [_Tail(process.stdout, limits.tail_bytes), _Tail(process.stderr, limits.tail_bytes)]
    for tail in tails:
        tail.start()
    status = "ok"
    try:
        returncode = process.wait(timeout=limits.wall_seconds)
        if returncode != 0:
            status = "crashed"
    except subprocess.TimeoutExpired:
        status, returncode = "timeout", None
    killed = cleanup(process.pid, isolation)
    if returncode is None:
        returncode = process.wait()
    for tail in tails:
        tail.join(timeout=5)  # every writer is dead: the pipes are at their end
    return RunResult(
        status=status,
        returncode=returncode,
        seconds=time.monotonic() - start,
        stdout=tails[0].text(),
        stderr=tails[1].text(),
        stdout_bytes=tails[0].total,
        stderr_bytes=tails[1].total,
        leftovers_killed=killed,
    )


def become_subreaper() -> None:
    """Adopt orphans (Linux): a daemon a submission leaves behind becomes our child, not init's,
    so that once killed it is reaped here instead of lingering as a zombie."""
    PR_SET_CHILD_SUBREAPER = 36
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _members(session: int, uid: int | None) -> list[psutil.Process]:
    """Live processes of the session or the user id; reaps the zombies among them that are ours."""
    found = []
    for proc in psutil.process_iter(["uids", "ppid", "status"]):
        try:
            if proc.pid == os.getpid():
                continue
            same_user = uid is not None and proc.info["uids"] is not None and proc.info["uids"].real == uid
            if not (same_user or (session > 0 and os.getsid(proc.pid) == session)):
                continue
            if proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
            elif proc.info["ppid"] == os.getpid() and proc.pid != session:
                os.waitpid(proc.pid, os.WNOHANG)  # an adopted orphan (the leader is Popen's to reap)
        except (
            psutil.NoSuchProcess,
            psutil.AccessDenied,
            ProcessLookupError,
            PermissionError,
            ChildProcessError,
        ):
            continue
    return found


def _kill_as(uid: int, gid: int) -> None:
    """kill(-1, SIGKILL) as ``uid``: one system call that reaches every process of that user."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def cleanup(session: int, isolation: Isolation, deadline: float = 20.0) -> int:
    """Kill the session ``session`` (its leader's pid) and every process of the sandbox's uid."""
    killed = 0
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        with_uid = isolation.uid if isolation.enabled else None
        if with_uid is not None:
            _kill_as(with_uid, isolation.gid)
        if session > 0:
            try:
                os.killpg(session, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        members = _members(session, with_uid)
        if not members:
            _members(session, with_uid)  # reap what the last round killed
            return killed
        for proc in members:
            try:
                proc.kill()
                killed += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        time.sleep(0.05)
    return killed


def _main(argv: list[str]) -> None:
    """``python sandbox.py CONFIG -- COMMAND...``: enter the sandbox, then exec COMMAND."""
    config = json.loads(argv[0])
    limits = Limits(**config["limits"])
    isolation = Isolation(**{**config["isolation"], "hide": tuple(config["isolation"]["hide"])})
    enter(config["workdir"], limits, isolation)
    command = argv[argv.index("--") + 1 :]
    os.execv(command[0], command)


if __name__ == "__main__":
    _main(sys.argv[1:])
