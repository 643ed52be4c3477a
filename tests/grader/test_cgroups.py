"""grader/cgroups.py against the kernel's own files: limits written, members listed, kill, removal."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from grader import cgroups, sandbox

#: not the grader's prefix: a grading run starting beside these tests removes its stale groups
TEST_PREFIX = "minidist-cgtest-"
needs_cgroups = pytest.mark.skipif(
    not (hasattr(os, "geteuid") and os.geteuid() == 0 and all(cgroups.probe().values())),
    reason="needs root and cgroup v1 controllers memory, cpu and pids that can be created here",
)


def _join(group: cgroups.SandboxGroup) -> str:
    """Shell code that moves the shell into every directory of the group (as sandbox.enter does)."""
    return "".join(f"echo $$ > {path} ; " for path in group.procs_files)


def _run_in_sandbox(tmp_path, command: list[str], procs: tuple[str, ...]) -> sandbox.RunResult:
    """``sandbox.run`` without namespaces or a private user, joining the ``procs`` files."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    limits = sandbox.Limits(wall_seconds=60, cpu_seconds=60)
    return sandbox.run(command, tmp_path, env, limits, sandbox.Isolation(False, cgroup_procs=procs))


@needs_cgroups
def test_the_sandbox_joins_its_groups_before_the_command_runs(tmp_path):
    """The command, and a process it starts in a new session, are in every group of the sandbox
    (the kernel's /proc/PID/cgroup says so); the grader itself never is."""
    script = "setsid sh -c 'cat /proc/self/cgroup > inner' & wait; cat /proc/self/cgroup"
    with cgroups.SandboxGroup.create(f"test-{os.getpid()}-j", 256 * 2**20, 1024, 64, TEST_PREFIX) as group:
        result = _run_in_sandbox(tmp_path, ["/bin/sh", "-c", script], group.procs_files)
        assert result.status == "ok", result.stderr
        for text in (result.stdout, (tmp_path / "inner").read_text()):
            lines = {names: path for _, names, path in (line.split(":", 2) for line in text.splitlines())}
            for controller, directory in group.dirs.items():
                path = next(path for names, path in lines.items() if controller in names.split(","))
                assert path.endswith("/" + group.name) and directory.name == group.name
        assert os.getpid() not in group.pids()
    assert group.name not in open("/proc/self/cgroup").read()


@needs_cgroups
def test_a_sandbox_that_cannot_join_does_not_run_its_command(tmp_path):
    missing = str(tmp_path / "no-such-group" / "cgroup.procs")
    result = _run_in_sandbox(tmp_path, ["/bin/sh", "-c", "echo ran"], (missing,))
    assert result.status == "crashed" and "ran" not in result.stdout
    assert "no-such-group" in result.stderr


