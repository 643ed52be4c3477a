"""grader/wire.py's byte budget: one ``Budget`` per submission, passed to each ``read_record``.

The caps are counted from the ``.npy`` files' sizes before they are loaded; the budget is an
object the grader makes per submission (no state kept in the module): records read with one
budget add up, records read with another (another submission, the same folder) start afresh.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from grader import wire


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A results folder with a 1 MiB tensor file and records of 1, 2 and 4 references to it;
    caps of 3 files per record and 5 per submission."""
    np.save(tmp_path / "big.npy", np.arange(2**18, dtype=np.float32))
    size = (tmp_path / "big.npy").stat().st_size
    monkeypatch.setattr(wire, "MAX_RECORD_BYTES", 3 * size)
    monkeypatch.setattr(wire, "MAX_SUBMISSION_BYTES", 5 * size)
    entry = {"$tensor": "big.npy", "dtype": "float32"}
    for name, count in (("one", 1), ("two", 2), ("four", 4)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"value": [entry] * count, "seconds": 1}))
    return tmp_path


def test_records_read_with_one_budget_add_up(folder):
    budget = wire.Budget()
    for _ in range(2):  # 2 + 2 of the submission's 5
        value = wire.read_record(folder, "two", budget)["value"]
        assert len(value) == 2 and torch.equal(value[1], torch.arange(2**18, dtype=torch.float32))
    assert wire.read_record(folder, "one", budget)["value"][0].shape == (2**18,)  # 5 of 5
    with pytest.raises(wire.WireError, match="results of this submission add up to more than"):
        wire.read_record(folder, "one", budget)  # 6 > 5
    assert budget.spent == 5 * (folder / "big.npy").stat().st_size


def test_each_budget_is_its_own(folder):
    """Two submissions (two budgets) never share their bytes, even on the same folder; without a
    budget, each call counts only its own record."""
    first, second = wire.Budget(), wire.Budget()
    wire.read_record(folder, "two", first)
    wire.read_record(folder, "two", first)
    wire.read_record(folder, "two", second)  # would be 6 > 5 if the budgets were shared
    wire.read_record(folder, "two", second)
    for _ in range(4):
        assert len(wire.read_record(folder, "two")["value"]) == 2


def test_one_record_is_capped_before_its_files_are_loaded(folder, monkeypatch):
    loaded = []
    real_load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: loaded.append(a[0]) or real_load(*a, **k))
    budget = wire.Budget()
    with pytest.raises(wire.WireError, match=r"tensors add up to more than .* \(at big.npy\)"):
        wire.read_record(folder, "four", budget)  # 4 > 3 per record
    assert len(loaded) == 3  # the fourth reference was refused before np.load
    # the refused record's first three count: two more files remain of the submission's five
    assert len(wire.read_record(folder, "two", budget)["value"]) == 2
    with pytest.raises(wire.WireError, match="results of this submission"):
        wire.read_record(folder, "one", budget)


def test_a_copied_folder_is_read_the_same(folder, tmp_path_factory):
    copy = tmp_path_factory.mktemp("copy")
    for path in folder.iterdir():
        shutil.copy(path, copy)
    assert torch.equal(
        wire.read_record(copy, "one", wire.Budget())["value"][0],
        torch.from_numpy(np.load(folder / "big.npy")),
    )
