"""Lectures 01-02 ask for an allreduce written from send/recv: a student who hands in the library's
collective instead, under any name, fails the check (the other lectures' checks use the same
``md.switched_off``, tested in tests/lib/foundations/test_exercise.py)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

import minidist as md
from minidist.errors import WorkerError

LECTURES = Path(__file__).resolve().parents[2] / "solutions" / "lectures"

# Each student's module is written to disk, so ranks started by md.launch import it as a file.
CHEATS = {
    "the package's allreduce": "import minidist as md\ndef allreduce(comm, x):\n    md.allreduce(comm, x)\n",
    "an algorithm imported from a private module": (
        "from minidist.collectives.rooted import star_broadcast, star_reduce\n"
        "def allreduce(comm, x):\n    star_reduce(comm, x, 0)\n    star_broadcast(comm, x, 0)\n"
    ),
    "the allgather, then a sum": "from minidist.collectives import allgather\n"
    "def allreduce(comm, x):\n    x.copy_(allgather(comm, x).sum(0))\n",
}


@pytest.fixture
def lecture_modules(tmp_path, monkeypatch):
    for folder in (LECTURES, tmp_path):
        monkeypatch.syspath_prepend(str(folder))
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith(("lecture01", "lecture02", "cheat_"))]:
        del sys.modules[name]


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_lecture01_refuses_the_librarys_collectives(lecture_modules, cheat):
    module = f"cheat_{abs(hash(cheat))}"
    (lecture_modules / f"{module}.py").write_text(textwrap.dedent(CHEATS[cheat]))
    from lecture01 import combine

    student = __import__(module)
    with pytest.raises(WorkerError, match="Try it 2 asks you to write it; the library's .* is switched off"):
        md.launch(combine.run_allreduce, 2, args=(student.allreduce, 256, "Try it 2"), timeout=60)


def test_lecture02_refuses_the_librarys_reduce_scatter(lecture_modules):
    (lecture_modules / "cheat_ring.py").write_text(
        "from minidist.collectives.ring import ring_reduce_scatter_\n"
        "def reduce_scatter(comm, flat):\n"
        "    block = flat.numel() // comm.world_size\n"
        "    bounds = [(r * block, (r + 1) * block) for r in range(comm.world_size)]\n"
        "    ring_reduce_scatter_(comm, flat, bounds, 'sum')\n"
    )
    import cheat_ring
    from lecture02 import allreduce_bench

    with pytest.raises(WorkerError, match="Try it 1 asks you to write it; the library's .* is switched off"):
        md.launch(allreduce_bench.run_ring, 2, args=(cheat_ring.reduce_scatter, 256, "Try it 1"), timeout=60)
