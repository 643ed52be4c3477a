"""Worker modules of lecture 01, written by the notebook's `%%writefile lecture01/...` cells.

Worker processes find the function they run by module and name (`lecture01.race.count_unsafely`),
so the functions live here, in a package next to the notebook, not in the notebook itself.
"""
