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
  - the files of the library's forbidden modules covered by generated stand-ins (and their
    cached ``.pyc`` by empty files; ``stubs.py``), bound first, so that no route inside the
    sandbox -- an import, a child process, ``torch.from_file`` -- reaches their code;
  - its working directory, bind-mounted at ``/var/tmp/work`` (with ``/tmp``, its only writable places);
  - its own network namespace (only a loopback interface, up: the transports' 127.0.0.1
    ports are reachable from inside the sandbox only), IPC namespace (System V shared memory,
    semaphores and message queues vanish with it) and PID namespace (a fresh ``/proc`` shows
    only the sandbox's own processes: no other sandbox's ``/proc/PID/root``, no grader
    command line); a minimal init (PID 1) reaps its orphans, and when it ends the kernel kills
    everything left in the namespace;
  - a private size-capped tmpfs (``nosuid,nodev``) over every other world-writable directory
    (``world_writable_dirs``), and every other mount of the namespace remounted read-only:
    nothing written by a sandbox outlives it or reaches another one;
  - ``no_new_privs``: a setuid program cannot raise its privileges;
  - its own cgroups (``Isolation.cgroup_procs``, made by ``cgroups.SandboxGroup``: memory,
    CPU share, process count), which the sandbox process joins first thing, still as root;
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
import fcntl
import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
NAMESPACES = {"network": CLONE_NEWNET, "ipc": CLONE_NEWIPC, "pid": CLONE_NEWPID}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_GET_NO_NEW_PRIVS = 1, 38, 39
# Private directories of every sandbox (fresh tmpfs); any other world-writable one found by
# ``world_writable_dirs`` gets a small tmpfs of its own.
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")
SCANNED = ("/", "/run", "/var", "/dev")  # top levels searched for world-writable directories
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
    #: ``cgroup.procs`` files of the sandbox's cgroups (``cgroups.SandboxGroup.procs_files``):
    #: ``enter`` writes its own pid into each first thing, so everything it starts is in them
    cgroup_procs: tuple[str, ...] = ()
    #: (source, target) file bind mounts made first in the sandbox's mount namespace: the
    #: library's forbidden modules covered by their stand-ins (``stubs.build``)
    overlays: tuple[tuple[str, str], ...] = ()


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


def _probe(flag: int) -> bool:
    """Whether a forked child may ``unshare(flag)`` (a fork: the grader itself stays as it is)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0 if _libc.unshare(flag) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def probe_protections() -> dict[str, bool]:
    """Which protections work here, each found by trying it (``Grader`` names those that are off).

    Keys: ``root`` (private user ids, mounts), ``mount namespace``, ``network namespace``,
    ``ipc namespace``, ``pid namespace``, ``no_new_privs``.
    """
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    found = {"root": root, "mount namespace": root and _probe(CLONE_NEWNS)}
    for name, flag in NAMESPACES.items():
        found[f"{name} namespace"] = root and _probe(flag)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ok = (
            _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            and _libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1
        )
        os._exit(0 if ok else 1)
    found["no_new_privs"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return found


def world_writable_dirs() -> list[str]:
    """World-writable directories a sandbox could share with another (or leave data in).

    Scanned: the entries of ``SCANNED`` (``/``, ``/run``, ``/var``, ``/dev``) one level deep,
    and every mount point with its direct subdirectories (symbolic links resolved, e.g.
    ``/var/lock`` -> ``/run/lock``); ``PRIVATE`` and ``/proc``, ``/sys`` are left out. A
    world-writable directory deeper than that on a writable mount is not found -- but every
    mount except the sandbox's own tmpfs is remounted read-only, so it cannot be written.
    """
    candidates = set()
    for top in [*SCANNED, *mount_points()]:
        if top.startswith(("/proc", "/sys")) or not os.path.isdir(top):
            continue
        candidates.add(top)
        try:
            with os.scandir(top) as entries:
                candidates.update(os.path.join(top, e.name) for e in entries)
        except OSError:
            continue
    found = set()
    for path in candidates:
        real = os.path.realpath(path)
        if real.startswith(("/proc", "/sys")) or any(real == p or real.startswith(p + "/") for p in PRIVATE):
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        if os.path.isdir(real) and st.st_mode & 0o002:
            found.add(real)
    return sorted(found)


def mount_points() -> list[str]:
    """Mount points of this mount namespace, from ``/proc/self/mountinfo`` (``\\040`` decoded)."""
    points = []
    with open("/proc/self/mountinfo") as file:
        for line in file:
            field = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field))
    return points


def _loopback_up() -> None:
    """Bring ``lo`` up in a new network namespace (it starts down): md.launch uses 127.0.0.1."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _read_only_except(writable: set[str]) -> None:
    """Remount every mount of the namespace read-only but the ``writable`` ones and ``/proc``.

    A bind remount keeps the mount's other flags (nosuid, nodev, noexec) -- they are passed
    again, as the kernel requires. Device nodes on a read-only ``/dev`` stay usable. A mount
    hidden under another one (the real ``/tmp``) cannot be reached by path; the top one is.
    """
    flag_of = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as file:
        lines = file.readlines()
    for line in lines:
        fields = line.split()
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point in writable or point == "/proc" or point.startswith("/proc/"):
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for option in fields[5].split(","):
            flags |= flag_of.get(option, 0)
        # A mount covered by a later one at the same place, or below a covered one, answers
        # EINVAL / ENOENT: it is unreachable anyway.
        _libc.mount(None, point.encode(), None, flags, None)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {target}: {os.strerror(errno)}")


