"""Intake check: a submission may not call the library's implementation of what it must write.

Each assignment lists, in ``grader/<name>/rules.py``, the modules and qualified names that are
off limits (a1: ``minidist.collectives`` and ``torch.distributed``'s collectives; a2: the
parameter-server and Hogwild trainers). ``check(source, rules)`` reads the submission's syntax
tree -- it never runs it -- and returns the first ``Refusal`` (line, what, why) or None:

* an ``import`` or ``from ... import`` of a forbidden module or name, or of a module no task
  needs (``REFUSED_IMPORTS``), or of a private module or name (``torch._C._nn``), or of the
  tools that load or run code behind the reader's back
  (``importlib``, ``runpy``, ``builtins``, ``gc``, ``inspect``, ``ctypes``, ``marshal``, ...);
* an attribute chain that resolves, through the file's imports, to a forbidden name
  (``md.allreduce``, ``minidist.collectives.ring.ring_allgather_``, ``dist.all_reduce``), also as
  ``getattr(md, "allreduce")`` with a literal name; and, on any object, the attribute names an
  assignment refuses by their last name (``REFUSED_ATTRIBUTES``, optional: a6's
  ``scaled_dot_product_attention``, which ``torch.ops.aten`` and every module that imports
  ``F`` re-export);
* a string literal that names a forbidden module or name (``"minidist.collectives"``);
* the builtins that run or look up code dynamically (``exec``, ``eval``, ``compile``,
  ``__import__``, ``globals``, ``vars``, ``open``, ``breakpoint``), dunder attributes other
  than ``__name__``/``__doc__``/``__init__`` (``f.__globals__``, ``x.__class__``) and
  ``sys.modules``/``sys._getframe``/``sys.path``/``sys.exc_info`` and friends;
* the names that lead from an object to a running frame and its variables (``tb_frame``,
  ``f_back``, ``f_locals``, ``gi_frame``, ...) on any object, the ``traceback`` module, and the
  keyword ``dir_fd`` (a file opened relative to a directory descriptor hides its path);
* attribute names computed at run time (``getattr(x, name)``, ``setattr``, ``delattr``), private
  attributes of objects that are not the submission's own (``self`` is its own only as the
  first parameter of a method of its own class, never reassigned), and the communicator
  wrapper's ``_comm``/``_traffic`` on any object;
* assigning or deleting an attribute or an item of something the file imported, or of a class
  reached through a call (``time.perf_counter_ns = f``, ``F.cross_entropy = f``,
  ``md.cost_model.DEFAULTS["shm"] = m``, ``type(comm).stats = ...``, ``setattr(torch, "x", f)``):
  the grader's own code in the sandbox uses those modules too, and a patched clock or loss
  would forge its evidence.

It is a filter for the obvious, not a proof: attribute names computed at run time are refused,
but a library function reached through another module that imports it
(``data_parallel.allreduce``) passes it. The run time guard (``guard.py``) refuses those calls inside the
sandbox, and ``grader/README.md`` says what is left.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import ModuleType

#: modules that load, inspect or run code in ways a submission has no use for
TOOL_MODULES = (
    "importlib",
    "imp",
    "runpy",
    "builtins",
    "gc",
    "inspect",
    "ctypes",
    "operator",  # attrgetter / methodcaller: attributes reached by a string
    "marshal",
    "code",
    "codeop",
    "pkgutil",
    "zipimport",
    "types",
    "traceback",  # walk_stack / extract_stack reach the grader's frames
    # what turns a string into an object or runs it: pickle's GLOBAL, pydoc.locate, logging.config's
    # resolve, mock.patch's target, and the modules that run code given as a string
    "pickle",
    "copyreg",
    "shelve",
    "dill",
    "cloudpickle",
    "pydoc",
    "logging.config",
    "unittest",
    "timeit",
    "doctest",
    "pdb",
    "bdb",
    "trace",
    "profile",
    "cProfile",
    "torch.package",  # imports modules from strings: code the intake never reads
    # the grader's own sandbox-side modules: the guard, the communicator wrapper, the workers,
    # the seeded builders of the hidden inputs and the instruments
    "guard",
    "student_comm",
    "workers",
    "harness",
    "rules",
    "seeding",
    "instruments",
)
#: refused by every assignment: what would see the grader's own tensors and calls while they run
#: (a saved-tensor hook is handed every tensor autograd saves, a torch-function or dispatch mode
#: every call, the grader's instruments' included; a5's and a4's reviews used them)
INTERCEPTORS = (
    "saved_tensors_hooks",
    "register_saved_tensors_default_hooks",
    "TorchFunctionMode",
    "TorchDispatchMode",
    "_push_mode",
    "_set_torch_function_mode",
)
TOOL_BUILTINS = ("exec", "eval", "compile", "__import__", "globals", "vars", "open", "breakpoint")
SYS_ATTRIBUTES = (
    "modules",
    "meta_path",
    "path_hooks",
    "path_importer_cache",
    "settrace",
    "setprofile",
    "addaudithook",
    "path",  # a folder of one's own to import from
    "exc_info",  # a traceback, and through it the grader's frames
    "exception",
    "last_traceback",
    "last_exc",
    "last_value",
)
#: attributes that reach a running frame (and the grader's variables in it), on any object
FRAME_ATTRIBUTES = (
    "f_back",
    "f_globals",
    "f_locals",
    "f_builtins",
    "f_code",
    "f_trace",
    "tb_frame",
    "tb_next",
    "gi_frame",
    "cr_frame",
    "ag_frame",
    "gi_code",
    "cr_code",
    "ag_code",
    "cell_contents",  # a closure's variables (the grader's instruments keep theirs there)
)
#: names refused as an attribute (``os.sys``) or an imported name on any object: another way to
#: ``sys`` (``os.sys.modules``), attribute lookups by a string (``Formatter().get_field``,
#: ``functools.update_wrapper``),
#: annotations evaluated as code (``typing.get_type_hints``; ``singledispatch`` calls it) and
#: ``ctypes`` re-exported (``numpy.ctypeslib``)
HIDDEN_DOORS = (
    "sys",
    "get_field",
    "get_type_hints",
    "singledispatch",
    "singledispatchmethod",
    "ctypeslib",
    "ctypes",
    "update_wrapper",  # setattr(wrapper, name, getattr(wrapped, name)) for names given as strings
    "wraps",
    "ForwardRef",  # compiles a string, evaluated later as a type hint
    "from_file",  # torch's: maps a file in C++, unseen by the file guard
)
#: dunder names a submission may bind (any other changes how Python builds its classes: a
#: dataclass's ``__init__`` is compiled from the keys of ``__annotations__``)
BINDABLE_DUNDERS = ("__all__", "__slots__")
#: keywords (and strings naming them) that a submission has no use for: ``os.open(name,
#: dir_fd=fd)`` names a file relative to a directory descriptor, out of the file guard's sight
REFUSED_KEYWORDS = ("dir_fd", "src_dir_fd", "dst_dir_fd", "allow_pickle", "weights_only", "pickle_module")
ALLOWED_DUNDERS = ("__name__", "__doc__", "__init__")
#: names used as public despite the underscore: os._exit, and autograd's engine, whose
#: queue_callback is the only way to run code when backward ends (a3's given helper)
PUBLIC_PRIVATE = ("os._exit", "torch.autograd.Variable._execution_engine")
#: the communicator wrapper's internals (student_comm.StudentComm): refused on any receiver, ``self``
#: included -- ``Helper.method(comm)`` makes ``self`` the wrapper, whatever the parameter is called
WRAPPER_PRIVATE = ("_comm", "_traffic", "_sent")
ATTRIBUTE_BUILTINS = ("getattr", "setattr", "delattr")
#: packages that other modules hold as an attribute (``torch.nn.functional.torch``): a chain through
#: one is checked from there too
REROOTED = ("torch", "numpy", "minidist", "os", "sys")
_ALREADY = "already does what this assignment asks you to write"


@dataclass(frozen=True)
class Rules:
    """An assignment's ``rules.py``: what is forbidden, and what to use instead."""

    modules: tuple[str, ...]
    names: tuple[str, ...]
    refused_imports: tuple[str, ...]
    instead: str
    #: attribute names refused on any object (``REFUSED_ATTRIBUTES``, optional): a C function
    #: that other modules re-export (``activation.F.scaled_dot_product_attention``,
    #: ``torch.ops.aten.scaled_dot_product_attention``) is refused by its last name
    attributes: tuple[str, ...] = ()

    @classmethod
    def of(cls, rules: ModuleType) -> Rules:
        return cls(
            tuple(rules.FORBIDDEN_MODULES),
            tuple(rules.FORBIDDEN_NAMES),
            tuple(rules.REFUSED_IMPORTS),
            rules.ALLOWED_INSTEAD,
            (*getattr(rules, "REFUSED_ATTRIBUTES", ()), *INTERCEPTORS),
        )

    def forbidden(self, dotted: str) -> str | None:
        """The forbidden module or name that ``dotted`` is, or lies inside; None if allowed."""
        return _within(dotted, (*self.modules, *self.names))


