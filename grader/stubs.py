"""Stand-ins for the library's forbidden modules, bound over their files inside the sandbox.

The run time guard (``guard.py``) refuses the forbidden functions inside the worker processes,
but only there: code that runs before it is installed, in a child process of its own, or that
reads the files by a route the audit hook does not see (``torch.from_file`` maps a file in C++)
would still find the library's source. So, when the sandbox isolates (root, a mount namespace),
the grader goes one level down: inside the sandbox's mount namespace every file of a forbidden
module is covered, by a bind mount, with a generated stand-in, and every cached ``.pyc`` of it
with an empty file. Whatever route a submission takes -- an import, a probe, a subprocess,
``open``, ``torch.from_file``, ``marshal`` on a ``.pyc`` -- the bytes it gets are the stand-in's.

A stand-in keeps the module's public surface, so that the library modules that are allowed still
import (``minidist/__init__`` re-exports ``minidist.collectives.allreduce``):

* functions and methods defined in the module raise ``PermissionError`` with the guard's message
  (the grader gives the submission the status ``forbidden``, as for the guard);
* classes keep their name and their bases from outside (an exception stays an exception, an
  autograd ``Function`` a ``Function``), with every method refusing;
* names imported from elsewhere are imported again (re-exports between forbidden modules point
  at the other stand-in, so they stay the same object); literals (numbers, strings, tuples of
  them) are copied; any other object becomes a placeholder that refuses every use.

Built in the grader (trusted) process from the modules as it imports them; the sandbox reads
only the generated text. ``build(rules, folder)`` writes the stand-ins and returns the
``(source, target)`` pairs that ``sandbox.Isolation.overlays`` binds.
"""

from __future__ import annotations
import __future__

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import types
from pathlib import Path

from . import guard

HEADER = '''"""Covered by the grader: {module} is the library's implementation of what this assignment
asks you to write. This stand-in keeps its names; each one refuses to run."""

_MESSAGE = {message!r}


def _refuse(*args, **kwargs):
    raise PermissionError(_MESSAGE)


class _Refused:
    """An object of the library's that this assignment may not use: every use refuses."""

    def __getattr__(self, name):
        _refuse()

    def __call__(self, *args, **kwargs):
        _refuse()

    def __getitem__(self, key):
        _refuse()

    def __iter__(self):
        _refuse()


'''


def forbidden_module_names(modules: tuple[str, ...]) -> list[str]:
    """The forbidden modules and, for packages, every module below them (imported here)."""
    found: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found.append(name)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
            found.append(info.name)
    return sorted(set(found))


def _within(name: str | None, modules: list[str]) -> bool:
    return bool(name) and any(name == m or name.startswith(m + ".") for m in modules)


