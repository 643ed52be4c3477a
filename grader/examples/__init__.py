"""Example submissions for trying the grader (``make grade``) and for its tests."""
