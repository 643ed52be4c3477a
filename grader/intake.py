"""Find the submissions, unpack and validate them, and keep only the files that are graded.

A submission is a folder or a ``.zip`` in SUBMISSIONS_DIR, named by the student id
(``alice/`` or ``alice.zip``). It holds the assignment's student files (``collectives.py``),
at the top or inside one extra folder (``alice.zip: alice/collectives.py``, as LMS downloads
do). Everything else in it -- tests, ``conftest.py``, ``pytest.ini``, notebooks, caches -- is
ignored: only the student files are copied on, so nothing else can affect grading.

Refused, with a reason for the gradebook (status ``invalid_submission``): a corrupt or empty
zip, a member with an absolute path or ``..``, a symlink, more than ``MAX_MEMBERS`` members or
``MAX_TOTAL_BYTES`` uncompressed (zip bombs; sizes are counted while reading, not trusted
from the header), a student file larger than ``MAX_FILE_BYTES``, a missing student file, a
student file that is not UTF-8 text or has a syntax error (parsed, never run). Nothing is
extracted to disk: the few files kept are read from the zip into memory. In a folder, sizes
are checked (``stat``) before anything is read, and only the candidate student files are read
at all, each with a bounded read: a 10 GB (sparse) file costs a ``stat``, not 10 GB of memory.
An id that the grader's own output uses (``RESERVED_IDS``: ``gradebook.csv``, anything
starting with a dot, such as ``.sandbox`` or ``.seed-key``) is refused too.

Refused with the status ``forbidden`` (``check_forbidden``): a student file that uses what the
assignment forbids -- the library's implementation of the task (``grader/forbidden.py``).
"""

from __future__ import annotations

import ast
import hashlib
import re
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from . import forbidden

MAX_MEMBERS = 1000
MAX_TOTAL_BYTES = 50 * 2**20
MAX_FILE_BYTES = 2 * 2**20
_STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")
#: names of what the grader writes in OUT_DIR beside the students' folders (compared case-blind)
RESERVED_IDS = ("gradebook.csv", "gradebook.csv.tmp")


class InvalidSubmission(Exception):
    """Why a submission cannot be graded (shown in the gradebook and the feedback)."""


@dataclass
class Submission:
    student: str
    source: Path
    files: dict[str, bytes] = field(default_factory=dict)  # student file name -> content
    error: str = ""  # non-empty: invalid, with the reason
    refused: str = ""  # non-empty: uses something forbidden (file, line, what, why)

    def digest(self) -> str:
        """A hash of what is graded (the kept files), for resuming and for the record."""
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        h.update(self.error.encode())
        return h.hexdigest()


def check_forbidden(submission: Submission, rules: forbidden.Rules) -> None:
    """Set ``submission.refused`` when a student file uses what ``rules`` forbid (never runs it)."""
    for name, data in sorted(submission.files.items()):
        if name.endswith(".py"):
            refusal = forbidden.check(data, rules, filename=name)
            if refusal is not None:
                submission.refused = f"{name}, {refusal}"
                return


def usable_id(student: str) -> bool:
    """Whether ``student`` may name a folder of OUT_DIR: a plain safe file name, not one the grader uses."""
    return bool(_STUDENT_ID.match(student)) and student.lower() not in RESERVED_IDS


