"""Worker modules of lecture 11, written by the notebook's `%%writefile lecture11/...` cells.

Worker processes find the function they run by module and name, so the functions live here,
in a package next to the notebook, not in the notebook itself.
"""