@dataclass(frozen=True)
class Refusal:
    line: int
    what: str  # the code refused, e.g. "md.allreduce"
    why: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what}: {self.why}"


def _within(dotted: str, modules: tuple[str, ...]) -> str | None:
    for module in modules:
        if dotted == module or dotted.startswith(module + "."):
            return module
    return None


class _Checker:
    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it was imported as
        self.refusals: list[Refusal] = []
        self.own: set[int] = set()  # ids of the ``self``/``cls`` names that are the submission's own
        self.super_is_builtin = True  # False when the file binds the name ``super`` itself
        self.called: set[int] = set()  # ids of the names called directly (``getattr(x, "a")``)

    def refuse(self, node: ast.AST, what: str, why: str) -> None:
        self.refusals.append(Refusal(getattr(node, "lineno", 0), what, why))

    # --- imports -----------------------------------------------------------------------------
    def _check_import(self, node: ast.AST, dotted: str) -> None:
        if hit := self.rules.forbidden(dotted):
            self.refuse(node, f"import {dotted}", f"{hit} {_ALREADY}")
        elif hit := _within(dotted, self.rules.refused_imports):
            self.refuse(node, f"import {dotted}", f"{hit} is not needed here and not allowed")
        elif hit := _within(dotted, TOOL_MODULES):
            self.refuse(
                node, f"import {dotted}", f"{hit} loads or inspects code; a submission may not use it"
            )
        elif any(_private(part) for part in dotted.split(".")):
            self.refuse(node, f"import {dotted}", "a private module or name of another package")
        elif dotted.split(".")[-1] in self.rules.attributes:
            self.refuse(node, f"import {dotted}", f"{dotted.split('.')[-1]} {_ALREADY}")

    def import_(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_import(node, alias.name)
            top = alias.name.split(".")[0]
            self.aliases[alias.asname or top] = alias.name if alias.asname else top

    def import_from(self, node: ast.ImportFrom) -> None:
        if node.level:  # the submission is a single module: nothing beside it to import
            self.refuse(
                node, "from . import ...", "a submission is one module; relative imports reach outside it"
            )
            return
        module = node.module or ""
        self._check_import(node, module)
        for alias in node.names:
            if alias.name == "*":
                if any(name.startswith(module + ".") for name in (*self.rules.modules, *self.rules.names)):
                    self.refuse(
                        node, f"from {module} import *", "it imports forbidden names; import what you use"
                    )
                continue
            dotted = f"{module}.{alias.name}"
            if alias.name in HIDDEN_DOORS:
                self.refuse(
                    node, f"from {module} import {alias.name}", "it reaches code or modules another way"
                )
            self._check_import(node, dotted)
            self.aliases[alias.asname or alias.name] = dotted

    # --- every other node --------------------------------------------------------------------
    def _dotted(self, node: ast.AST) -> str | None:
        """``md.collectives.ring`` -> "minidist.collectives.ring" through the imports; None if unknown."""
        parts = []
        while True:
            if isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            elif _is_literal_getattr(node):
                parts.append(node.args[1].value)
                node = node.args[0]
            elif isinstance(node, ast.Name) and node.id in self.aliases:
                return ".".join([self.aliases[node.id], *reversed(parts)])
            else:
                return None

    def _check_reference(self, node: ast.AST) -> None:
        dotted = self._dotted(node)
        if dotted is None:
            return
        for top in REROOTED:  # F.torch.jit -> torch.jit too: a package reached through another module
            if f".{top}." in f".{dotted}"[1:]:
                rerooted = top + "." + dotted.rsplit(f".{top}.", 1)[1]
                if rerooted != dotted:
                    self._check_dotted(node, rerooted)
        self._check_dotted(node, dotted)

    def _check_dotted(self, node: ast.AST, dotted: str) -> None:
        if hit := self.rules.forbidden(dotted):
            self.refuse(node, ast.unparse(node), f"{hit} {_ALREADY}")
        elif hit := _within(dotted, self.rules.refused_imports):
            self.refuse(node, ast.unparse(node), f"{hit} is not needed here and not allowed")
        elif (hit := _within(dotted, TOOL_MODULES)) and "." in hit:  # torch.package, as an attribute
            self.refuse(node, ast.unparse(node), f"{hit} loads or inspects code; a submission may not use it")
        elif dotted.startswith("sys.") and dotted.split(".")[1] in (*SYS_ATTRIBUTES, "_getframe"):
            self.refuse(node, ast.unparse(node), "it reaches the interpreter's module or frame machinery")

    def attribute(self, node: ast.Attribute) -> None:
        attr = node.attr
        if attr.startswith("__") and attr.endswith("__") and attr not in ALLOWED_DUNDERS:
            self.refuse(node, ast.unparse(node), f"{attr} reaches the interpreter's internals")
        elif attr in WRAPPER_PRIVATE:
            self.refuse(node, ast.unparse(node), "the grader's communicator wrapper is not yours to open")
        elif attr in FRAME_ATTRIBUTES:
            self.refuse(node, ast.unparse(node), "it reaches a running frame and the grader's variables")
        elif attr in self.rules.attributes:
            self.refuse(node, ast.unparse(node), f"{attr} {_ALREADY}")
        elif attr in HIDDEN_DOORS:
            self.refuse(
                node, ast.unparse(node), f"{attr} reaches code or modules by a string or another path"
            )
        elif (
            attr.startswith("_")
            and id(node.value) not in self.own
            and self._dotted(node) not in PUBLIC_PRIVATE
            and not (attr == "__init__" and self.super_is_builtin and _is_super_call(node.value))
        ):
            self.refuse(node, ast.unparse(node), "a private attribute of an object that is not yours")
        self._check_reference(node)

    def store(self, target: ast.expr) -> None:
        """An assignment or deletion target: nothing imported may be changed (module doc)."""
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.store(element)
            return
        if isinstance(target, ast.Starred):
            self.store(target.value)
            return
        if not isinstance(target, (ast.Attribute, ast.Subscript)):
            return
        if why := self._shared_root(target):
            self.refuse(target, ast.unparse(target)[:80], why)

    def _shared_root(self, node: ast.expr) -> str | None:
        """Why changing something reached through ``node``'s chain would change shared code, or None."""
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.aliases:
            return (
                f"it changes {root.id} ({self.aliases[root.id]}), which the file imported: the grader's "
                "code uses it too; keep your state in your own objects"
            )
        if isinstance(root, ast.Call):
            return "it changes an object reached through a call (a class, say), which other code shares"
        return None

    def call(self, node: ast.Call) -> None:
        for keyword in node.keywords:
            if keyword.arg in REFUSED_KEYWORDS:
                self.refuse(node, f"{keyword.arg}=", "a file named relative to a directory descriptor")
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and node.func.id not in self.aliases
        ):
            target = node.args[0]
            why = self._shared_root(ast.Attribute(value=target, attr="x", ctx=ast.Store()))
            if why:
                self.refuse(node, ast.unparse(node)[:80], why)
        if not (isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS):
            return
        if not _is_literal_attribute_call(node):
            self.refuse(node, ast.unparse(node)[:80], "an attribute whose name is computed at run time")
            return
        name = node.args[1].value
        if (name.startswith("_") and name not in ALLOWED_DUNDERS) or name in (
            *WRAPPER_PRIVATE,
            *FRAME_ATTRIBUTES,
        ):
            self.refuse(node, ast.unparse(node)[:80], "a private attribute of an object that is not yours")
        elif name in self.rules.attributes:
            self.refuse(node, ast.unparse(node)[:80], f"{name} {_ALREADY}")
        if node.func.id == "getattr":
            self._check_reference(node)

    def name(self, node: ast.Name) -> None:
        dunder = node.id.startswith("__") and node.id.endswith("__")
        if dunder and not isinstance(node.ctx, ast.Load) and node.id not in BINDABLE_DUNDERS:
            self.refuse(node, node.id, "it rebinds a name the interpreter gives meaning to")
        if node.id in ATTRIBUTE_BUILTINS and id(node) not in self.called and node.id not in self.aliases:
            self.refuse(
                node, node.id, "getattr passed or renamed: an attribute whose name is computed at run time"
            )
        if node.id in (*TOOL_BUILTINS, "__builtins__", "__loader__", "__spec__"):
            if node.id in self.aliases:  # a name the file imported: not the builtin
                return
            if node.id == "open":
                self.refuse(node, node.id, "a submission has no files to read or write")
            else:
                self.refuse(
                    node, node.id, "it runs or looks up code dynamically; a submission may not use it"
                )
        elif node.id in self.aliases and (hit := self.rules.forbidden(self.aliases[node.id])):
            self.refuse(node, node.id, f"{hit} {_ALREADY}")

    def constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in (*REFUSED_KEYWORDS, *FRAME_ATTRIBUTES):
            self.refuse(node, repr(node.value), "it names what a submission may not reach")
            return
        if isinstance(node.value, str):
            for name in (*self.rules.modules, *self.rules.names):
                if name in node.value:
                    self.refuse(node, repr(node.value)[:60], f"the string names {name}, which is forbidden")
                    return


