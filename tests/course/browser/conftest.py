"""JupyterLab in headless Chromium, as a student uses it (marker `browser`, `make test-browser`).

    pytest ──starts──> jupyter lab (headless, free port, token, its own config/data/runtime dirs)
       │                   └── kernels ("Python (minidist)" = .venv/bin/python) ── md.launch workers
       └──playwright──> node driver ── chromium (the system's, --no-sandbox as root)

The lab serves a temporary copy of the course (notebooks/, assignments/a1_collectives/), so a
run never writes into the repository; it reads the course's shipped settings (jupyter/) the way
`make lab` does. At the end everything started here is stopped, and a test fails if a process
is left: the lab server, the browser and every kernel.

Without Chromium or the playwright package the tests skip and say how to enable them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

ROOT = Path(__file__).resolve().parents[3]
ARTIFACTS = ROOT / "browser-artifacts"
TOKEN = "minidist-browser-test"
ENABLE = "run `make test-browser` (it installs Chromium with apt-get when run as root)"
START_TIMEOUT = 120  # s: the lab server answering /api/status on a busy machine
UI_TIMEOUT = 60_000  # ms: one UI element appearing (the lab's first load builds its page)
GET_RETRIES = 10  # a GET answered 500 while a kernel starts (see Lab.api) is asked again, 0.5 s apart


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float = 5.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def find_chromium() -> str | None:
    """The system's Chromium (MINIDIST_CHROMIUM overrides): playwright never downloads one here."""
    if os.environ.get("MINIDIST_CHROMIUM"):
        return shutil.which(os.environ["MINIDIST_CHROMIUM"])
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop(procs: list[psutil.Process], grace: float = 10.0) -> list[psutil.Process]:
    """SIGTERM, wait, SIGKILL what is left; returns the processes that needed SIGKILL."""
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return alive


class Lab:
    """A running `jupyter lab` on a copy of the course; `url(path)` opens a notebook in it."""

    def __init__(self, base: str, root: Path, server: subprocess.Popen, log: Path):
        self.base, self.root, self.server, self.log = base, root, server, log
        self.headers = {"Authorization": f"token {TOKEN}"}

    def url(self, path: str = "") -> str:
        tree = f"/tree/{path}" if path else ""
        return f"{self.base}/lab{tree}?reset&token={TOKEN}"

    def api(self, method: str, path: str) -> requests.Response:
        """One REST call; a GET that meets a server error is asked again (up to GET_RETRIES times).

        jupyter_server (2.21) lists a kernel that is still starting before it sets the kernel's
        `last_activity`, so a `GET /api/kernels` at that moment answers 500 (a TraitError in
        `kernel_model`, which `list_kernels` does not catch). Polling the list while 8 kernels
        started one after another met it 3 times in 6,014 requests here; CI met it once. A GET
        changes nothing, so asking again is safe; an error that stays is raised with the log.
        """
        for attempt in range(GET_RETRIES + 1):
            reply = requests.request(method, f"{self.base}/api/{path}", headers=self.headers, timeout=30)
            if reply.status_code < 500 or method != "GET" or attempt == GET_RETRIES:
                break
            time.sleep(0.5)
        try:
            reply.raise_for_status()
        except requests.HTTPError as e:
            log = self.log_tail()
            raise AssertionError(f"{method} /api/{path}: {e}\nthe lab server's log ends:\n{log}") from e
        return reply

    def kernels(self) -> list[dict]:
        return self.api("GET", "kernels").json()

    def kernel_processes(self) -> list[psutil.Process]:
        """The kernels' processes (children of the lab server running ipykernel)."""
        found = []
        for proc in _tree(self.server.pid)[1:]:
            try:
                if "ipykernel_launcher" in " ".join(proc.cmdline()):
                    found.append(proc)
            except psutil.NoSuchProcess:
                continue
        return found

    def shutdown_kernels(self) -> None:
        for session in self.api("GET", "sessions").json():
            self.api("DELETE", f"sessions/{session['id']}")
        for kernel in self.kernels():
            self.api("DELETE", f"kernels/{kernel['id']}")
        assert wait_until(lambda: not _tree(self.server.pid)[1:], timeout=30), (
            f"the lab server still has children after its kernels were shut down: "
            f"{[(p.pid, p.name()) for p in _tree(self.server.pid)[1:]]}"
        )

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def _copy_course(root: Path) -> None:
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__")
    shutil.copytree(ROOT / "notebooks", root / "notebooks", ignore=ignore)
    a1 = Path("assignments") / "a1_collectives"
    shutil.copytree(ROOT / a1, root / a1, ignore=ignore)
    # the same assignment with the reference solution copied in (what a student hands in)
    solved = root / "solved" / "a1_collectives"
    shutil.copytree(ROOT / "assignments" / "a1_collectives", solved, ignore=ignore)
    shutil.copy(ROOT / "solutions" / "a1_collectives" / "collectives.py", solved / "collectives.py")