def enter(workdir: str, limits: Limits, isolation: Isolation) -> None:
    """Confine, limit and drop privileges -- in the process about to exec the sandboxed command.

    It runs in a fresh interpreter (``python sandbox.py CONFIG -- COMMAND``), not in a
    ``preexec_fn``: forking a multi-threaded grader and running Python before exec can deadlock.

    Isolated, this process unshares the namespaces, mounts, then forks: the child is PID 1 of
    the new PID namespace (``_init``), which returns here only in *its* child, the process that
    execs the command; this process stays outside, waits for init and exits with its status.
    """
    _join_cgroups(isolation.cgroup_procs)
    os.umask(0o022)  # the grader's own umask (077) would make the mount points unreachable
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the grader's thread
    if isolation.enabled:
        # Before unshare(CLONE_NEWPID): after it, this process may start no thread (EINVAL),
        # and importing minidist starts OpenBLAS's.
        held = _needed_under_tmp()
        needed = [workdir, sys.prefix, sys.base_prefix, *held]
        visible = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, _library_folder())})
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        joined = {flag for flag in NAMESPACES.values() if _libc.unshare(flag) == 0}
        if CLONE_NEWNET in joined:  # each namespace where the kernel allows it (reported at start)
            _loopback_up()
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        for source, target in isolation.overlays:  # first: every later view of the library has them
            _mount(source, target, None, MS_BIND)
        shared = [p for p in world_writable_dirs() if not any(_within(n, p) for n in needed)]
        kept = _hold(held)  # the venv and minidist, when the repo is under /tmp
        # A fresh tmpfs replaces /var/tmp (or /tmp), and the working directory is bound into
        # it *before* anything is hidden: the output folder that holds it may be hidden next.
        work = work_mount(workdir)
        stage = os.path.dirname(work)
        _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=1777")
        os.mkdir(work, 0o755)
        _mount(workdir, work, None, MS_BIND)
        _only_visible(visible, stage, skip={"/mnt"} if kept else set())
        for path in isolation.hide:
            if os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
        for path in ("/tmp", "/var/tmp"):
            if path != stage and os.path.isdir(path):
                _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=1777")
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits.shm_bytes},mode=1777")
        for path in shared:
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=1777")
        for holder, path in kept:  # put them back where the interpreter expects them
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(holder, path, None, MS_BIND | MS_REC)
        writable = {"/tmp", "/var/tmp", "/dev/shm", stage, work, *shared}
        if CLONE_NEWPID in joined:
            _init(writable)  # returns only in the process that execs the command
        else:
            _read_only_except(writable)
        os.chdir(work)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
    if isolation.enabled and isolation.uid is not None:
        _drop(isolation, limits)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # setuid binaries no longer elevate
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _join_cgroups(procs_files: tuple[str, ...]) -> None:
    """Move this process into the sandbox's cgroups: its pid into each ``cgroup.procs`` file.

    First thing in ``enter``, while this process is still root (only root may write there),
    single-threaded and before any namespace exists or anything of the submission runs: every
    process the sandbox starts from here on -- init, the harness, the workers, whatever they
    fork, ``setsid`` or not -- is born in the groups and cannot leave them (every other group's
    ``cgroup.procs`` is root's). With cgroup v1, pages this interpreter touched before the move
    (its own start-up) stay charged to the grader's memory group; all later ones count here.
    A failed write raises: a sandbox outside its limits must not run.
    """
    pid = str(os.getpid())
    for path in procs_files:
        with open(path, "w") as file:
            file.write(pid)


