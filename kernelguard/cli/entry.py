"""The `kernelguard` program's first code (the console script and ``python -m kernelguard``).

A Ctrl-C (or, for `kernelguard train`, a SIGTERM) that lands while the command line's own modules import would
end in Python's KeyboardInterrupt traceback, or kill the process without a word: each command installs its
handlers only once its module is loaded. Here they are in place before any of that, so the window left is the
interpreter's own start-up, before any code of this package can run.
"""

from __future__ import annotations

import _signal as signal  # the C module: `signal`'s enum conversion alone is a window worth closing
import os
import sys
from types import FrameType

from kernelguard.errors import INTERRUPTED_LINES  # loaded with the package: no signal module, no handler yet

__all__ = ["main"]


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    said = INTERRUPTED_LINES.get(command, INTERRUPTED_LINES[""])
    lines = {getattr(signal, name): line for name, line in said.items()}

    def leave(signum: int, frame: FrameType | None) -> None:
        print(lines[signum], file=sys.stderr, flush=True)
        os._exit(128 + signum)  # not sys.exit: the teardown after a half-done import can fail again

    # Marked as kernelguard.errors.interrupts' start-up handler: a command keeps it while it starts, and puts Ctrl-C
    # back to KeyboardInterrupt (end_startup_interrupts) once it has something to clean up; train replaces the
    # SIGTERM one with its own as soon as its module is loaded.
    leave.kernelguard_startup = True
    for sig in lines:
        # left alone where ignored (nohup, a background job) or already handled by an embedding program
        if signal.getsignal(sig) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(sig, leave)
    from .commands import main as cli_main

    return cli_main()
