"""How close each function of a submission is to the library code that implements the same thing.

The course ships ``lib/minidist``, which contains working implementations of what the
assignments ask for (``collectives/ring.py``, ``butterfly.py``, ``rooted.py``; the GloVe
parameter server and Hogwild), and lecture 02 points students at them. Reading them is fine;
handing them in is not. The grader does not refuse a copy (a copy is not always detectable,
and a student who learnt from the library writes similar code): it *reports*, for every
submission, the best match against the library, and flags close copies for the instructor.

The comparison, per function (its docstring dropped, comments gone):

1. tokens, normalised: identifiers become ``ID``, numbers and strings ``LIT``; keywords and
   operators stay. Renaming variables or reformatting changes nothing::

       flat[lo:hi] += buffer      ->   ID [ ID : ID ] += ID

2. ``difflib.SequenceMatcher`` ratio between the two token lists: 2 * matched / (len a + len b),
   1.0 for the same code up to names and constants.

A submission's score is the highest ratio of any of its functions against any function of
the library files; skipped are the helpers the assignment gives (every submission has them:
``grading.GIVEN_FUNCTIONS``) and functions shorter than ``MIN_TOKENS`` tokens.
``FLAG_AT`` is calibrated on the reference solutions and the example students, which stay
below it, and on a copy of ``ring.py`` adapted to the task, which is above
(``tests/grader/test_grade.py`` and ``tests/grader/test_grade_a2.py`` check all three).
"""

from __future__ import annotations

import ast
import difflib
import io
import keyword
import tokenize
from dataclasses import dataclass
from pathlib import Path

MIN_TOKENS = 40  # shorter functions (a return, a check) look alike whoever wrote them
FLAG_AT = 0.85  # the solutions score about 0.67 (a1) and 0.75 (a2), a copy of ring.py 1.0


@dataclass(frozen=True)
class Match:
    score: float  # 0..1
    function: str  # the submission's function
    library: str  # "path:function" of the closest library function

    @property
    def flagged(self) -> bool:
        return self.score >= FLAG_AT


def normalised_tokens(source: str) -> list[str]:
    """The token kinds of ``source``: identifiers ``ID``, literals ``LIT``, keywords and operators as is."""
    out = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            out.append(token.string if keyword.iskeyword(token.string) else "ID")
        elif token.type in (tokenize.NUMBER, tokenize.STRING) or token.type == getattr(
            tokenize, "FSTRING_START", -1
        ):
            out.append("LIT")
        elif token.type == tokenize.OP:
            out.append(token.string)
    return out


def functions(source: str) -> dict[str, list[str]]:
    """``name`` (``Class.method`` for methods) -> normalised tokens, docstrings dropped."""
    tree = ast.parse(source)
    found: dict[str, list[str]] = {}

    def add(node: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:] or [ast.Pass()]
        copy = ast.FunctionDef(
            name=node.name,
            args=node.args,
            body=body,
            decorator_list=[],
            returns=None,
            type_comment=None,
            type_params=[],
        )
        found[name] = normalised_tokens(ast.unparse(ast.fix_missing_locations(copy)))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node, node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(item, f"{node.name}.{item.name}")
    return found


def library_functions(paths: list[Path], root: Path) -> dict[str, list[str]]:
    """``"lib/.../ring.py:ring_allgather_"`` -> tokens, for every function of ``paths``."""
    found = {}
    for path in paths:
        for name, tokens in functions(path.read_text()).items():
            if len(tokens) >= MIN_TOKENS // 2:
                found[f"{path.relative_to(root).as_posix()}:{name}"] = tokens
    return found


def best_match(submission: str, library: dict[str, list[str]], given: tuple[str, ...] = ()) -> Match:
    """The closest pair (submitted function, library function), skipping the functions named in ``given``."""
    best = Match(0.0, "", "")
    for name, tokens in functions(submission).items():
        if len(tokens) < MIN_TOKENS or name in given:
            continue
        matcher = difflib.SequenceMatcher(None, autojunk=False)
        matcher.set_seq2(tokens)
        for library_name, library_tokens in library.items():
            matcher.set_seq1(library_tokens)
            if matcher.real_quick_ratio() <= best.score or matcher.quick_ratio() <= best.score:
                continue
            score = matcher.ratio()
            if score > best.score:
                best = Match(round(score, 3), name, library_name)
    return best
