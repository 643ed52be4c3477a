"""Create or update the course's virtual environment (.venv). Run by `make`.

Idempotent: each step is skipped when already done, so `make test` costs
nothing extra once the environment is in place.

Which torch:
* a torch that the environment already has is kept (e.g. a CUDA build you
  installed yourself: if the Python that creates .venv can import torch, the
  venv is created with --system-site-packages so it sees that torch);
* otherwise torch==<pinned> is installed: from a local wheel when pip is
  configured with one (the course machines), else on Linux without an NVIDIA
  driver from PyTorch's CPU index (about 200 MB instead of several GB of CUDA
  libraries), else from PyPI. MINIDIST_TORCH_INDEX overrides the index.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def can_import(python: Path | str, module: str) -> bool:
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    return probe.returncode == 0


def install_torch(python: Path, version: str) -> None:
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    spec = f"torch=={version}"
    if os.environ.get("MINIDIST_TORCH_INDEX"):
        run([*pip, spec, "--index-url", os.environ["MINIDIST_TORCH_INDEX"]])
        return
    # 1. a wheel pip already knows about locally (find-links): take torch from it,
    #    then its dependencies from the index as usual
    if run([*pip, "--no-index", "--no-deps", spec], check=False).returncode == 0:
        run([*pip, spec])
        return
    # 2. Linux without an NVIDIA driver: the CPU-only build (its +cpu local version
    #    ranks above the CUDA one on the default index, dependencies come from there)
    if sys.platform.startswith("linux") and shutil.which("nvidia-smi") is None:
        cpu = [*pip, spec, "--extra-index-url", CPU_INDEX, "--retries", "1", "--timeout", "30"]
        if run(cpu, check=False).returncode == 0:
            return
    # 3. PyPI (CPU build on macOS and Windows, CUDA build on Linux)
    run([*pip, spec])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--venv", default=str(ROOT / ".venv"))
    args = parser.parse_args()
    venv = Path(args.venv)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_version = config["tool"]["minidist"]["torch"]

    python = venv_python(venv)
    if not python.exists():
        inherit = can_import(sys.executable, "torch")
        if inherit:
            print(f"{sys.executable} already has torch: .venv will use it (--system-site-packages)")
        run([sys.executable, "-m", "venv", *(["--system-site-packages"] if inherit else []), str(venv)])

    if can_import(python, "torch"):
        version = subprocess.run(
            [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip()
        print(f"keeping the installed torch {version}")
    else:
        install_torch(python, torch_version)

    stamp = venv / ".minidist-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != digest or not can_import(python, "minidist"):
        run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", f"{ROOT}[dev]"])
        stamp.write_text(digest)
    print(f"environment ready: {venv}")


if __name__ == "__main__":
    main()
