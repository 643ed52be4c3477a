"""``python -m grader COMMAND ...``: the instructor's command line.

Each command is a module with ``add_arguments(parser)`` and ``main(args) -> exit status``;
adding one (``grade``, ``gradescope``) means adding a module and a line to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys

from . import grade, gradescope, release

#: name -> (module, one-line help)
COMMANDS = {
    "release": (release, "generate assignments/ from solutions/ (--check: fail if it is stale)"),
    "gradescope": (
        gradescope,
        "build a Gradescope autograder zip (setup.sh, run_autograder) for an assignment",
    ),
    "grade": (grade, "grade a folder of submissions in sandboxes: gradebook.csv, results.json, feedback.md"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m grader", description="The instructor's tools: release assignments, grade submissions."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=(module.__doc__ or "").strip())
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
        module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = COMMANDS[args.command]
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
