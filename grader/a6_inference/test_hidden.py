"""The hidden tests of a6_inference, generated from its case table (``cases.py``, seed 0).

PYTHONPATH=path/to/the/student/folder python -m pytest grader/a6_inference -p no:cacheprovider
"""

from .grading import ASSIGNMENT

globals().update(ASSIGNMENT.pytest_tests())
