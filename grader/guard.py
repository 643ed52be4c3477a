"""The run time half of "you may not call the library's implementation of your task".

Copied into the sandbox beside ``harness.py`` and imported by the assignment's worker module;
``install_rules(rules)`` runs in every worker process *before* the student's module is imported.
Standalone: the standard library and whatever modules it is told to guard, never ``grader``.

Three locks, because a name can be reached in many ways (``md.allreduce``, an alias,
``getattr(md, "all" + "reduce")``, ``importlib.import_module(...)``, ``sys.modules[...]``):

1. **the function objects themselves.** Every function defined in a forbidden module (and its
   classes' methods), and every function a forbidden name points at, gets its ``__code__``
   replaced by code that raises ``PermissionError`` naming it. Every path to the object --
   whatever name, alias or lookup leads there -- ends in the refusal.
2. **imports.** A finder first on ``sys.meta_path`` refuses a forbidden module that is not
   loaded yet (or was removed from ``sys.modules`` to be loaded afresh).
3. **the source files.** An audit hook refuses to ``open`` (or hard-link) the library's source
   files of the forbidden modules (to copy their code and ``exec`` it), also by a relative name
   (which ``os.open(..., dir_fd=...)`` resolves against a directory the hook cannot see: a
   relative name ending in a guarded file's name is refused), and to ``exec`` code compiled
   from them.
4. **copies.** A second finder refuses to import a module whose file lies outside the standard
   library, the installed packages, the folder of the guarded library, and the files that were
   on ``sys.path`` when the guard was installed (the sandbox's: the grader's modules and the
   submission's) -- a copy of the library written at run time, anywhere, is not imported.
   The hook refuses to write a file code is loaded from (``.py``, ``.pyc``, ``.so``, ...) or
   any of those files (the grader's modules beside the submission: a later job imports them),
   to rename or link one into place, and to remove, truncate or touch those files. With
   ``REFUSE_PROCESSES`` in the rules, it also refuses to start a process (a child reads and
   writes files the hook does not see).

The refusal's message starts with ``MARKER``; the grader recognises it in a worker's error
and gives the submission the status ``forbidden``. What this cannot stop (code in the same
process can undo anything the process did) is in ``grader/README.md``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import sysconfig
import types

MARKER = "forbidden by the grader:"
_installed: set[str] = set()
_guarded_files: set[str] = set()
_guarded_names: set[str] = set()  # their base names (a relative open may be dir_fd-relative)
_refuse_processes: list[bool] = [False]
_protected: set[str] = set()  # the module files on sys.path at install: nobody's to rewrite
#: what a module can be loaded from: a submission writes none of these (nor renames one into place)
_MODULE_SUFFIXES = (".py", ".pyc", ".pyw", ".so", ".pth", ".zip")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: audit events that start a process (subprocess, os.system, fork, exec, spawn)
_PROCESS_EVENTS = (
    "subprocess.Popen",
    "os.system",
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "pty.spawn",
)


def refusal_message(name: str, instead: str) -> str:
    return (
        f"{MARKER} {name} is the library's (or torch's) implementation of what this assignment "
        f"asks you to write. Write it yourself with {instead}."
    )


_PLACEHOLDER = "\0refusal\0"
_templates: dict[tuple[str, ...], types.CodeType] = {}


def _refusing_code(function: types.FunctionType, message: str) -> types.CodeType:
    """Code for ``function`` that raises ``PermissionError(message)``; same number of free variables.

    One template is compiled per tuple of free variable names; each function gets a copy with
    its own message, name and qualified name (``CodeType.replace``, no compiling).
    """
    free = function.__code__.co_freevars
    if free not in _templates:
        cells = "".join(f"    {name} = None\n" for name in free)
        uses = f"        ({', '.join(free)},)\n" if free else ""
        source = (
            "def _outer():\n"
            f"{cells}"
            "    def _refused(*args, **kwargs):\n"
            f"{uses}"
            f"        raise PermissionError({_PLACEHOLDER!r})\n"
            "    return _refused\n"
        )
        namespace: dict = {}
        exec(compile(source, "<grader guard>", "exec"), namespace)  # the guard's own code, not the student's
        _templates[free] = namespace["_outer"]().__code__
    template = _templates[free]
    consts = tuple(message if c == _PLACEHOLDER else c for c in template.co_consts)
    return template.replace(
        co_consts=consts, co_name=function.__code__.co_name, co_qualname=function.__code__.co_qualname
    )


def _neuter(function: types.FunctionType, name: str, instead: str) -> None:
    if getattr(function, "__code__", None) is None or function.__code__.co_filename == "<grader guard>":
        return
    function.__code__ = _refusing_code(function, refusal_message(name, instead))


def _refusing_function(message: str) -> types.FunctionType:
    def refused(*args, **kwargs):
        pass

    refused.__code__ = _refusing_code(refused, message)
    return refused


def _replace_method(
    owner: type | types.ModuleType, attribute: str, name: str, instead: str, message: str = ""
) -> None:
    """Replace a method or function written in C (``ProcessGroup.allreduce``, ``torch.from_file``)
    by a refusing Python function (its message: ``message``, else the refusal of ``name``)."""
    try:
        setattr(owner, attribute, _refusing_function(message or refusal_message(name, instead)))
    except (AttributeError, TypeError):  # a type that cannot be changed: the intake check is all
        pass


def _functions_of(module: types.ModuleType):
    """(qualified name, function) for the functions and methods *defined* in ``module``."""
    for attribute, value in list(vars(module).items()):
        if attribute.startswith("__"):  # a module's __getattr__/__dir__ are lookups, not the task
            continue
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            yield f"{module.__name__}.{attribute}", value
        elif isinstance(value, type) and value.__module__ == module.__name__:
            for method_name, method in list(vars(value).items()):
                method = getattr(method, "__func__", method)  # staticmethod, classmethod
                # only its own: an Enum's __new__ is enum.Enum.__new__, shared by every Enum
                if isinstance(method, types.FunctionType) and method.__module__ == module.__name__:
                    yield f"{module.__name__}.{attribute}.{method_name}", method


def _is_within(name: str, modules) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


class _RefuseImports(importlib.abc.MetaPathFinder):
    def __init__(self, modules: tuple[str, ...], instead: str) -> None:
        self.modules, self.instead = modules, instead

    def find_spec(self, fullname, path, target=None):
        if _is_within(fullname, self.modules):
            raise ImportError(refusal_message(fullname, self.instead), name=fullname)
        return None


class _OnlyKnownFiles(importlib.abc.MetaPathFinder):
    """Refuses a module found on ``sys.path`` whose file is neither under ``roots`` nor one of
    ``files`` (the files present when the guard was installed): a copy written at run time."""

    def __init__(self, roots: tuple[str, ...], files: set[str], instead: str) -> None:
        self.roots, self.files, self.instead = roots, files, instead

    def find_spec(self, fullname, path, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        origin = getattr(spec, "origin", None)
        if spec is None or not spec.has_location or not origin or origin in ("built-in", "frozen"):
            return None
        real = os.path.realpath(origin)
        if real.startswith(self.roots) or real in self.files:
            return None
        raise ImportError(
            f"{MARKER} importing {fullname} from {origin}, a file written while the tests ran (a "
            f"copy of the library's code?). Write it yourself with {self.instead}.",
            name=fullname,
        )


def _library_roots(modules: tuple[str, ...]) -> tuple[str, ...]:
    """The standard library, the installed packages, and the folder holding each guarded package."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    for name in {m.split(".")[0] for m in modules}:
        module = sys.modules.get(name)
        for folder in getattr(module, "__path__", []) or []:
            roots.add(os.path.dirname(folder))
    return tuple(os.path.realpath(root) + os.sep for root in sorted(roots))


