"""Read what the sandbox wrote (``harness.py``'s wire format) as plain data, never as code.

Everything here assumes the files are hostile: JSON is size-capped before it is parsed,
``.npy`` files are loaded with ``allow_pickle=False`` (no object arrays, so nothing is
unpickled), only plain file names inside the results folder are opened, only a few dtypes
are accepted, and anything unexpected becomes a ``WireError`` -- which fails the one test
whose record it is, not the grader.

Bytes are capped before they are read: a record may reference the same ``.npy`` many times,
so the decoded tensors of one record (``MAX_RECORD_BYTES``) and of all the records of one
submission (``MAX_SUBMISSION_BYTES``, counted by the ``Budget`` the grader makes per submission
and passes to each ``read_record``) are counted from each file's size *before* it is loaded.
JSON is parsed strictly enough to stay cheap: an integer literal of more than
``MAX_INT_DIGITS`` digits is refused (``NaN`` / ``Infinity`` are read as floats: they are
data, which the check then judges).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

MAX_JSON_BYTES = 16 * 2**20
MAX_NPY_BYTES = 256 * 2**20
MAX_RECORD_BYTES = 256 * 2**20  # decoded tensor bytes of one record (one test)
MAX_SUBMISSION_BYTES = 1 * 2**30  # decoded tensor bytes of every record of one results folder
MAX_INT_DIGITS = 40
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


class Budget:
    """The decoded tensor bytes one submission may still read: made per submission, passed to
    every ``read_record`` of its results (``Grader._run``), and dropped with it.

    Each record also has its own cap (``MAX_RECORD_BYTES``), counted per ``read_record`` call.
    Sizes are counted from the ``.npy`` files' sizes *before* they are loaded, so a record that
    references one large file many times is refused before memory is spent on it.
    """

    def __init__(self) -> None:
        self.spent = 0  # bytes of every record read with this budget

    def take(self, size: int, record: int, name: str) -> int:
        """Count ``size`` more bytes of a record that has decoded ``record`` bytes so far, before
        they are read; the record's new total. WireError when either cap would be exceeded."""
        if record + size > MAX_RECORD_BYTES:
            cap = MAX_RECORD_BYTES >> 20
            raise WireError(f"the result's tensors add up to more than {cap} MiB (at {name})")
        if self.spent + size > MAX_SUBMISSION_BYTES:
            raise WireError(
                f"the results of this submission add up to more than {MAX_SUBMISSION_BYTES >> 20} MiB"
            )
        self.spent += size
        return record + size


class _RecordBudget:
    """What one record may still decode: its own cap and what is left of its submission's."""

    def __init__(self, submission: Budget) -> None:
        self.submission, self.record = submission, 0

    def take(self, size: int, name: str) -> None:
        self.record = self.submission.take(size, self.record, name)


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise WireError(f"the result holds an integer of more than {MAX_INT_DIGITS} digits")
    return int(digits)


def loads(text: str):
    """``json.loads`` with huge integer literals refused (WireError) and NaN / Infinity as floats."""
    return json.loads(text, parse_int=_int)


def read_record(folder: Path, job_id: str, budget: Budget | None = None) -> dict:
    """``{"value": ...}`` (tensors decoded) or ``{"error": {...}}``; WireError when unreadable.

    ``budget``: the submission's (one ``Budget`` for all its records); None: a fresh one, so
    only this record's bytes count against ``MAX_SUBMISSION_BYTES``.
    """
    path = folder / f"{job_id}.json"
    if path.is_symlink() or not path.is_file():
        raise WireError("no result was written for this test (the run was stopped before it, or crashed)")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise WireError("the result record is too large")
    try:
        record = loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise WireError(f"the result record is not valid JSON: {type(error).__name__}") from None
    if not isinstance(record, dict) or ("value" in record) == ("error" in record):
        raise WireError("the result record has neither a value nor an error")
    if "error" in record:
        if not isinstance(record["error"], dict):
            raise WireError("malformed error record")
        return {"error": record["error"], "seconds": _number(record.get("seconds"))}
    value = _decode(
        record["value"], folder, depth=0, budget=_RecordBudget(Budget() if budget is None else budget)
    )
    return {"value": value, "seconds": _number(record.get("seconds"))}


def read_probe(folder: Path) -> dict | None:
    """The harness's note that importing a student module failed (None: it did not)."""
    path = folder / "probe.json"
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
        return None
    try:
        probe = loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, WireError):
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
    """A duration from the record: a finite, non-negative float (0.0 when it is anything else)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return 0.0
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else 0.0


def _decode(value, folder: Path, depth: int, budget: _RecordBudget):
    if depth > 20:
        raise WireError("the result is nested too deeply")
    if isinstance(value, list):
        return [_decode(item, folder, depth + 1, budget) for item in value]
    if isinstance(value, dict):
        if "$tensor" in value:
            return _tensor(value, folder, budget)
        if "$unsupported" in value:
            raise WireError(
                f"a worker returned a {str(value['$unsupported'])[:40]}, not a tensor or plain data"
            )
        return {key: _decode(item, folder, depth + 1, budget) for key, item in value.items()}
    return value


def _tensor(entry: dict, folder: Path, budget: _RecordBudget) -> torch.Tensor:
    name, dtype = entry.get("$tensor"), entry.get("dtype")
    if not isinstance(name, str) or not _NAME.match(name) or dtype not in DTYPES:
        raise WireError("malformed tensor entry")
    path = folder / name
    if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_NPY_BYTES:
        raise WireError(f"tensor file {name} is missing or too large")
    budget.take(path.stat().st_size, name)
    try:
        array = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise WireError(f"tensor file {name} is not a valid .npy file: {error}") from None
    stored, view_as = DTYPES[dtype]
    if not isinstance(array, np.ndarray) or array.dtype != np.dtype(stored):
        raise WireError(f"tensor file {name} does not hold {dtype} data")
    tensor = torch.from_numpy(np.array(array, order="C", copy=True))  # keeps 0-dim arrays 0-dim
    return tensor.view(view_as) if view_as is not None else tensor
