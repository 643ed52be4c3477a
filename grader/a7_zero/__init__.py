"""Grading of assignment 7 (ZeRO-2 and ZeRO-3): hidden tests, what is handed in.

Run the hidden tests against a folder that holds a ``zero.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a7_zero -p no:cacheprovider
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("zero.py",)
