"""The hidden tests of a5_model_parallel, generated from its case table (``cases.py``, seed 0).

PYTHONPATH=path/to/the/student/folder python -m pytest grader/a5_model_parallel -p no:cacheprovider
"""

from .grading import ASSIGNMENT

globals().update(ASSIGNMENT.pytest_tests())
