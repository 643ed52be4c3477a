"""Grading of assignment 6 (int8 and NF4 quantization, a KV-cached attention step, greedy
generation with the cache): hidden tests.

Run the hidden tests against a folder that holds ``inference.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a6_inference -p no:cacheprovider

Every test carries ``@pytest.mark.points(n)`` (see ``conftest.py``); the points of each test
are written to the JUnit XML report (``--junitxml``) as the test case property ``points``,
and the terminal summary shows the score.
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("inference.py",)