def _present_files(roots: tuple[str, ...]) -> set[str]:
    """The module files on ``sys.path`` now, outside ``roots``: each entry's ``.py`` files and
    the files of its packages (folders with an ``__init__.py``), recursively."""
    found: set[str] = set()
    for entry in sys.path:
        folder = os.path.realpath(entry or os.getcwd())
        if not os.path.isdir(folder) or (folder + os.sep).startswith(roots):
            continue
        for name in os.listdir(folder):
            full = os.path.join(folder, name)
            if name.endswith((".py", ".pyc", ".so")) and os.path.isfile(full):
                found.add(os.path.realpath(full))
            elif os.path.isfile(os.path.join(full, "__init__.py")) and not name.startswith("."):
                for root, dirs, files in os.walk(full):
                    dirs[:] = [d for d in dirs if not d.startswith(".")]
                    found.update(os.path.realpath(os.path.join(root, f)) for f in files if f.endswith(".py"))
    return found


def _guarded(raw) -> str | None:
    """The guarded file that the path ``raw`` (as given to open) may name, or None."""
    try:
        name = os.fsdecode(raw)
    except (TypeError, ValueError):
        return None
    path = os.path.realpath(name)
    if path in _guarded_files:
        return path
    if not os.path.isabs(name) and os.path.basename(name) in _guarded_names:
        return name  # relative: maybe to a directory descriptor (os.open(name, dir_fd=fd))
    return None


