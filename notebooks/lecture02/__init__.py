"""Worker modules of lecture 02, written by the notebook's `%%writefile lecture02/...` cells.

Worker processes find the function they run by module and name (`lecture02.api.tour`), so the
functions live here, in a package next to the notebook, not in the notebook itself.
`python -m lecture02.job` (from notebooks/) runs section 7's script.
"""