def _private(name: str) -> bool:
    """``_C``, ``_python_dispatch``: private; ``__future__``: not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _binds_name(tree: ast.Module, name: str) -> bool:
    """Whether ``tree`` assigns, defines, imports or takes as a parameter the name ``name``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.arg) and node.arg == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) == name:
            return True
    return False


def _is_super_call(node: ast.expr) -> bool:
    """``super()`` (no arguments): ``super().__init__(...)`` initialises the submission's own
    subclass (an ``nn.Module``, say); ``__init__`` on any other object could re-initialise
    something the grader owns."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "super"
        and not node.args
        and not node.keywords
    )


def _is_literal_attribute_call(node: ast.Call) -> bool:
    """``getattr``/``setattr``/``delattr`` with the attribute's name written as a string."""
    return (
        len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
    )


def _is_literal_getattr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and _is_literal_attribute_call(node)
    )


def _own_receivers(tree: ast.Module) -> set[int]:
    """The ``self``/``cls`` names (node ids) that stand for the submission's own object: the
    first parameter of a method written directly in one of its classes, never reassigned in
    that method. Only on them may the submission use private attributes (``self._buf``)."""
    own: set[int] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
                continue
            first = method.args.args[0].arg
            uses = [n for n in ast.walk(method) if isinstance(n, ast.Name) and n.id == first]
            if first in ("self", "cls") and not any(isinstance(n.ctx, ast.Store) for n in uses):
                own.update(id(n) for n in uses)
    return own


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def check(source: str | bytes, rules: Rules, filename: str = "<submission>") -> Refusal | None:
    """The first thing in ``source`` that ``rules`` forbid (the lowest line), or None.

    ``source`` must parse (intake checks the syntax first). Docstrings are prose: not checked.
    """
    tree = ast.parse(source, filename=filename)
    checker = _Checker(rules)
    checker.own = _own_receivers(tree)
    checker.super_is_builtin = not _binds_name(tree, "super")
    checker.called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    # imports first, wherever they are, so that every use of an imported name is resolved
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            checker.import_(node)
        elif isinstance(node, ast.ImportFrom):
            checker.import_from(node)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            for target in node.targets:
                checker.store(target)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
            checker.store(node.target)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            checker.store(node.optional_vars)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            checker.attribute(node)
        elif isinstance(node, ast.Call):
            checker.call(node)
        elif isinstance(node, ast.Name):
            checker.name(node)
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            checker.constant(node)
    if not checker.refusals:
        return None
    return min(checker.refusals, key=lambda refusal: refusal.line)
