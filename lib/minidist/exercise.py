"""The check cell of a lecture's "Try it": ``with md.exercise("..."):``.

A lecture notebook's exercise is a function the student writes (its body is a stub,
``raise NotImplementedError(...)``, in the copy students receive); the cell after it checks
the function against a reference on fixed inputs::

    with md.exercise("Try it 1: the reduce-scatter half of the ring"):
        got = md.launch(lecture02.ring.reduce_scatter_worker, 4)
        assert all(torch.equal(g, want) for g, want in zip(got, reference))

Three outcomes, each printed in one line:

* the body runs to the end: ``... correct``;
* the student's function still raises ``NotImplementedError`` -- in this process or in a
  rank that ``md.launch`` started (a ``WorkerError`` whose remote exception is one) --
  ``... not done yet``, and the notebook goes on: Run All reaches the end of a lecture
  whose exercises are all unsolved, because no later cell uses a student's answer;
* any other error (a wrong answer fails its ``assert``) is raised as usual, so the student
  sees what went wrong where it went wrong.

A check must not pass when the student's function only calls the library's version of it.
``switched_off`` makes the library's versions raise while the student's function runs (the
check computes its reference first)::

    want = memory.activation_bytes_per_layer(2048, 1, 12288, 96)
    with md.switched_off("Try it 1", memory.activation_bytes_per_layer, memory.estimate):
        got = my_activation_bytes(2048, 1, 12288, 96)
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from types import TracebackType
from unittest import mock

from .errors import WorkerError

__all__ = ["exercise", "is_unsolved", "switched_off"]

NOT_DONE = (
    "not done yet -- write the function above (it still raises NotImplementedError), then run this cell again"
)


def is_unsolved(error: BaseException) -> bool:
    """Whether ``error`` is (or was caused by) a stub's ``NotImplementedError``, in any rank."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError):
            return True
        if isinstance(error, WorkerError) and error.exc_type == "NotImplementedError":
            return True
        error = error.__cause__ or error.__context__
    return False


class exercise:  # noqa: N801 (used as a statement: ``with md.exercise(...)``)
    """Check one exercise; an unsolved one reports "not done yet" instead of stopping the notebook."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.solved: bool | None = None  # None until the block has run

    def __enter__(self) -> exercise:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if error is None:
            self.solved = True
            print(f"{self.name}: correct")
            return False
        if is_unsolved(error):
            self.solved = False
            print(f"{self.name}: {NOT_DONE}")
            return True  # swallowed: the notebook goes on
        self.solved = False
        return False  # a wrong answer stops here, with its own message


@contextlib.contextmanager
def switched_off(name: str, *targets: Callable | tuple[type, str]) -> Iterator[None]:
    """While the block runs, each of ``targets`` raises ``AssertionError`` ("<name> asks you to write it").

    A target is a function or a class, or a ``(class, "method")`` pair. A function or class is
    replaced wherever a loaded module binds it -- the package that re-exports it, the module that
    defines it, a module that imported it, the notebook's own globals -- so a student's answer
    cannot reach it under another name; a class (and a pair) is switched off in the class
    itself (its ``__init__``, or the method), which every name of it shares. Everything is
    restored when the block ends. In ranks that ``md.launch`` starts, use it in the rank body.
    """
    with contextlib.ExitStack() as stack:
        for target in targets:
            owner, attribute = target if isinstance(target, tuple) else (target, "__init__")
            if isinstance(owner, type):
                label = f"{owner.__name__}" if attribute == "__init__" else f"{owner.__name__}.{attribute}"
                places = [(owner, attribute)]
            else:
                label = getattr(target, "__qualname__", repr(target))
                places = [
                    (module, key)
                    for module in list(sys.modules.values())
                    for key, value in list(getattr(module, "__dict__", {}).items())
                    if value is target
                ]
            owner_module = getattr(owner, "__module__", None) or ""
            whose = (
                "the library's" if owner_module.startswith("minidist") else f"{owner_module.split('.')[0]}'s"
            )
            off = AssertionError(
                f"{name} asks you to write it; {whose} {label} is switched off while your function runs"
            )
            for place, key in places:
                stack.enter_context(mock.patch.object(place, key, side_effect=off))
        yield
