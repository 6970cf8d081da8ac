"""``kernelguard lock``: run the check and, when it passes, write the lock of the stack it verified."""

from __future__ import annotations

import argparse
import sys

from kernelguard.errors import EXIT_FAIL, EXIT_OK, end_startup_interrupts, exit_codes_help

from .check import add_check_arguments, check_options
from .common import command_parser, non_empty_path, print_out, run_command

__all__ = ["HELP", "main", "parser"]

HELP = "check, then write kernelguard.lock: the verified stack, enforced at job start with --lock"


def parser() -> argparse.ArgumentParser:
    """This command's parser (tests walk every command's to hold shared flags to one grammar)."""
    return _parser()


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "lock",
        description="Run the check and, when it passes, write the lock of the stack it verified (schema in "
        "docs/lock.md). Jobs enforce it with `kernelguard check --lock`, `kernelguard train --lock`, "
        "kernelguard.require(lock=...) or KERNELGUARD_LOCK.",
        epilog=exit_codes_help("lock"),
    )
    add_check_arguments(parser)
    parser.add_argument("--output", "-o", default="kernelguard.lock", type=non_empty_path, metavar="FILE",
                        help="[default: kernelguard.lock]")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return run_command(lambda: _lock(args), command=("lock", argv))


def _lock(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kernelguard.errors import ConfigError
    from kernelguard.stack import render, run_check, write_lock

    if Path(args.output).is_dir():  # refused before the check runs, not as IsADirectoryError after it
        raise ConfigError(f"--output {args.output} is a directory; the lock is written to a file.",
                          fix=f"--output {Path(args.output) / 'kernelguard.lock'}")
    from dataclasses import replace

    # the lock records every Hub repository the load fetches, with the commit this image's cache holds
    result = run_check(replace(check_options(args), hub_repos=True))  # type: ignore[type-var]
    if not result.ok:  # a lock of a stack that fails its own check would only pin the failure
        print_out(render(result))
        print(f"kernelguard lock: the check fails, so {args.output} was not written.", file=sys.stderr)
        return EXIT_FAIL
    end_startup_interrupts()  # a file is written next: Ctrl-C unwinds through its clean-up
    path = write_lock(result, args.output)
    print_out(f"kernelguard lock: wrote {path} ({len(result.resolution.verdicts)} kernels, target "
              f"{', '.join(f'sm {a}' for a in result.resolution.target.archs) or 'unknown'}); "
              f"enforce it at job start with `kernelguard check --lock {path}` or KERNELGUARD_LOCK={path}")
    return EXIT_OK
