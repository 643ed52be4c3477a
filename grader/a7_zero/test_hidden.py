"""The hidden tests of a7_zero, generated from its case table (``cases.py``, seed 0).

PYTHONPATH=path/to/the/student/folder python -m pytest grader/a7_zero -p no:cacheprovider
"""

from .grading import ASSIGNMENT

globals().update(ASSIGNMENT.pytest_tests())
