"""The hidden tests of a1_collectives, generated from its case table (``cases.py``, seed 0).

PYTHONPATH=path/to/the/student/folder python -m pytest grader/a1_collectives -p no:cacheprovider
"""

from .grading import ASSIGNMENT

globals().update(ASSIGNMENT.pytest_tests())