def _is_code_file(raw) -> bool:
    """Whether ``raw`` names a file code is loaded from, or one of the files present at install
    (the grader's modules beside the submission: rewritten, a later job would import them)."""
    if not isinstance(raw, (str, bytes, os.PathLike)):
        return False
    try:
        name = os.fsdecode(raw)
    except (TypeError, ValueError):
        return False
    return name.endswith(_MODULE_SUFFIXES) or os.path.realpath(name) in _protected


def _writes(mode, flags) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


#: set once the guard is installed: from then on compiling source text is refused (``_compile``)
_strict: list[bool] = [False]
#: standard library functions that compile text they generate themselves, from names they check
#: (a dataclass's ``__init__``, a namedtuple's ``__new__``, typing's forward references)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"])
_COMPILERS = {
    (os.path.join(_STDLIB, "dataclasses.py"), "_create_fn"),
    (os.path.join(_STDLIB, "collections", "__init__.py"), "namedtuple"),
    (os.path.join(_STDLIB, "typing.py"), "__init__"),
}
#: torch's ways to read a file that raise no ``open`` audit event (the file is mapped in C++)
FILE_READERS = ("torch.from_file", "torch.UntypedStorage.from_file", "torch.TypedStorage.from_file")


#: the grader's own modules in the working directory (every other module file there is the student's)
GRADER_FILES = ("harness.py", "workers.py", "guard.py", "rules.py", "student_comm.py", "seeding.py")
GRADER_FILES += ("instruments.py", "reference.py")
_trusted_roots: list[tuple[str, ...]] = [()]  # the standard library, site-packages, the library


def _is_students(filename: str) -> bool:
    real = os.path.realpath(filename)
    return real in _protected and os.path.basename(real) not in GRADER_FILES


def _compile_allowed(caller) -> bool:
    """Whether compiling, called from frame ``caller``, is the library's own business: no frame
    of the student's module is on the stack, or a module of the standard library, site-packages
    or the course library is being imported between it and the compile (mpmath and sympy build
    functions from strings at import; torch imports them lazily, maybe inside the student's
    call). Text from the student reaches compile only through a call of the student's, with no
    trusted import in between."""
    frame = caller
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_students(filename):
            return False
        if frame.f_code.co_name == "<module>" and os.path.realpath(filename).startswith(_trusted_roots[0]):
            return True
        frame = frame.f_back
    return True


def _compile(args: tuple) -> None:
    """Refuse to compile source text made by the student's code once the guard is installed,
    unless it is a module's own file being imported (the text equals the file on disk), one of
    ``_COMPILERS`` at work, or the library's own business (``_compile_allowed``).

    A string compiled at run time escapes every check the grader makes on the submission's file
    before it runs (``torch.package`` imports modules from strings; ``exec`` is refused there)."""
    source, filename = (args + (None, None))[:2]
    caller = sys._getframe(2)  # 0: this function, 1: _audit, 2: whoever called compile
    where = (os.path.realpath(caller.f_code.co_filename), caller.f_code.co_name)
    if where in _COMPILERS or _compile_allowed(caller):
        return
    name = os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike)) else ""
    if isinstance(source, (str, bytes)) and name and os.path.isfile(name):
        with open(name, "rb") as file:
            on_disk = file.read()
        if on_disk == (source.encode() if isinstance(source, str) else bytes(source)):
            return
    raise PermissionError(
        f"{MARKER} compiling code at run time ({name or type(source).__name__}): the grader runs the "
        "code of your file as it reads it, not code made from strings (torch.package, exec, eval)"
    )


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if path := _guarded(args[0]):
            raise PermissionError(f"{MARKER} reading {path}, the library's code for this assignment's task")
        if _protected and len(args) >= 3 and _writes(args[1], args[2]) and _is_code_file(args[0]):
            raise PermissionError(
                f"{MARKER} writing {os.fsdecode(args[0])}: a submission writes no code files"
            )
    elif _protected and event in ("os.rename", "os.link", "os.symlink") and len(args) >= 2:
        if _is_code_file(args[1]) or (event == "os.rename" and _is_code_file(args[0])):
            raise PermissionError(f"{MARKER} {event} to {args[1]}: a submission writes no code files")
        if event == "os.link" and (path := _guarded(args[0])):
            raise PermissionError(f"{MARKER} linking {path}, the library's code for this assignment's task")
    elif _protected and event in ("os.remove", "os.truncate", "os.utime", "os.chmod") and args:
        if (
            isinstance(args[0], (str, bytes, os.PathLike))
            and os.path.realpath(os.fsdecode(args[0])) in _protected
        ):
            raise PermissionError(
                f"{MARKER} {event} of {args[0]}: the grader's and your files stay as they are"
            )
    elif _refuse_processes[0] and event.startswith(_PROCESS_EVENTS):
        raise PermissionError(
            f"{MARKER} starting a process ({event}): a submission computes in its own process"
        )
    elif event == "compile" and _strict[0]:
        _compile(args)
    elif event == "exec" and args and isinstance(args[0], types.CodeType):
        filename = args[0].co_filename
        if filename.endswith(".py") and os.path.realpath(filename) in _guarded_files:
            raise PermissionError(f"{MARKER} running code compiled from {filename}")


