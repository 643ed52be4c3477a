"""Sandboxes that cannot reach each other (issue 15): per-sandbox network, IPC and PID
namespaces, no_new_privs, private tmpfs over world-writable directories, a read-only rest.

Each test runs one command through ``sandbox.run`` and looks from inside. The attackers of
``grader/examples/a1_collectives/isolation.py`` are graded beside the solution in
``tests/grader/batches/test_hostile.py``'s batch. Skipped unless the grader can isolate here (root, with
namespaces).
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

import minidist.parallel.ddp
import minidist.parallel.offload
from grader import grade, guard, sandbox, stubs
from grader.a3_ddp import rules as a3_rules

PROTECTIONS = sandbox.probe_protections() if sys.platform == "linux" else {}
pytestmark = pytest.mark.skipif(
    not PROTECTIONS or not all(PROTECTIONS.values()),
    reason=f"needs root with mount, network, IPC and PID namespaces and no_new_privs: {PROTECTIONS}",
)
UID = grade.UID_BASE + 15  # the last slot: the grading batches of the tests never use it


def run_inside(tmp_path: Path, code: str, overlays=()) -> sandbox.RunResult:
    """Run ``python -c code`` isolated under a sandbox uid (holding the sandbox users' lock)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    os.chown(work, UID, grade.GID)
    os.chmod(tmp_path, 0o755)
    isolation_ = sandbox.Isolation(True, UID, grade.GID, (), overlays=tuple(overlays))
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


@pytest.mark.timeout(400)
def test_a_forbidden_module_is_its_stand_in_by_every_route(tmp_path):
    """a3's forbidden modules covered (issue 25): an import, open, torch.from_file and a child
    process all get the stand-in; the real file's code is nowhere in the sandbox."""
    overlays = stubs.build(a3_rules, tmp_path / "stubs")
    real = Path(minidist.parallel.ddp.__file__).resolve()
    assert (str(real) in dict((t, s) for s, t in overlays)) and "def " in real.read_text()
    code = (
        "import subprocess, sys, torch\n"
        f"path = {str(real)!r}\n"
        "size = len(open(path, 'rb').read())\n"
        "texts = [open(path).read(), bytes(torch.from_file(path, size=size, dtype=torch.uint8)).decode(),\n"
        "         subprocess.run(['cat', path], capture_output=True, text=True).stdout]\n"
        'print(all(t.startswith(\'"""Covered by the grader\') for t in texts), len(set(texts)))\n'
        "from minidist.parallel.ddp import DistributedDataParallel\n"
        "try:\n"
        "    DistributedDataParallel(torch.nn.Linear(2, 2), None)\n"
        "except PermissionError as error:\n"
        "    print(str(error).split(' is ')[0])\n"
    )
    result = run_inside(tmp_path, code, overlays)
    assert result.status == "ok", result.stderr
    assert result.stdout.split("\n")[:2] == ["True 1", f"{guard.MARKER} minidist.parallel.ddp"]


def test_a_stand_in_keeps_a_subclass_of_the_same_module_once():
    """``LocalSGD(DiLoCo)``: the stand-in of ``local_sgd.diloco`` names its own ``DiLoCo`` as the
    base, once, and never the real one (a9's helper found "duplicate base class DiLoCo": the base
    was listed both by name and as an import of the real module)."""
    module = importlib.import_module("minidist.parallel.local_sgd.diloco")
    source = stubs.stand_in(module, ["minidist.parallel.local_sgd"], "refused here")
    namespace: dict = {}
    exec(compile(source, "stand_in", "exec"), namespace)
    assert namespace["LocalSGD"].__bases__ == (namespace["DiLoCo"],)
    assert "local_sgd.diloco', fromlist=['DiLoCo']" not in source
    with pytest.raises(PermissionError):
        namespace["LocalSGD"](None, None, None, 1)


def test_a_forbidden_package_with_a_command_line_gets_a_stand_in_without_running_it(tmp_path, capsys):
    """``minidist.parallel.offload`` has a ``__main__.py``: building the stand-ins must not import
    (run) it, and its file is covered by one that refuses (a7's helper found the crash)."""
    rules = types.SimpleNamespace(FORBIDDEN_MODULES=("minidist.parallel.offload",), ALLOWED_INSTEAD="")
    overlays = dict((t, s) for s, t in stubs.build(rules, tmp_path / "stubs"))
    main = str(Path(minidist.parallel.offload.__file__).resolve().parent / "__main__.py")
    assert main in overlays and "minidist.parallel.offload.__main__" not in sys.modules
    stand_in = Path(overlays[main]).read_text()
    assert stand_in.startswith("raise ImportError(") and guard.MARKER in stand_in
    assert not capsys.readouterr().out  # the command line printed nothing: it did not run


@pytest.mark.timeout(400)
def test_a_sandbox_sees_the_environment_the_library_and_its_folder_only(tmp_path):
    """An allowlist (issue 25): a course checkout's solutions/ and grader/, and any folder
    outside the system's, are hidden wherever they are; Python, the venv and the library are not."""
    root = Path(grade.ROOT)
    secret_home = Path("/srv") if Path("/srv").is_dir() else Path("/opt")
    secret = secret_home / f"minidist-secret-{os.getpid()}"
    secret.mkdir()
    (secret / "answer.py").write_text("ANSWER = 42\n")
    try:
        places = [
            root / "solutions",
            root / "grader",
            secret / "answer.py",
            root / "lib" / "minidist" / "__init__.py",
            Path(sys.prefix) / "bin",
            Path(sys.base_prefix) / "lib",
        ]
        code = f"import os\nfor place in {[str(p) for p in places]!r}:\n    print(os.path.exists(place))\n"
        result = run_inside(tmp_path, code)
    finally:
        (secret / "answer.py").unlink()
        secret.rmdir()
    assert result.status == "ok", result.stderr
    assert result.stdout.split() == ["False", "False", "False", "True", "True", "True"], result.stdout


@pytest.mark.timeout(400)
def test_a_killed_command_is_reported_by_its_signal(tmp_path):
    result = run_inside(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert (result.status, result.returncode) == ("crashed", -9)
    assert "Traceback" not in result.stderr, result.stderr
    assert grade.signal_name(-result.returncode) == "SIGKILL"