@pytest.fixture(scope="session")
def chromium_path() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip(f"the playwright package is not installed: {ENABLE}")
    path = find_chromium()
    if path is None:
        pytest.skip(f"Chromium is not installed: {ENABLE}")
    return path


# The lab server and the browser live for one test module, not the session: `make test` runs the
# rest of the suite after these tests, and its leak check (tests/conftest.py) must find neither.
@pytest.fixture(scope="module")
def lab(chromium_path, tmp_path_factory) -> Lab:
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "course"
    _copy_course(root)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_DATA_DIR": str(tmp / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTER_CONFIG_PATH": str(ROOT / "jupyter"),  # the settings the course ships, as in `make lab`
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "user-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
        "IPYTHONDIR": str(tmp / "ipython"),
        "MPLCONFIGDIR": str(tmp / "matplotlib"),
        "JUPYTER_PREFER_ENV_PATH": "0",  # this run's data dir (its kernel) before .venv/share/jupyter
    }
    # the course kernel, registered as `make lab` does, into this run's own data dir
    subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--user", "--name", "python3"]
        + ["--display-name", "Python (minidist)"],
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    # test-only: every cell in the DOM (JupyterLab may otherwise skip rendering off-screen cells)
    tracker = tmp / "user-settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))

    port = free_port()
    log = tmp / "lab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1"]
    cmd += [f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}", root, server, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if requests.get(f"{lab.base}/api/status", headers=lab.headers, timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, f"jupyter lab exited:\n{lab.log_tail()}"
            assert time.monotonic() < deadline, f"jupyter lab did not start in {START_TIMEOUT} s"
            time.sleep(0.5)
        yield lab
    finally:
        try:
            if server.poll() is None:
                lab.shutdown_kernels()
        finally:
            left = _stop(_tree(server.pid))
            server.wait(timeout=10)
        assert not left, f"the lab server or its kernels needed SIGKILL: {left}\n{lab.log_tail()}"


def _crashpad_handlers(home: Path) -> list[psutil.Process]:
    """Chromium's crash handler detaches itself (its parent becomes init): found by its database."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if str(home) in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def browser(chromium_path, lab, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    home = tmp_path_factory.mktemp("chromium")  # its config and cache (crash reports), not ~/.config
    env = {**os.environ, "XDG_CONFIG_HOME": str(home / "config"), "XDG_CACHE_HOME": str(home / "cache")}
    before = {p.pid for p in psutil.Process().children()}
    pw = sync_playwright().start()
    driver = [p for p in psutil.Process().children() if p.pid not in before]
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    chromium = pw.chromium.launch(executable_path=chromium_path, headless=True, args=args, env=env)
    chromium._driver_pids = {p.pid for p in driver}  # for no_leaks below
    try:
        yield chromium
    finally:
        procs = [proc for p in driver for proc in _tree(p.pid)] + _crashpad_handlers(home)
        chromium.close()
        pw.stop()
        _, alive = psutil.wait_procs(procs, timeout=15)
        left = _stop(alive)
        assert not left, f"the browser or playwright's driver did not exit: {left}"


@pytest.fixture
def page(browser, lab, request):
    """A fresh browser tab; a screenshot of it lands in browser-artifacts/ if the test fails."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(UI_TIMEOUT)
    tab = context.new_page()
    try:
        yield tab
    finally:
        if getattr(request.node, "failed_call", False):
            ARTIFACTS.mkdir(exist_ok=True)
            tab.screenshot(path=str(ARTIFACTS / f"FAILED-{request.node.name}.png"), full_page=True)
        context.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        item.failed_call = True
    return report


@pytest.fixture(autouse=True)
def no_leaks(request):
    """tests/conftest.py's check, knowing the session's lab server and browser.

    After each test every kernel is shut down; then nothing but the lab server itself and the
    browser (under playwright's driver) may be left among this process's descendants.
    """
    shm_before = shm_files()
    yield
    if "lab" not in request.fixturenames:
        return
    lab = request.getfixturevalue("lab")
    lab.shutdown_kernels()
    allowed = {lab.server.pid}
    if "browser" in request.fixturenames:
        allowed |= {p.pid for pid in request.getfixturevalue("browser")._driver_pids for p in _tree(pid)}

    def leftovers():
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in allowed]

    assert wait_until(lambda: not leftovers(), timeout=10), f"processes left behind: {leftovers()}"
    assert wait_until(lambda: not (shm_files() - shm_before)), (
        f"shared-memory files left behind: {sorted(shm_files() - shm_before)}"
    )
