"""This run's own command line, as typed: the ``--resume`` line a stopped run ends with, and the fixes that
are the same command with something added (``--resume``, ``--packing none --allow ...``)."""

from __future__ import annotations

import os

__all__ = ["command_with", "remember_command", "resume_command"]

_COMMAND: list[str] = []  # this run's `kernelguard train` arguments, as typed (every rank gets them all)


def remember_command(argv: list[str]) -> None:
    _COMMAND[:] = argv


def resume_command(flag: str = "--resume") -> str:
    """The exact command line that continues this run: its own arguments plus ``flag``."""
    return command_with([] if flag in _COMMAND else [flag])


def command_with(extra: list[str]) -> str:
    """This run's own command line with ``extra`` arguments added. Under plain torchrun the torchrun options
    are not known here, so they are named as a placeholder to keep."""
    import shlex

    args = [*_COMMAND, *extra]
    if "LOCAL_RANK" in os.environ and "KERNELGUARD_LAUNCH_DIR" not in os.environ:
        return f"torchrun TORCHRUN_OPTIONS -m kernelguard.train {shlex.join(args)}"
    return f"kernelguard train {shlex.join(args)}"
