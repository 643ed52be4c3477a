"""Grading of assignment 4 (Deep Gradient Compression as a DDP hook): hidden tests, what is handed in.

Run the hidden tests against a folder that holds a ``dgc.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a4_compression -p no:cacheprovider

Every test carries ``@pytest.mark.points(n)`` (see ``conftest.py``); the points of each test
are written to the JUnit XML report (``--junitxml``) as the test case property ``points``,
and the terminal summary shows the score.
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("dgc.py",)
