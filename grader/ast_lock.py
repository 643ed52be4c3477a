"""One AST built at a time in the grader's process (its grading threads share the interpreter).

CPython 3.11 (the course's interpreter) keeps the depth counter of the C code that turns a parse
into ``ast`` objects in one place per interpreter. When a garbage collection inside that code
runs Python (a finalizer, a ``gc`` callback) the interpreter may switch threads, and a second
thread's ``ast.parse`` moves the counter under the first one, which then raises
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905 and its
reports). The grader's threads build ASTs without asking for it: ``np.load`` reads every .npy
header through ``ast.literal_eval``, ``inspect.signature`` and torch parse sources, the
similarity check parses the submission. One of CI's runs graded a7's hoarder as "grading failed"
for this reason. ``serialise()`` wraps ``ast.parse`` (through which ``literal_eval`` and every
caller above go) in a lock, re-entrant so that a parse inside a finalizer of the same thread
cannot deadlock.
"""

from __future__ import annotations

import ast
import functools
import threading

_LOCK = threading.RLock()


def serialise() -> None:
    """Make ``ast.parse`` one thread at a time in this process (idempotent)."""
    if getattr(ast.parse, "_one_at_a_time", False):
        return
    unlocked = ast.parse

    @functools.wraps(unlocked)
    def parse(*args, **kwargs):
        with _LOCK:
            return unlocked(*args, **kwargs)

    parse._one_at_a_time = True  # type: ignore[attr-defined]
    ast.parse = parse
