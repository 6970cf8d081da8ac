"""``kernelguard train``: everything after ``train`` goes to :mod:`kernelguard.train` untouched (its own parser,
launcher, signals and exit codes)."""

from __future__ import annotations

import argparse
import os
import sys

from kernelguard.errors import EXIT_INTERRUPTED, INTERRUPTED_LINES

__all__ = ["HELP", "main", "parser"]

HELP = "packed FSDP2 fine-tuning that starts only once the guard passes (kernelguard train --help)"


def parser() -> argparse.ArgumentParser:
    """`kernelguard train`'s parser, derived from its settings (tests walk every command's to hold shared flags
    to one grammar)."""
    from kernelguard.train import build_parser

    return build_parser()


def main(argv: list[str], *, program: bool = False) -> int:
    """``program``: the console script (or ``python -m kernelguard``), which may leave without the
    interpreter's teardown once a process group existed; an in-process caller gets the code back."""
    try:  # Ctrl-C while the trainer's modules import: its own one line, as from inside it
        from kernelguard.train import exit_program
        from kernelguard.train import main as train_main
    except KeyboardInterrupt:  # leave at once: the teardown after a half-done import can fail again
        print(INTERRUPTED_LINES["train"]["SIGINT"], file=sys.stderr,
              flush=True)
        os._exit(EXIT_INTERRUPTED)
    code = train_main(argv)
    return exit_program(code) if program else code
