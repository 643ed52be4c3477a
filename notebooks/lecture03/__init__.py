"""Worker modules of lecture 03, written by the notebook's `%%writefile lecture03/...` cells.

Worker processes find the function they run by module and name (`lecture03.counting.count_and_reduce`),
so the functions live here, in a package next to the notebook, not in the notebook itself.
"""
