"""The hidden tests of a4_compression, generated from its case table (``cases.py``, seed 0).

PYTHONPATH=path/to/the/student/folder python -m pytest grader/a4_compression -p no:cacheprovider
"""

from .grading import ASSIGNMENT

globals().update(ASSIGNMENT.pytest_tests())