@needs_cgroups
def test_limits_are_written_under_our_own_group():
    with cgroups.SandboxGroup.create(f"test-{os.getpid()}-a", 123 * 2**20, 700, 42, TEST_PREFIX) as group:
        assert set(group.dirs) == {"memory", "cpu", "pids"}
        for controller, path in group.dirs.items():
            own = cgroups._own_path(controller)
            assert path.parent == own
        assert int((group.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 123 * 2**20
        assert int((group.dirs["cpu"] / "cpu.shares").read_text()) == 700
        assert (group.dirs["pids"] / "pids.max").read_text().strip() == "42"
        paths = [group.dirs[c] for c in group.dirs]
    assert not any(path.exists() for path in paths)


@needs_cgroups
def test_members_listed_and_killed_then_removed():
    group = cgroups.SandboxGroup.create(f"test-{os.getpid()}-b", 256 * 2**20, 1024, 64, TEST_PREFIX)
    try:
        # a shell joins, then starts three sleepers in new sessions (as a hostile sandbox would)
        script = _join(group) + "for i in 1 2 3; do setsid sleep 60 & done; echo ready; wait"
        proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while len(group.pids()) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        members = group.pids()
        assert proc.pid in members and len(members) == 4
        assert group.kill_all(time.monotonic() + 10) == 4
        assert group.pids() == set()
        proc.wait(timeout=10)
        proc.stdout.close()
    finally:
        group.kill_all(time.monotonic() + 10)
        assert group.remove() == 3
    assert group.dirs == {}


@needs_cgroups
def test_pids_max_stops_forking():
    """pids.max 5: of 20 forks from one process in the group, exactly 4 succeed (5 with it)."""
    code = (
        "import os, time\n"
        "ok = failed = 0\n"
        "for i in range(20):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except BlockingIOError:\n"
        "        failed += 1\n"
        "        continue\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    ok += 1\n"
        "print(ok, failed, flush=True)\n"
        "time.sleep(30)\n"  # stay in the group while it is counted (killed at the end)
    )
    with cgroups.SandboxGroup.create(f"test-{os.getpid()}-c", 256 * 2**20, 1024, 5, TEST_PREFIX) as group:
        script = _join(group) + f'exec {sys.executable} -c "$0"'
        proc = subprocess.Popen(["sh", "-c", script, code], stdout=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline().split()
            assert [int(word) for word in line] == [4, 16]
            assert len(group.pids()) == 5
        finally:
            group.kill_all(time.monotonic() + 10)
            proc.wait(timeout=10)
            proc.stdout.close()


@needs_cgroups
def test_memory_limit_kills_and_tmpfs_pages_are_charged(tmp_path):
    """300 MB written to a private tmpfs under a 200 MB limit: the group is OOM-killed, not us."""
    mount = tmp_path / "shm"
    mount.mkdir()
    with cgroups.SandboxGroup.create(f"test-{os.getpid()}-d", 200 * 2**20, 1024, 64, TEST_PREFIX) as group:
        # a private mount namespace so the tmpfs goes away with the process
        code = (
            "import os\n"
            "chunk = b'x' * 2**20\n"
            f"with open('{mount}/fill', 'wb', buffering=0) as f:\n"
            "    for i in range(300):\n"
            "        f.write(chunk)\n"
            "print('wrote all')\n"
        )
        script = _join(group) + f'mount -t tmpfs -o size=1g tmpfs {mount} && exec {sys.executable} -c "$0"'
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, code],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "wrote all" not in out.stdout
        assert out.returncode != 0
        assert group.oom_killed()
        peak = group.peak_memory()
        assert peak is not None and 150 * 2**20 < peak <= 200 * 2**20


@needs_cgroups
def test_stale_groups_are_removed():
    """Only groups with the prefix go (a grader running beside this test keeps its own)."""
    name = f"test-{os.getpid()}-stale"
    stale = cgroups.SandboxGroup.create(name, 2**30, 1024, 64, TEST_PREFIX)
    other = cgroups.SandboxGroup.create(name.replace("stale", "other"), 2**30, 1024, 64, TEST_PREFIX)
    paths = list(stale.dirs.values())
    try:
        assert cgroups.remove_stale(TEST_PREFIX + name) == 3
        assert not any(path.exists() for path in paths)
        assert all(path.exists() for path in other.dirs.values())
    finally:
        other.remove()
    assert not any(path.exists() for path in paths)


@pytest.mark.skipif(not (hasattr(os, "geteuid") and os.geteuid() == 0), reason="mounting needs root")
def test_working_directories_left_by_a_killed_grader_are_unmounted(tmp_path):
    """grade.unmount_stale detaches the tmpfs under OUT/.sandbox (deepest first), nothing else."""
    from grader import grade

    def mounted() -> set[str]:
        return {point for point in sandbox.mount_points() if point.startswith(str(tmp_path))}

    work_root, beside = tmp_path / "out" / ".sandbox", tmp_path / "beside"
    outer, inner = work_root / "abc", work_root / "abc" / "results"
    for path in (outer, beside):
        path.mkdir(parents=True)
    try:
        cgroups.mount_tmpfs(outer, "1m")
        inner.mkdir()
        cgroups.mount_tmpfs(inner, "1m")
        cgroups.mount_tmpfs(beside, "1m")
        assert grade.unmount_stale(work_root) == [str(inner), str(outer)]
        assert mounted() == {str(beside)}
        assert grade.unmount_stale(work_root) == []
    finally:
        for point in sorted(mounted(), key=len, reverse=True):
            cgroups.unmount(point)
