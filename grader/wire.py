"""Read what the sandbox wrote (``harness.py``'s wire format) as plain data, never as code.

Everything here assumes the files are hostile: JSON is size-capped before it is parsed,
``.npy`` files are loaded with ``allow_pickle=False`` (no object arrays, so nothing is
unpickled), only plain file names inside the results folder are opened, only a few dtypes
are accepted, and anything unexpected becomes a ``WireError`` -- which fails the one test
whose record it is, not the grader.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

MAX_JSON_BYTES = 16 * 2**20
MAX_NPY_BYTES = 256 * 2**20
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.npy$")
DTYPES = {
    "float32": (np.float32, None),
    "float64": (np.float64, None),
    "float16": (np.float16, None),
    "bfloat16": (np.int16, torch.bfloat16),
    "int64": (np.int64, None),
    "int32": (np.int32, None),
    "int16": (np.int16, None),
    "int8": (np.int8, None),
    "uint8": (np.uint8, None),
    "bool": (np.bool_, None),
}


class WireError(Exception):
    """A record that is missing, malformed or not what the harness writes."""


def read_record(folder: Path, job_id: str) -> dict:
    """``{"value": ...}`` (tensors decoded) or ``{"error": {...}}``; WireError when unreadable."""
    path = folder / f"{job_id}.json"
    if path.is_symlink() or not path.is_file():
        raise WireError("no result was written for this test (the run was stopped before it, or crashed)")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise WireError("the result record is too large")
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise WireError(f"the result record is not valid JSON: {error}") from None
    if not isinstance(record, dict) or ("value" in record) == ("error" in record):
        raise WireError("the result record has neither a value nor an error")
    if "error" in record:
        if not isinstance(record["error"], dict):
            raise WireError("malformed error record")
        return {"error": record["error"], "seconds": _number(record.get("seconds"))}
    return {"value": _decode(record["value"], folder, depth=0), "seconds": _number(record.get("seconds"))}


def read_probe(folder: Path) -> dict | None:
    """The harness's note that importing a student module failed (None: it did not)."""
    path = folder / "probe.json"
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
        return None
    try:
        probe = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(probe, dict):
        return None
    code = probe.get("returncode")
    return {
        "module": str(probe.get("module", ""))[:100],
        "returncode": code if isinstance(code, int) and not isinstance(code, bool) else None,
        "stderr": str(probe.get("stderr", ""))[-2000:],
    }


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _decode(value, folder: Path, depth: int):
    if depth > 20:
        raise WireError("the result is nested too deeply")
    if isinstance(value, list):
        return [_decode(item, folder, depth + 1) for item in value]
    if isinstance(value, dict):
        if "$tensor" in value:
            return _tensor(value, folder)
        if "$unsupported" in value:
            raise WireError(
                f"a worker returned a {str(value['$unsupported'])[:40]}, not a tensor or plain data"
            )
        return {key: _decode(item, folder, depth + 1) for key, item in value.items()}
    return value


def _tensor(entry: dict, folder: Path) -> torch.Tensor:
    name, dtype = entry.get("$tensor"), entry.get("dtype")
    if not isinstance(name, str) or not _NAME.match(name) or dtype not in DTYPES:
        raise WireError("malformed tensor entry")
    path = folder / name
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_NPY_BYTES:
        raise WireError(f"tensor file {name} is missing or too large")
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise WireError(f"tensor file {name} is not a valid .npy file: {error}") from None
    stored, view_as = DTYPES[dtype]
    if not isinstance(array, np.ndarray) or array.dtype != np.dtype(stored):
        raise WireError(f"tensor file {name} does not hold {dtype} data")
    tensor = torch.from_numpy(np.array(array, order="C", copy=True))  # keeps 0-dim arrays 0-dim
    return tensor.view(view_as) if view_as is not None else tensor
