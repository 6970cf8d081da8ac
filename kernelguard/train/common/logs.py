"""`kernelguard train`'s log: one :mod:`logging` logger, ``kernelguard.train``, that only rank 0 prints (every
rank takes the same steps, so N copies would bury the one line), at ``--log-level``, to stderr as
``kernelguard train: MESSAGE``.

While the progress bar is drawn, log lines go through ``tqdm.write`` above it
(:func:`tqdm.contrib.logging.logging_redirect_tqdm`), kernelguard's and transformers' loggers included, so no
line lands inside the bar.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = [
    "LOGGER_NAME",
    "bar_safe_logging",
    "human_count",
    "log",
    "logger",
    "setup_logging",
]

LOGGER_NAME = "kernelguard.train"
logger = logging.getLogger(LOGGER_NAME)
_PREFIX = "kernelguard train: "
# Loggers whose lines may come during training: ours, the guard's (kernelguard), transformers'.
_BAR_LOGGERS = (LOGGER_NAME, "kernelguard", "transformers")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on the current ``sys.stderr`` at each line (pytest's capture and tqdm replace it)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


class _Fitted(logging.Formatter):
    """Lines fitted to the terminal as `kernelguard check` fits its report (a command broken with ` \\` so it
    still pastes); in a log (stderr not a terminal, no ``COLUMNS``) each line stays whole, for grep."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        from kernelguard.stack import fit_line, read_by_a_person, terminal_width

        if not read_by_a_person():
            return text
        width = terminal_width()
        return "\n".join(part for line in text.split("\n") for part in fit_line(line, width))


def setup_logging(*, level: str = "info", is_main: bool | None = None) -> logging.Logger:
    """Give ``kernelguard.train`` its stderr handler (once) at ``level`` on rank 0, silence it elsewhere.
    ``is_main``: this process is rank 0 (default: the ``RANK`` variable says 0 or is unset)."""
    if is_main is None:
        is_main = os.environ.get("RANK", "0").strip() in ("", "0")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_Fitted(_PREFIX + "%(message)s"))
        logger.addHandler(handler)
    logger.propagate = False  # a root handler the user set up would print every line twice
    logger.setLevel(getattr(logging, level.upper()) if is_main else logging.CRITICAL + 1)
    return logger


@contextlib.contextmanager
def bar_safe_logging(bar: Any) -> Iterator[None]:
    """While ``bar`` (a tqdm bar, or None: nothing to do) is drawn, print log lines above it."""
    if bar is None:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger(name) for name in _BAR_LOGGERS]):
        yield


setup_logging()  # a trainer module that logs before the CLI sets the level still prints, on rank 0 only


def log(info: Any, message: str, level: int = logging.INFO) -> None:
    """One line from rank 0 (``info``: the run's DistInfo)."""
    if info.is_main:
        logger.log(level, message)


def human_count(n: float) -> str:
    """A count as people write it in a log line: ``16 M``, ``1.5 B``, ``950 K``, ``12``."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 100 or value == int(value) else f"{value:.3g} {unit}"
    return f"{n:g}"
