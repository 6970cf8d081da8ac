"""Ctrl-C while a command starts: torch's first import imports numpy from C and clears whatever that import
raised, a KeyboardInterrupt included, so a Ctrl-C landing there was lost and the command went on (a
`kernelguard train` went on to train). Until a command has something to clean up, Ctrl-C therefore calls a
handler that ends the process at once instead of raising."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator

from .exit_codes import EXIT_INTERRUPTED

__all__ = ["children_start_with_interrupts_held", "end_startup_interrupts", "release_held_interrupts",
           "startup_interrupts"]

_STARTUP_MARK = "kernelguard_startup"


@contextlib.contextmanager
def startup_interrupts(line: str | None) -> Iterator[None]:
    """Until :func:`end_startup_interrupts` or the block's end, Ctrl-C prints ``line`` on stderr (None: nothing,
    for a rank whose launcher speaks) and ends the process at once with exit 130, instead of raising
    KeyboardInterrupt. SIGINT is left alone where it is ignored (``nohup``, a background job), where the caller
    installed its own handler, and off the main thread. The block's end puts the previous handler back."""

    def leave(signum: int, frame: object) -> None:
        if line is not None:
            print(line, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)  # not sys.exit: the teardown after a half-done import can fail again

    setattr(leave, _STARTUP_MARK, True)
    previous = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        with contextlib.suppress(ValueError):  # not the main thread
            previous = signal.signal(signal.SIGINT, leave)
    try:
        yield
    finally:
        if previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, previous)


def end_startup_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt again: from here on something may need cleaning up (a run lock, a file
    being written, the launcher's ranks), and the imports that could swallow it are done."""
    if getattr(signal.getsignal(signal.SIGINT), _STARTUP_MARK, False):
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def children_start_with_interrupts_held() -> Iterator[None]:
    """Processes started inside the block begin with SIGINT blocked (held pending, not lost) until they call
    :func:`release_held_interrupts`, once their own handler is in place: a Ctrl-C that reaches a launched rank
    while it is still importing would otherwise end it in a KeyboardInterrupt traceback before any kernelguard
    code could catch it. A child inherits the signal mask of the thread that starts it; this process's own
    Ctrl-C waits for the block's end, so the block holds only the start of a process."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def release_held_interrupts() -> None:
    """In a process started inside :func:`children_start_with_interrupts_held`, once its SIGINT handler is
    installed: a Ctrl-C held since the start arrives now, and later ones as they come."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
