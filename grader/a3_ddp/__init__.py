"""Grading of assignment 3 (bucketed DDP that overlaps backward): hidden tests, what is handed in.

Run the hidden tests against a folder that holds a ``ddp.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a3_ddp -p no:cacheprovider

Every test carries ``@pytest.mark.points(n)`` (see ``conftest.py``); the points of each test
are written to the JUnit XML report (``--junitxml``) as the test case property ``points``,
and the terminal summary shows the score.
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("ddp.py",)
