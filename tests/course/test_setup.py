"""The repository's setup: pinned versions agree, the lab serves the notebooks, CI calls make test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import requests
import torch
import yaml

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins(requirements: list[str]) -> dict[str, str]:
    pins = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(==|>=)\s*([^\s;]+)", req.strip())
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def test_environment_yml_names_the_same_versions_as_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_deps = [d for d in env["dependencies"] if isinstance(d, str)]
    pip_deps = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    env_pins = _pins([d for d in pip_deps if not d.startswith("-")])
    project = PYPROJECT["project"]
    wanted = _pins([d for d in project["dependencies"] if "==" in d])
    wanted |= _pins(project["optional-dependencies"]["dev"])
    wanted["torch"] = PYPROJECT["tool"]["minidist"]["torch"]
    assert env_pins == wanted
    assert f"python={PYPROJECT['tool']['minidist']['python']}" in conda_deps
    assert "-e ." in pip_deps  # the course library itself


def test_installed_versions_are_the_pinned_ones():
    from importlib.metadata import version

    for name, pinned in _pins(PYPROJECT["project"]["optional-dependencies"]["dev"]).items():
        assert version(name) == pinned, name


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine may keep its CUDA torch")
def test_cpu_machine_has_the_cpu_build_of_torch():
    assert torch.version.cuda is None, "a CUDA build of torch was installed on a machine without a GPU"
    assert torch.__version__.split("+")[0] == PYPROJECT["tool"]["minidist"]["torch"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme
    testing = re.search(r"^## Testing\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert testing and "`make test`" in testing.group(1), "the README's Testing section must say `make test`"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_setup_is_idempotent():
    """A second run with nothing changed installs nothing."""
    venv = Path(sys.prefix)
    if not (venv / ".minidist-installed").exists():
        pytest.skip("not running from the venv made by scripts/setup_venv.py")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "setup_venv.py"), "--venv", str(venv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "keeping the installed torch" in result.stdout
    assert "pip install" not in result.stdout


@pytest.mark.timeout(180)
def test_jupyterlab_serves_notebook_01(tmp_path):
    port, token = free_port(), "minidist-test-token"
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={ROOT / 'notebooks'}",
            "--allow-root",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"token {token}"}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{base}/api/status", headers=headers, timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None, server.stdout.read().decode()
            assert time.monotonic() < deadline, "JupyterLab did not start within 120 s"
            time.sleep(0.5)
        reply = requests.get(
            f"{base}/api/contents/01_processes_pipes_shared_memory.ipynb", headers=headers, timeout=30
        )
        assert reply.status_code == 200
        notebook = reply.json()
        assert notebook["type"] == "notebook"
        assert len(notebook["content"]["cells"]) > 10
        assert requests.get(f"{base}/lab", headers=headers, timeout=30).status_code == 200
        assert (
            requests.get(
                f"{base}/api/contents/01_processes_pipes_shared_memory.ipynb", timeout=30
            ).status_code
            == 403
        )  # and nobody without the token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()
