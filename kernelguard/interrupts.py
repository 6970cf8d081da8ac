"""Ctrl-C while a command starts: torch's first import imports numpy from C and clears whatever that import
raised, a KeyboardInterrupt included, so a Ctrl-C landing there was lost and the command went on (a
`kernelguard train` went on to train). Until a command has something to clean up, Ctrl-C therefore calls a
handler that ends the process at once instead of raising."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

__all__ = ["end_startup_interrupts", "startup_interrupts"]

_STARTUP_MARK = "kernelguard_startup"


def startup_interrupts(leave: Any) -> Any:
    """Until :func:`end_startup_interrupts`, Ctrl-C calls ``leave`` (which must end the process) instead of
    raising KeyboardInterrupt. Returns the handler to restore at the end, or None where SIGINT is left alone:
    ignored (``nohup``, a background job), the caller's own handler, or not the main thread."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    setattr(leave, _STARTUP_MARK, True)
    try:
        return signal.signal(signal.SIGINT, leave)
    except ValueError:  # not the main thread
        return None


def end_startup_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt again: from here on something may need cleaning up (a run lock, a file
    being written, the launcher's ranks), and the imports that could swallow it are done."""
    if getattr(signal.getsignal(signal.SIGINT), _STARTUP_MARK, False):
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, signal.default_int_handler)
