"""The instructor's pipeline: release assignments (and, later, grade submissions).

Run it as ``python -m grader <command>`` from the repository root; ``python -m grader -h``
lists the commands. Each assignment has a folder of the same name here, holding its hidden
tests (``grader/a1_collectives/``); they are never copied to ``assignments/``.
"""
