"""pytest plugins of the course's test run (loaded by the root ``conftest.py``)."""
