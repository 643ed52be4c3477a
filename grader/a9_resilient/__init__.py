"""Grading of assignment 9 (Streaming DiLoCo's sync, the quorum step): hidden tests, what is handed in.

Run the hidden tests against a folder that holds a ``resilient.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a9_resilient -p no:cacheprovider
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("resilient.py",)
