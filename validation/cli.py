"""`fasttrack`: the validator's command line.

Each subcommand lives in its own module, which defines `add_parser(subparsers)` (registering the
subcommand and its arguments) and `run(args) -> int` (the exit code). Errors a user can cause
end in one line on stderr and a non-zero exit; tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module). A module registers one subcommand.
COMMANDS: list[tuple[str, str]] = [
    ("build", "validation.cmd_build"),
    ("gate", "validation.cmd_gate"),
    ("rfc", "validation.cmd_rfc"),
    ("audit", "validation.cmd_audit"),
    ("validate", "validation.cmd_validate"),
    ("report", "validation.cmd_report"),
    ("check", "validation.cmd_check"),
    ("sign", "validation.cmd_sign"),
    ("verify", "validation.cmd_verify"),
]


class UserError(Exception):
    """An error the user can fix (bad input, missing GPU, unknown kernel); exit code in `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fasttrack",
        description="Validate agent-proposed GPU kernel changes and turn the results into evidence.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules = {}
    for name, modname in COMMANDS:
        mod = importlib.import_module(modname)
        mod.add_parser(sub)
        modules[name] = mod
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except UserError as e:
        print(f"fasttrack {args.command}: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print(f"fasttrack {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m validation.cli` (the GPU host's form) runs this file as `__main__`, a second copy
    # of the module whose UserError is not the one the subcommands raise (they import
    # validation.cli): run that module's main, so a user's error ends in its one line
    from validation.cli import main as _main

    sys.exit(_main())
