"""Points for the hidden tests of every assignment: the plugin in ``grader/points.py``.

pytest loads this file for anything collected under ``grader/`` (``pytest grader/a3_ddp``).
"""

from grader.points import (  # noqa: F401  (pytest finds hooks and fixtures by name here)
    _record_points,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_terminal_summary,
)
