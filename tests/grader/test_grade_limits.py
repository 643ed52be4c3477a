"""``python -m grader grade --sandbox-memory/--sandbox-disk/--sandbox-pids``: parsed, hashed, applied.

The limits are options: their values are read with a unit suffix and refused with a message
that says what to write; they are part of the configuration digest (a resume with other limits
grades again). That a memory limit too small for the solution makes its grading fail with the
memory-limit reason is graded in ``batches/test_limits.py``.
"""

from __future__ import annotations

import pytest

from grader import grade
from grader.__main__ import build_parser

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def parse(*options: str):
    return build_parser().parse_args(["grade", "a1_collectives", "subs", "--out", "out", *options])


def test_defaults_are_the_documented_limits():
    args = parse()
    assert (args.sandbox_memory, args.sandbox_disk, args.sandbox_pids) == (6 * GIB, 512 * MIB, 512)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6G", 6 * GIB),
        ("512M", 512 * MIB),
        ("512m", 512 * MIB),
        ("64MiB", 64 * MIB),
        ("64MB", 64 * MIB),
        ("3k", 3 * KIB),
        ("1T", 1024 * GIB),
        ("4096", 4096),
        (" 2G ", 2 * GIB),
    ],
)
def test_sizes_with_a_binary_suffix(text, expected):
    args = parse("--sandbox-memory", text, "--sandbox-disk", text)
    assert args.sandbox_memory == expected and args.sandbox_disk == expected


@pytest.mark.parametrize("option", ["--sandbox-memory", "--sandbox-disk"])
@pytest.mark.parametrize("text", ["0", "0G", "-1G", "6X", "1.5G", "G", "", "lots", "2048T"])
def test_bad_sizes_are_refused_with_what_to_write(option, text, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(f"{option}={text}")  # with "=": argparse reads "-1G" alone as an option
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}: {text!r} is not a usable size" in error
    assert "e.g. 6G or 512M" in error


@pytest.mark.parametrize("text, expected", [("1", 1), ("512", 512), ("4194304", 4194304)])
def test_process_counts(text, expected):
    assert parse("--sandbox-pids", text).sandbox_pids == expected


@pytest.mark.parametrize("text", ["0", "-5", "1e3", "many", "", "4194305", "512k", "\u00b2"])
def test_bad_process_counts_are_refused_with_what_to_write(text, capsys):
    with pytest.raises(SystemExit):
        parse(f"--sandbox-pids={text}")
    error = capsys.readouterr().err
    assert f"argument --sandbox-pids: {text!r} is not a usable count" in error
    assert "a whole number from 1 to 4194304" in error


def test_every_limit_is_part_of_the_configuration_digest():
    """Equal options give equal digests; changing any one limit, or isolation, gives another (resume
    regrades)."""
    base = grade.config_digest("a1_collectives", parse(), "key")
    assert grade.config_digest("a1_collectives", parse(), "key") == base
    assert grade.config_digest("a1_collectives", parse("--sandbox-memory", "6G"), "key") == base
    changed = [
        parse("--sandbox-memory", "64M"),
        parse("--sandbox-disk", "1G"),
        parse("--sandbox-pids", "100"),
        parse("--no-isolation"),
    ]
    digests = {grade.config_digest("a1_collectives", args, "key") for args in changed}
    assert len(digests) == 4 and base not in digests
