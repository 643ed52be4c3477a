"""Run All on a student's copy of a lecture reaches the end, every check cell saying "not done yet".

The release (grader/release_lectures.py) refuses a student copy in which a stub could stop Run
All or a later cell could use a student's answer, for every lecture; this runs one student copy
for real, as a student who has solved nothing would: lecture 01, whose checks meet a stub both in
the notebook's own process (Try it 1) and in ranks that ``md.launch`` started (Try its 2 and 3);
and lecture 11 (8 s), whose stubs meet ``md.switched_off`` checks after an elastic launch with a
SIGKILLed rank and a resharding load. The other nine would cost minutes of CI and check the same
machinery. nbval runs the solved copies in solutions/lectures/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from grader.release_lectures import exercise_count, is_check_cell  # noqa: E402

RUN = ["01_processes_pipes_shared_memory.ipynb", "11_cheap_networks_and_failures.ipynb"]


@pytest.mark.parametrize("name", RUN)
def test_run_all_reaches_the_end_of_an_unsolved_student_copy(name):
    path = ROOT / "notebooks" / name
    notebook = nbformat.read(path, as_version=4)
    exercises, _ = exercise_count(path.read_text())
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError at the first cell that fails
    said = []
    for cell in notebook.cells:
        if cell.cell_type == "code" and is_check_cell(cell.source):
            text = "".join(out.get("text", "") for out in cell.outputs if out.get("output_type") == "stream")
            said.append(text)
    assert len(said) >= exercises >= 2
    assert all("not done yet" in text for text in said), said