def discover(folder: Path) -> list[Path]:
    """The submissions in ``folder``: sub-folders and .zip files, sorted by student id."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder of submissions")
    found = [p for p in folder.iterdir() if not p.name.startswith(".") and (p.is_dir() or p.suffix == ".zip")]
    return sorted(found, key=lambda p: (student_id(p), p.name))


def student_id(path: Path) -> str:
    return path.name[: -len(".zip")] if path.name.endswith(".zip") and not path.is_dir() else path.name


def load(path: Path, student_files: tuple[str, ...]) -> Submission:
    """Read one submission; an unusable one comes back with ``error`` set (never raises)."""
    submission = Submission(student_id(path), path)
    try:
        if not _STUDENT_ID.match(submission.student):
            raise InvalidSubmission(
                f"the name {submission.student!r} is not a usable student id (letters, digits, _ . @ + -)"
            )
        if submission.student.lower() in RESERVED_IDS:
            raise InvalidSubmission(
                f"the name {submission.student!r} is reserved for the grader's output; rename the submission"
            )
        if path.is_symlink():
            raise InvalidSubmission("the submission is a symlink")
        if path.suffix == ".zip" and path.is_file():
            members = _read_zip(path)
        else:
            members = _read_folder(path, student_files)
        submission.files = _pick(members, student_files)
    except InvalidSubmission as error:
        submission.error = str(error)
    except OSError as error:  # unreadable (permissions, vanished): this submission's problem only
        submission.error = f"the submission cannot be read ({error.strerror or type(error).__name__})"
    return submission


def _read_zip(path: Path) -> dict[str, bytes | None]:
    """Member path -> content (None for members we will not need; only their names are checked)."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise InvalidSubmission(f"not a valid zip file ({error})") from None
    with archive:
        infos = archive.infolist()
        if not infos:
            raise InvalidSubmission("the zip file is empty")
        if len(infos) > MAX_MEMBERS:
            raise InvalidSubmission(f"the zip file has {len(infos)} members, more than {MAX_MEMBERS}")
        members: dict[str, bytes | None] = {}
        total = 0
        for info in infos:
            name = _safe_name(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise InvalidSubmission(
                    f"the zip file contains a symlink ({info.filename}); send plain files"
                )
            if info.is_dir():
                continue
            try:
                with archive.open(info) as member:
                    data = member.read(MAX_TOTAL_BYTES - total + 1)  # never trust file_size
            except (zipfile.BadZipFile, OSError, NotImplementedError, RuntimeError, EOFError) as error:
                raise InvalidSubmission(f"cannot read {info.filename} from the zip ({error})") from None
            total += len(data)
            if total > MAX_TOTAL_BYTES:
                raise InvalidSubmission(f"the zip file unpacks to more than {MAX_TOTAL_BYTES >> 20} MiB")
            members[name] = data
    return members


def _safe_name(name: str) -> str:
    if "\\" in name or "\0" in name:
        raise InvalidSubmission(f"the zip file has a member with an unusual name ({name!r})")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise InvalidSubmission(f"the zip file has a member outside the submission ({name!r})")
    return path.as_posix()


def _read_folder(folder: Path, student_files: tuple[str, ...]) -> dict[str, bytes | None]:
    """Member path -> content of the candidate student files (None for the rest), sizes checked first."""
    members: dict[str, bytes | None] = {}
    for count, path in enumerate(sorted(folder.rglob("*")), start=1):
        if count > MAX_MEMBERS:
            raise InvalidSubmission(f"the folder has more than {MAX_MEMBERS} files")
        if path.is_symlink():
            raise InvalidSubmission(f"the submission contains a symlink ({path.relative_to(folder)})")
        if path.is_file():
            members[path.relative_to(folder).as_posix()] = None  # read below, when wanted
    total = 0
    for name in members:
        if not _wanted(name, student_files):
            continue
        size = (folder / name).stat().st_size
        if size > MAX_FILE_BYTES:  # before reading: a huge (sparse) file is never read
            raise InvalidSubmission(f"{name} is larger than {MAX_FILE_BYTES >> 20} MiB")
        total += size
        if total > MAX_TOTAL_BYTES:
            raise InvalidSubmission(f"the student files add up to more than {MAX_TOTAL_BYTES >> 20} MiB")
        with open(folder / name, "rb") as file:
            members[name] = file.read(MAX_FILE_BYTES + 1)  # bounded, should it grow after the stat
    return members


def _wanted(name: str, student_files: tuple[str, ...]) -> bool:
    """A student file at the top or one folder down (the only places ``_pick`` looks)."""
    return name.count("/") <= 1 and name.rsplit("/", 1)[-1] in student_files


def _pick(members: dict[str, bytes | None], student_files: tuple[str, ...]) -> dict[str, bytes]:
    """The student files, at the top level or inside exactly one extra folder."""
    ignored = ("__MACOSX/",)
    names = {name for name in members if not name.startswith(ignored)}
    tops = {name.split("/", 1)[0] for name in names if "/" in name}
    prefix = ""
    if not any(f in names for f in student_files) and len(tops) == 1:
        prefix = tops.pop() + "/"
    files: dict[str, bytes] = {}
    for wanted in student_files:
        data = members.get(prefix + wanted)
        if data is None:
            where = f" (in {prefix.rstrip('/')}/)" if prefix else ""
            raise InvalidSubmission(f"missing {wanted}{where}: hand in {', '.join(student_files)}")
        if len(data) > MAX_FILE_BYTES:
            raise InvalidSubmission(f"{wanted} is larger than {MAX_FILE_BYTES >> 20} MiB")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidSubmission(f"{wanted} is not UTF-8 text") from None
        if wanted.endswith(".py"):
            _check_syntax(wanted, data)
        files[wanted] = data
    return files


def _check_syntax(name: str, data: bytes) -> None:
    """Parse (never run) a Python file: a syntax error is reported with its line, before any sandbox."""
    try:
        ast.parse(data, filename=name)
    except SyntaxError as error:
        raise InvalidSubmission(f"{name} has a syntax error at line {error.lineno}: {error.msg}") from None
    except (ValueError, RecursionError, MemoryError) as error:
        raise InvalidSubmission(f"{name} cannot be parsed ({type(error).__name__})") from None
