"""What every ``kernelguard`` subcommand shares: its parser class, printing to a pipe that may close, and the run
of a command through the one exit-code table (:func:`kernelguard.errors.exit_code_for`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kernelguard.errors import (
    EXIT_USAGE,
    INTERRUPTED_LINES,
    ConfigError,
    KernelGuardError,
    exit_code_for,
    startup_interrupts,
)
from kernelguard.stack import help_formatter, wrap_message

__all__ = ["INTERRUPTED", "Parser", "command_parser", "non_empty_path", "print_out", "run_command"]

INTERRUPTED = INTERRUPTED_LINES[""]["SIGINT"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's default exit code is already 2; keep it, with our one-line hint.
        from kernelguard.resolution import usage_suggestion

        self.print_usage(sys.stderr)
        said = usage_suggestion(message, self._option_string_actions)[0]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {said}\n(see `{self.prog} --help`)\n")


def non_empty_path(text: str) -> str:
    """argparse type of a path argument: an empty one (an unset shell variable) would mean the current folder."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "is empty; it must name a path (an unset shell variable gives an empty argument)"
        )
    return text


def command_parser(name: str, *, description: str, epilog: str | None = None) -> Parser:
    """The parser of ``kernelguard NAME``."""
    return Parser(prog=f"kernelguard {name}", formatter_class=help_formatter(), description=description,
                  epilog=epilog)


def print_out(text: str) -> None:
    """Print, tolerating a closed pipe (`kernelguard check | head`)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run_command(body: Callable[[], int], command: tuple[str, list[str]] | None = None) -> int:
    """Run a command that reads and reports (check, lock, env, issues): Ctrl-C while it starts is one line,
    a kernelguard error is its message and its exit code, never a traceback. ``command`` (its name and
    arguments): an error naming the value to put instead (``details["replace"]``) gets this command line with
    it in place as its fix, a line that pastes."""
    with startup_interrupts(INTERRUPTED):
        try:
            return body()
        except KernelGuardError as exc:
            if command is not None:
                exc = _with_replacement(exc, *command)
            usage = isinstance(exc, ConfigError)
            print(wrap_message(f"kernelguard: {'error: ' if usage else ''}{exc}"), file=sys.stderr)
            return exit_code_for(exc)
        except KeyboardInterrupt as exc:  # Ctrl-C once a file is being written: one line and the shell's code
            print(INTERRUPTED, file=sys.stderr, flush=True)
            return exit_code_for(exc)


def _with_replacement(error: KernelGuardError, name: str, argv: list[str]) -> KernelGuardError:
    from kernelguard.resolution import with_corrected_command

    return with_corrected_command(error, name, argv)