def _literal(value) -> str | None:
    """``repr(value)`` when it reads back as the same literal, else None."""
    if isinstance(value, (types.ModuleType, type)) or callable(value):
        return None
    try:
        text = repr(value)
        return text if ast.literal_eval(text) == value else None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _importable(value) -> tuple[str, str] | None:
    """(module, name) from which ``value`` can be imported again by that name, or None."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "." in qualname or "<" in qualname:
        return None
    try:
        found = getattr(importlib.import_module(module), qualname, None)
        return (module, qualname) if found is value else None
    except Exception:  # a module that cannot be imported here: the stand-in leaves the name out
        return None


def _refusing_class(name: str, cls: type, modules: list[str]) -> list[str]:
    bases = []
    for base in cls.__bases__:
        if base is object or base.__module__ == cls.__module__:
            continue  # a base of this module: ``stand_in`` names its stand-in (defined before it)
        where = _importable(base)
        if where is None:
            continue
        bases.append(f"__import__({where[0]!r}, fromlist=[{where[1]!r}]).{where[1]}")
    lines = [f"class {name}({', '.join(bases)}):" if bases else f"class {name}:"]
    lines.append(f"    __module__ = {cls.__module__!r}")
    body = []
    for attribute, value in vars(cls).items():
        if attribute in ("__module__", "__dict__", "__weakref__", "__doc__", "__qualname__"):
            continue
        raw = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if isinstance(raw, types.FunctionType) and _within(raw.__module__, modules):
            decorator = "    @staticmethod\n" if isinstance(value, staticmethod) else ""
            decorator = "    @classmethod\n" if isinstance(value, classmethod) else decorator
            body.append(f"{decorator}    def {attribute}(*args, **kwargs):\n        _refuse()")
        elif attribute.isidentifier() and not attribute.startswith("__") and (text := _literal(value)):
            body.append(f"    {attribute} = {text}")
    if "__init__" not in vars(cls):
        body.append("    def __init__(*args, **kwargs):\n        _refuse()")
    return lines + body + [""]


def stand_in(module: types.ModuleType, modules: list[str], message: str) -> str:
    """The source of the stand-in of ``module`` (one of ``modules``, the forbidden ones)."""
    parts = [HEADER.format(module=module.__name__, message=message)]
    classes: list[tuple[str, type]] = []
    for name, value in vars(module).items():
        if name.startswith("__") and name != "__all__":
            continue
        if not name.isidentifier() or name in ("_MESSAGE", "_refuse", "_Refused"):
            continue
        if isinstance(value, __future__._Feature):  # ``from __future__ import annotations``
            continue
        if isinstance(value, types.ModuleType):
            parts.append(f"import {value.__name__} as {name}")
        elif getattr(value, "__module__", None) == module.__name__ and inspect.isclass(value):
            classes.append((name, value))
        elif getattr(value, "__module__", None) == module.__name__ and callable(value):
            parts.append(f"def {name}(*args, **kwargs):\n    _refuse()\n")
        elif (where := _importable(value)) is not None:
            parts.append(f"from {where[0]} import {where[1]} as {name}")
        elif (text := _literal(value)) is not None:
            parts.append(f"{name} = {text}")
        else:
            parts.append(f"{name} = _Refused()")
    # a class whose base is another class of this module comes after it
    defined: set[str] = set()
    pending = classes[:]
    while pending:
        for name, cls in pending:
            own_bases = [b.__name__ for b in cls.__bases__ if b.__module__ == module.__name__]
            if all(b in defined for b in own_bases):
                lines = _refusing_class(name, cls, modules)
                if own_bases:
                    lines[0] = lines[0].replace(f"class {name}(", f"class {name}({', '.join(own_bases)}, ", 1)
                    lines[0] = lines[0].replace(f"class {name}:", f"class {name}({', '.join(own_bases)}):", 1)
                parts.append("\n".join(lines))
                defined.add(name)
                pending.remove((name, cls))
                break
        else:  # a cycle cannot happen between classes; keep the rest plain
            for name, cls in pending:
                parts.append("\n".join(_refusing_class(name, cls, modules)))
            break
    return "\n".join(parts) + "\n"


def build(rules, folder: Path) -> list[tuple[str, str]]:
    """Write the stand-ins of ``rules.FORBIDDEN_MODULES`` into ``folder``; the (source, target)
    bind mounts that cover each module's file with its stand-in and each cached ``.pyc`` of it
    with an empty file."""
    modules = forbidden_module_names(tuple(rules.FORBIDDEN_MODULES))
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    empty = folder / "empty"
    empty.write_bytes(b"")
    empty.chmod(0o444)
    overlays: list[tuple[str, str]] = []
    for name in modules:
        message = guard.refusal_message(name, rules.ALLOWED_INSTEAD)
        if name.rsplit(".", 1)[-1] == "__main__":  # a package's command line: importing it runs it
            spec = importlib.util.find_spec(name)
            target, text = (spec.origin if spec else None), f"raise ImportError({message!r})\n"
        else:
            module = importlib.import_module(name)
            target = getattr(module, "__file__", None)
            text = stand_in(module, modules, message) if target else ""
        if not target or not target.endswith(".py"):
            continue
        source = folder / f"{name}.py"
        source.write_text(text)
        source.chmod(0o444)
        target = os.path.realpath(target)
        overlays.append((str(source), target))
        cache = Path(target).parent / "__pycache__"
        stem = Path(target).stem
        if cache.is_dir():
            overlays += [(str(empty), str(pyc)) for pyc in sorted(cache.glob(f"{stem}.*.pyc"))]
    return overlays
