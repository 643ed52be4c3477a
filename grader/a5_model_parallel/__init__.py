"""Grading of assignment 5 (tensor-parallel MLP, 1F1B schedule and its stage step): hidden tests.

Run the hidden tests against a folder that holds ``tp_layers.py`` and ``schedule.py``::

    PYTHONPATH=path/to/folder python -m pytest grader/a5_model_parallel -p no:cacheprovider

Every test carries ``@pytest.mark.points(n)`` (see ``conftest.py``); the points of each test
are written to the JUnit XML report (``--junitxml``) as the test case property ``points``,
and the terminal summary shows the score.
"""

#: the files a student hands in; everything else in a submission is ignored
STUDENT_FILES = ("tp_layers.py", "schedule.py")
