"""The layers of ``minidist``: a module imports only its own layer and the ones below.

Every module under ``lib/minidist`` is given a layer by the first part of its name (the table
in the package docstring, ``minidist.__doc__``, the only place it is written; a module that no
row names fails the test, so a new module must be placed). Every
import it makes -- at the top, inside a function, ``import x``, ``from x import y`` and
``from . import y`` -- is read from its syntax tree, and each one into a higher layer is
reported with its file and line. The package root ``minidist`` (``import minidist as md``)
re-exports names up to the ``parallel`` layer (DDP), so it counts as that layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import minidist

LIB = Path(minidist.__file__).resolve().parent


def layers_from_docstring(doc: str) -> list[tuple[str, tuple[str, ...]]]:
    """The layer table of the package docstring: the rows after the ``layer  modules`` header."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layer", "modules"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        name, *modules = line.split()
        rows.append((name, tuple(modules)))
    return rows


#: (layer, the first parts of module names after ``minidist.``), lowest first: written once, in
#: the package docstring of minidist/__init__.py
LAYERS: list[tuple[str, tuple[str, ...]]] = layers_from_docstring(minidist.__doc__)
ROOT_LAYER = "parallel"  # what `import minidist` brings in (minidist/__init__.py)


def test_the_table_is_read_from_the_docstring():
    names = [name for name, _ in LAYERS]
    assert names == [
        "foundations",
        "transport",
        "collectives",
        "launch",
        "parallel",
        "data",
        "models",
        "tools",
    ]
    assert "comm" in dict(LAYERS)["foundations"] and "bench" in dict(LAYERS)["tools"]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of ``module`` (a dotted name); None outside minidist."""
    parts = module.split(".")
    if parts[0] != "minidist":
        return None
    if len(parts) == 1:
        return [name for name, _ in LAYERS].index(ROOT_LAYER)
    for index, (_, firsts) in enumerate(LAYERS):
        if parts[1] in firsts:
            return index
    raise AssertionError(
        f"{module} is in no layer: add its first name to a row of the layer table "
        "in the docstring of minidist/__init__.py"
    )


def module_name(path: Path, lib: Path = LIB) -> str:
    parts = ["minidist", *path.relative_to(lib).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, lib: Path = LIB) -> list[tuple[str, int]]:
    """(imported module, line) for every import in ``path``, relative ones resolved."""
    name = module_name(path, lib)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            # `from minidist import data` imports minidist.data; `from minidist.x import y` imports minidist.x
            if base == "minidist":
                found += [(f"minidist.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((base, node.lineno))
    return found


def upward_imports(lib: Path = LIB) -> list[str]:
    errors = []
    for path in sorted(lib.rglob("*.py")):
        name = module_name(path, lib)
        if name == "minidist":
            continue  # the package root re-exports; it is not a layer of its own
        mine = layer_of(name)
        for imported, line in imports_of(path, lib):
            theirs = layer_of(imported)
            if theirs is not None and theirs > mine:
                errors.append(
                    f"{path.relative_to(lib.parent)}:{line}: {name} ({LAYERS[mine][0]}) imports "
                    f"{imported} ({LAYERS[theirs][0]})"
                )
    return errors


def test_every_module_imports_only_its_layer_and_the_ones_below():
    errors = upward_imports()
    assert not errors, "imports into a higher layer:\n" + "\n".join(errors)


#: rules inside a layer, beyond the table: (importer, imported, why); the first parts of names
WITHIN_A_LAYER = [
    ("parallel", "optim", "training patterns take optimizers as arguments"),
    ("serve", "bench", "serving is measured by bench, never the reverse"),
]


def test_no_module_breaks_a_rule_inside_its_layer():
    errors = []
    for path in sorted(LIB.rglob("*.py")):
        name = module_name(path)
        for importer, imported, why in WITHIN_A_LAYER:
            if name.split(".")[1:2] != [importer]:
                continue
            errors += [
                f"{path.relative_to(LIB.parent)}:{line}: {name} imports {module} ({why})"
                for module, line in imports_of(path)
                if module.split(".")[1:2] == [imported] and module.startswith("minidist.")
            ]
    assert not errors, "\n".join(errors)


def test_every_module_has_a_layer():
    for path in LIB.rglob("*.py"):
        assert layer_of(module_name(path)) is not None


def test_the_check_catches_an_upward_import(tmp_path):
    # the two upward imports this test once found, put back in copies, and a relative one
    lib = tmp_path / "minidist"
    (lib / "data").mkdir(parents=True)
    (lib / "models").mkdir()
    for init in ("__init__.py", "data/__init__.py", "models/__init__.py"):
        (lib / init).write_text("")
    (lib / "data" / "lm.py").write_text("from minidist.glove.data import cache_dir\n")
    (lib / "models" / "pretrained.py").write_text("import torch\nfrom minidist.memory import tensor_bytes\n")
    (lib / "transport.py").write_text("def f():\n    from . import collectives\n")
    (lib / "launch.py").write_text("import minidist.transport\nfrom minidist import errors\n")  # allowed
    errors = upward_imports(lib)
    assert len(errors) == 3, errors
    assert errors[0].startswith("minidist/data/lm.py:1: minidist.data.lm (data) imports minidist.glove.data")
    assert "minidist.models.pretrained (models) imports minidist.memory (tools)" in errors[1]
    assert "minidist/transport.py:2: minidist.transport (transport) imports minidist.collectives" in errors[2]
