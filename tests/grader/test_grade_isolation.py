"""Sandboxes that cannot reach each other (issue 15): per-sandbox network, IPC and PID
namespaces, no_new_privs, private tmpfs over world-writable directories, a read-only rest.

Each test runs one command through ``sandbox.run`` and looks from inside. The attackers of
``grader/examples/a1_collectives/isolation.py`` are graded beside the solution in
``tests/grader/batches/test_hostile.py``'s batch. Skipped unless the grader can isolate here (root, with
namespaces).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from grader import grade, sandbox

PROTECTIONS = sandbox.probe_protections() if sys.platform == "linux" else {}
pytestmark = pytest.mark.skipif(
    not PROTECTIONS or not all(PROTECTIONS.values()),
    reason=f"needs root with mount, network, IPC and PID namespaces and no_new_privs: {PROTECTIONS}",
)
UID = grade.UID_BASE + 15  # the last slot: the grading batches of the tests never use it


def run_inside(tmp_path: Path, code: str) -> sandbox.RunResult:
    """Run ``python -c code`` isolated under a sandbox uid (holding the sandbox users' lock)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    os.chown(work, UID, grade.GID)
    os.chmod(tmp_path, 0o755)
    isolation_ = sandbox.Isolation(True, UID, grade.GID, ())
    limits = sandbox.Limits(wall_seconds=60)
    with grade.sandbox_users(True):
        return sandbox.run([sys.executable, "-c", code], work, dict(os.environ), limits, isolation_)


@pytest.mark.timeout(400)  # the sandbox users' lock may be held by another grading run
def test_a_sandbox_sees_only_its_own_processes(tmp_path):
    marker = f"minidist-visible-{os.getpid()}"
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        code = (
            "import os\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "texts = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
            f"print(pids, any(b'{marker[:9]}' + b'{marker[9:]}' in t for t in texts))\n"
        )
        result = run_inside(tmp_path, code)
    finally:
        outside.kill()
        outside.wait(timeout=10)
    assert result.status == "ok", result.stderr
    # PID 1 is the sandbox's init, the command is its child; the outside process is invisible
    assert result.stdout.split() == ["[1,", "2]", "False"], result.stdout


@pytest.mark.timeout(400)
def test_a_sandbox_has_its_own_loopback(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "with socket.socket() as own:\n"  # its own loopback works (lo is up)
            "    own.bind(('127.0.0.1', 0)); own.listen()\n"
            "    socket.create_connection(own.getsockname(), timeout=5).close()\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5)\n"
            "    print('reached')\n"
            "except ConnectionRefusedError:\n"
            "    print('refused')\n"
        )
        result = run_inside(tmp_path, code)
    assert result.status == "ok", result.stderr
    assert result.stdout.strip() == "refused"


@pytest.mark.timeout(400)
def test_only_private_places_are_writable_and_no_new_privs(tmp_path):
    deep = Path("/var/cache") / f"minidist-isolation-{os.getpid()}"  # world-writable, not scanned
    deep.mkdir(mode=0o1777)
    os.chmod(deep, 0o1777)
    try:
        places = ["work-file", "/tmp/x", "/var/tmp/x", "/dev/shm/x", "/run/lock/x", str(deep / "x"), "/x"]
        code = (
            "import errno, os\n"
            f"for place in {places!r}:\n"
            "    try:\n"
            "        open(place, 'w').write('x'); print(place, 'ok')\n"
            "    except OSError as e:\n"
            "        print(place, errno.errorcode[e.errno])\n"
            "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
            "print('NoNewPrivs', status['NoNewPrivs'].strip())\n"
        )
        result = run_inside(tmp_path, code)
        assert list(deep.iterdir()) == []
    finally:
        for leftover in deep.iterdir():
            leftover.unlink()
        deep.rmdir()
    assert result.status == "ok", result.stderr
    seen = dict(line.split() for line in result.stdout.splitlines())
    assert seen == {
        "work-file": "ok",
        "/tmp/x": "ok",
        "/var/tmp/x": "ok",
        "/dev/shm/x": "ok",
        "/run/lock/x": "ok",  # a private tmpfs: gone with the sandbox
        str(deep / "x"): "EROFS",
        "/x": "EROFS",
        "NoNewPrivs": "1",
    }
    assert not Path("/run/lock/x").exists()
