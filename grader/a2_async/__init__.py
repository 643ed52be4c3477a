"""Grading of assignment 2 (async parameter server, Hogwild): hidden tests, and what is handed in.

Run the hidden tests against a folder that holds an ``async_ps.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a2_async -p no:cacheprovider

Every test carries ``@pytest.mark.points(n)`` (see ``conftest.py``); the points of each test
are written to the JUnit XML report (``--junitxml``) as the test case property ``points``,
and the terminal summary shows the score.
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("async_ps.py",)
