"""The sandbox side of grading: run each job, write what came back as JSON + ``.npy`` files.

Run as ``python harness.py spec.json results/`` inside the sandbox's working directory, which
holds the student's files and the assignment's worker modules (``SANDBOX_FILES``) -- nothing
else of the grader. This file is copied there and must stay standalone: it imports only the
standard library, numpy, torch and minidist, never ``grader``.

It does not import the student's code either: the worker modules do, inside the processes
``md.launch`` starts. Still, it runs in the student's sandbox, so the grader trusts nothing it
writes: the files are parsed as data (``json``, ``numpy.load(allow_pickle=False)``) and every
value is checked by the grader against references it computes itself.

Wire format, per job ``<id>``: ``<id>.json`` holds ``{"value": V}`` or ``{"error": {...}}``,
where in ``V`` a tensor is ``{"$tensor": "<id>-<n>.npy", "dtype": "float32"}`` (bfloat16 is
stored as its int16 bits) and lists, dicts with string keys, numbers, strings and None are
themselves.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

import minidist as md

_AS_BITS = {torch.bfloat16: torch.int16}
MAX_TEXT = 8000  # characters of an error text kept


class Encoder:
    def __init__(self, folder: str, job_id: str) -> None:
        self.folder, self.job_id, self.count = folder, job_id, 0

    def encode(self, value):
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            if tensor.dtype in _AS_BITS:
                tensor = tensor.view(_AS_BITS[tensor.dtype])
            name = f"{self.job_id}-{self.count}.npy"
            self.count += 1
            np.save(os.path.join(self.folder, name), tensor.numpy(), allow_pickle=False)
            return {"$tensor": name, "dtype": dtype}
        if isinstance(value, dict):
            return {str(key): self.encode(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.encode(item) for item in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return {"$unsupported": type(value).__name__}


def run_job(job: dict, folder: str) -> dict:
    module = importlib.import_module(job["module"])
    worker = getattr(module, job["worker"])
    try:
        outs = md.launch(
            worker,
            job["world_size"],
            args=tuple(job["args"]),
            transport=job["transport"],
            timeout=job["timeout"],
            start_method="fork",  # this process has torch and minidist loaded: a fork costs ms, a fork
            # server seconds (its own interpreter importing both again, once per submission)
        )
    except md.WorkerError as error:
        return {
            "error": {
                "kind": "worker",
                "rank": error.rank,
                "exc_type": error.exc_type,
                "summary": error.summary[:MAX_TEXT],
                "text": str(error)[-MAX_TEXT:],
            }
        }
    except md.LaunchTimeout as error:
        return {"error": {"kind": "timeout", "text": str(error)[-MAX_TEXT:]}}
    except Exception:  # the harness itself: report, go on with the next job
        return {"error": {"kind": "harness", "text": traceback.format_exc()[-MAX_TEXT:]}}
    return {"value": Encoder(folder, job["id"]).encode(outs)}


def _import_behind_guard(name: str, stdout: int, stderr: int) -> int:
    """In the forked probe child: import ``name`` as the workers do, behind the assignment's guard
    (``guard.py``, ``rules.py``), its output into the two files; the exit code to leave with."""
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    code = 1
    try:
        import guard  # the sandbox's working directory holds them, beside this file
        import rules

        guard.install_rules(rules)
        importlib.import_module(name)
        print("probe: imported")
        code = 0
    except SystemExit as stop:  # sys.exit(n) at import time: the code a fresh interpreter would give
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _probe_one(name: str, seconds: float = 120.0) -> tuple[int | None, str, bool]:
    """(exit code or None when it did not finish, the end of its stderr, whether it finished)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()  # this process has torch loaded: a fork, not a fresh interpreter (seconds)
        if pid == 0:
            code = 1
            try:
                code = _import_behind_guard(name, out.fileno(), err.fileno())
            finally:
                os._exit(code & 0xFF)
        deadline = time.monotonic() + seconds
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                returncode = None
                break
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read()[-4 * MAX_TEXT :].decode(errors="replace")
    if returncode is None:
        stderr = f"{stderr}importing it did not finish within {seconds:g} s"
    return returncode, stderr, "probe: imported" in stdout


def probe_imports(modules: list[str], folder: str) -> bool:
    """Import each student module in a throwaway child first: code that calls
    sys.exit/os._exit or crashes at import time then gets a clear status (and the
    jobs, which would all fail the same way, are not run). The child installs the
    assignment's guard (``guard.py``, ``rules.py``) before the import, as every worker
    does: no code of the student's runs unguarded, not even here."""
    for name in modules:
        returncode, stderr, finished = _probe_one(name)
        if returncode != 0 or not finished:  # os._exit(0) at import: code 0, never finished
            with open(os.path.join(folder, "probe.json"), "w") as file:
                json.dump({"module": name, "returncode": returncode, "stderr": stderr[-MAX_TEXT:]}, file)
            return False
    return True


def main(spec_path: str, folder: str) -> int:
    with open(spec_path) as file:
        spec = json.load(file)
    for name in spec.get("preload", []):  # the assignment's, imported once here, inherited by each fork
        importlib.import_module(name)
    if not probe_imports(spec.get("probe", []), folder):
        return 0
    for job in spec["jobs"]:
        start = time.monotonic()
        record = run_job(job, folder)
        record["seconds"] = round(time.monotonic() - start, 3)
        path = os.path.join(folder, f"{job['id']}.json")
        with open(path + ".tmp", "w") as file:
            json.dump(record, file)
        os.replace(path + ".tmp", path)  # a job's record appears whole, or not at all
        print(f"harness: {job['id']} done in {record['seconds']} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