def _drop(isolation: Isolation, limits: Limits) -> None:
    """Become the sandbox's own unprivileged user (and check that root is gone for good)."""
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    os.setgroups([])
    os.setgid(isolation.gid)
    os.setuid(isolation.uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise OSError("could not drop root privileges")


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or below it (both resolved): such a folder is not covered
    by a tmpfs (it holds what the sandbox needs); it becomes read-only with its mount."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _init(writable: set[str]) -> None:
    """Fork PID 1 of the new PID namespace; this (outer) process waits for it and exits with its code.

    Init mounts a fresh ``/proc`` (only the namespace's processes), makes everything but
    ``writable`` read-only, forks the process that returns to ``enter`` (and execs the
    command) and reaps: every orphan of the namespace is its child. Init stays root: the
    sandbox user can neither signal nor trace it (and the kernel ignores signals sent to a
    namespace's init from inside). When the command ends, init reports its wait status to
    the outer process through a pipe and exits; the kernel then kills the rest.
    """
    read, write = os.pipe()
    pid = os.fork()
    if pid != 0:  # outer: in the host PID namespace, the process the grader's Popen started
        os.close(write)
        _, status = os.waitpid(pid, 0)
        reported = os.read(read, 16)
        if reported:  # the command's own wait status, as init saw it
            status = int(reported)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:  # killed by a signal: end the same way, so Popen's returncode says which
            if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
                signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)
    os.close(read)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the outer process killed: all die
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _read_only_except(writable)
    command = os.fork()
    if command == 0:
        os.close(write)
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    status = None
    while status is None:
        try:
            done, how = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if done == command:
            status = how
    os.write(write, str(status if status is not None else 1 << 8).encode())
    os._exit(0)


#: top-level folders of the system that a sandbox sees (read-only); every other one is covered
SYSTEM = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/dev", "/proc", "/sys")
SYSTEM += ("/run", "/tmp", "/var", "/boot")


def _library_folder() -> str:
    """The folder minidist is imported from (``lib/`` of a checkout, or site-packages)."""
    import minidist

    return os.path.dirname(os.path.dirname(os.path.realpath(minidist.__file__)))


def _only_visible(visible: list[str], stage: str, skip: set[str]) -> None:
    """Cover every top-level folder but the system's (``SYSTEM``) with an empty tmpfs, then
    bind back the folders of ``visible`` (the Python installation, the virtual environment,
    the library) at their places: the sandbox sees what it runs on and nothing else -- not a
    course checkout's ``solutions/`` or ``grader/``, not another user's files -- wherever they
    are. An allowlist: a folder nobody thought of is hidden too. ``skip``: top-level folders
    already private (``/mnt`` holding ``_hold``'s binds).

    A folder of ``visible`` is first bound to a holder on the stage (its own bind mounts, the
    stand-ins of ``stubs.py``, go with it), then put back inside the tmpfs, whose folders
    (mode 0755) anyone may traverse: a Python under ``/root`` needs no other exposure."""
    tops = sorted(
        path
        for path in (os.path.join("/", name) for name in os.listdir("/"))
        if os.path.isdir(path) and not os.path.islink(path) and path not in SYSTEM and path not in skip
    )
    for top in tops:
        inside = [path for path in visible if _within(path, top)]
        held = []
        for index, path in enumerate(inside):
            holder = os.path.join(stage, f".visible-{os.path.basename(top)}-{index}")
            os.mkdir(holder, 0o755)
            _mount(path, holder, None, MS_BIND | MS_REC)
            held.append((holder, path))
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for holder, path in held:
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(holder, path, None, MS_BIND | MS_REC)


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
    given = config["isolation"]
    isolation = Isolation(
        **{
            **given,
            "hide": tuple(given["hide"]),
            "cgroup_procs": tuple(given["cgroup_procs"]),
            "overlays": tuple(tuple(pair) for pair in given["overlays"]),
        }
    )
    enter(config["workdir"], limits, isolation)
    command = argv[argv.index("--") + 1 :]
    os.execv(command[0], command)


if __name__ == "__main__":
    _main(sys.argv[1:])
