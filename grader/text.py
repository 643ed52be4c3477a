"""Sanitise student-controlled text where the grader writes it (files, CSV, terminal).

Anything a submission produces -- exception messages, printed output, even its id -- is
hostile text. It must not be able to

* kill the writer: a lone surrogate (``"\\udcff"``, what Python makes of undecodable bytes)
  cannot be encoded as UTF-8, so ``Path.write_text`` raises. ``clean`` replaces it;
* drive the instructor's terminal or a spreadsheet: ANSI escape sequences and other control
  characters are removed (``\\n`` and ``\\t`` kept where text is multi-line);
* forge the grader's own lines in ``feedback.md``: ``fenced`` puts student text in a code
  block whose fence is longer than any run of backticks inside it, so the text can neither
  close the block nor render as Markdown (a "**Score: 87 / 87**" line stays literal);
* run as a formula in a spreadsheet opening ``gradebook.csv``: ``csv_cell`` prefixes cells
  starting with ``= + - @`` (or a tab / carriage return) with ``'``.
"""

from __future__ import annotations

import math
import re

#: CSI / OSC / other ESC sequences, then any remaining C0/C1 control character except \t \n
_ANSI = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])"  # ESC [ CSI, ESC ] OSC, ESC x
    r"|\x9b[0-?]*[ -/]*[@-~]"  # the one-byte C1 CSI
)
_CONTROL_MULTI = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_LINE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BACKTICKS = re.compile(r"`+")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def clean(text: object, multiline: bool = True, limit: int | None = None) -> str:
    """``text`` as a string that encodes as UTF-8 and holds no escape or control characters.

    Surrogates (and anything else UTF-8 cannot encode) become U+FFFD; ANSI escape sequences
    are dropped whole, other control characters removed; ``\\r\\n`` becomes ``\\n``. With
    ``multiline=False`` newlines and tabs become spaces too (for one-line fields: CSV cells,
    the terminal summary, the progress bar). ``limit`` cuts to that many characters.
    """
    text = str(text)
    if _needs_reencode(text):  # lone surrogates: their bytes are not UTF-8, each becomes U+FFFD
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    text = _CONTROL_MULTI.sub("", text) if multiline else _CONTROL_LINE.sub(" ", text)
    if limit is not None and len(text) > limit:
        text = text[:limit]
    return text


def _needs_reencode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def fenced(text: object, info: str = "text") -> list[str]:
    """Lines of a Markdown code block holding ``text`` (cleaned) literally.

    The fence is one backtick longer than the longest backtick run in the text (at least
    three), so no line of the text can close it.
    """
    body = clean(text)
    longest = max((len(run) for run in _BACKTICKS.findall(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, body, fence]


def inline(text: object, limit: int = 300) -> str:
    """One line of student text for Markdown outside a code block: cleaned, markup characters escaped."""
    line = clean(text, multiline=False, limit=limit)
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|<>~])", r"\\\1", line)


def csv_cell(value: object, limit: int = 500) -> str:
    """A one-line CSV cell that a spreadsheet shows as text, never evaluates as a formula."""
    cell = clean(value, multiline=False, limit=limit)
    return "'" + cell if cell.startswith(_FORMULA_START) else cell


def finite(value: object) -> object:
    """``value`` with every non-finite float replaced by None (for strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value
