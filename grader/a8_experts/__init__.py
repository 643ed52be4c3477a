"""Grading of assignment 8 (a mixture of experts over the ranks): hidden tests, what is handed in.

Run the hidden tests against a folder that holds an ``experts.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a8_experts -p no:cacheprovider
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("experts.py",)