def _resolve(dotted: str):
    """The object a dotted name points at (loaded modules are attributes of their package), or None."""
    parts = dotted.split(".")
    try:
        value = importlib.import_module(parts[0])
    except ImportError:
        return None
    for attribute in parts[1:]:
        value = getattr(value, attribute, None)
        if value is None:
            return None
    return value


def install(modules: tuple[str, ...], names: tuple[str, ...], instead: str, processes: bool = False) -> None:
    """Refuse ``modules`` (every function defined in them, and their submodules) and ``names``;
    with ``processes``, starting a process too.

    Idempotent. Loads the forbidden modules that exist first, so that their functions can be
    neutered where they live; a package's submodules loaded later are refused by the finder.
    """
    key = repr((modules, names))
    if key in _installed:
        return
    to_neuter: list[tuple[str, types.FunctionType]] = []
    for module_name in modules:
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
    for module_name, module in list(sys.modules.items()):
        if module is not None and _is_within(module_name, modules):
            to_neuter.extend(_functions_of(module))
            source = getattr(module, "__file__", None)
            if source:
                _guarded_files.add(os.path.realpath(source))
            for folder in getattr(module, "__path__", []):  # a package: its modules not loaded yet too
                for root, _, files in os.walk(folder):
                    _guarded_files.update(
                        os.path.realpath(os.path.join(root, f)) for f in files if f.endswith(".py")
                    )
    for dotted in FILE_READERS:  # whatever the assignment: a file read must pass the audit hook
        owner, _, attribute = dotted.rpartition(".")
        holder = _resolve(owner)
        if isinstance(holder, (type, types.ModuleType)) and hasattr(holder, attribute):
            why = f"{MARKER} {dotted} reads a file the grader cannot see; a submission reads no files"
            _replace_method(holder, attribute, dotted, instead, why)
    for dotted in names:
        outer = _resolve(dotted)
        inner = getattr(outer, "__wrapped__", None)  # the real function behind a decorator
        for value in (outer, inner):
            if isinstance(value, types.FunctionType):
                to_neuter.append((dotted, value))
        owner = _resolve(dotted.rpartition(".")[0])
        if outer is not None and not isinstance(outer, types.FunctionType) and isinstance(owner, type):
            _replace_method(owner, dotted.rpartition(".")[2], dotted, instead)  # a C method
    for name, function in to_neuter:
        _neuter(function, name, instead)
    _guarded_names.update(os.path.basename(path) for path in _guarded_files)
    roots = _library_roots(modules)
    _trusted_roots[0] = roots
    present = _present_files(roots)
    _protected.update(present)
    sys.meta_path.insert(0, _OnlyKnownFiles(roots, present, instead))
    sys.meta_path.insert(0, _RefuseImports(modules, instead))
    _refuse_processes[0] = _refuse_processes[0] or processes
    if not _installed:
        sys.addaudithook(_audit)
    _installed.add(key)
    _strict[0] = True  # last: installing compiled the guard's own refusals


def install_rules(rules) -> None:
    """``install`` with an assignment's ``rules`` module (``FORBIDDEN_MODULES``, ``FORBIDDEN_NAMES``)."""
    install(
        tuple(rules.FORBIDDEN_MODULES),
        tuple(rules.FORBIDDEN_NAMES),
        rules.ALLOWED_INSTEAD,
        bool(getattr(rules, "REFUSE_PROCESSES", False)),
    )
