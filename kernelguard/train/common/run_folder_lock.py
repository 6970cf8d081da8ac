"""One live run per output folder: an OS lock (``fcntl.flock``) on ``OUTPUT/.kernelguard.lock``.

The lock is taken before anything else is written into the folder and held for the whole run; the kernel
drops it when the holding process dies however it dies (``kill -9`` included), so a lock file left by a dead
run never blocks. The holder writes its pid, host, start time and command line into the file, and a refused
run names them.

Which process holds it: ``kernelguard train --nproc-per-node N`` (one node) takes it in the launcher before
any rank starts, and its ranks (children of the launcher, which die with it) check that their parent is the
holder; plain ``torchrun`` and a single process take it in rank 0. So a second launcher, a second torchrun
job and a ``--resume`` while the first run trains are all refused before they write anything.

Released by :meth:`OutputLock.release`: the lock file is removed (and the folder too when the lock created
it and nothing else was written), so a refused or failed start leaves the folder as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError, ConfigError, KernelGuardError

from ..common.run_folder import LOCK_FILE

__all__ = ["HOLDER_ENV", "LOCK_FILE", "OutputLock", "acquire", "hold_for_run", "holder_of"]

HOLDER_ENV = "KERNELGUARD_LOCK_HOLDER"  # set by the launcher for its ranks: the pid that holds the lock


def holder_of(output: Path, *, name: str = LOCK_FILE) -> dict[str, Any] | None:
    """What the lock file says about its holder (None: no file, or not written yet)."""
    try:
        data = json.loads((output / name).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class OutputLock:
    """A held lock on one output folder; :meth:`release` (or process death) frees it."""

    def __init__(self, output: Path, fd: int, created: list[Path], name: str = LOCK_FILE) -> None:
        self.output = output
        self.path = output / name
        self._fd: int | None = fd
        self._created = created  # folders the lock had to create, deepest first

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        # Unlink while still locked: a waiter that opened the old file sees its inode vanish and retries.
        with contextlib.suppress(OSError):
            self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        for folder in self._created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: a run that wrote something keeps its folder

    def __enter__(self) -> OutputLock:  # noqa: PYI034 - final in practice; py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(
    output: Path, *, argv: list[str] | None = None, name: str = LOCK_FILE, flag: str = "--output-dir",
    refusal: Callable[[Path, str], KernelGuardError] | None = None,
) -> OutputLock:
    """Lock ``output`` for this process or raise CheckpointError naming the run that holds it. ``name``: the
    lock file's name in ``output``; ``flag``: how the caller names the folder in an error; ``refusal``: the
    error for (folder, who holds it), for a caller other than a run (``kernelguard export``)."""
    import fcntl

    created = _make_folders(output, flag=flag)
    path = output / name
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError as e:  # not a permission problem: a folder stands where the lock file goes
            old = shlex.quote(str(path))
            raise ConfigError(
                f"{flag} {output}: {path} is a folder, where this run's lock file belongs (a copy or a mistake "
                "put it there); nothing was started.",
                fix=f"move it away: mv {old} {shlex.quote(str(path) + '.old')}",
            ) from e
        except OSError as e:
            why = "pick a folder this user may write" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else (
                "free or fix that folder")
            raise ConfigError(
                f"{flag} {output}: cannot create its lock file {path} ({e.strerror or e}); {why}.",
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise (refusal or _refusal)(output, _holder_text(output, name)) from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder released and unlinked it between our open and our lock: try again
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(argv if argv is not None else getattr(sys, "orig_argv", sys.argv)),
    }
    try:
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(record) + "\n").encode())
    except OSError as e:  # a full disk: no half-written lock left behind, the cause named
        from .write_errors import write_failure

        os.close(fd)
        path.unlink(missing_ok=True)
        for folder in created:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise write_failure(f"{flag} {output}: writing its lock file {path}", e, folder=output,
                            after="run the same command again") from None
    return OutputLock(output, fd, created, name)


def hold_for_run(output: Path) -> OutputLock | None:
    """Rank 0 (or the only process): lock ``output``, unless this rank's parent is the launcher that
    already holds it (None then)."""
    holder = os.environ.get(HOLDER_ENV)
    if holder and holder == str(os.getppid()):
        return None
    return acquire(output)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _make_folders(output: Path, *, flag: str = "--output-dir") -> list[Path]:
    missing = []
    folder = output
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"{flag} {output}: {e.filename or output} cannot be created ({e.strerror or e}); pick a folder this "
            "user may write.",
        ) from e
    return missing


def _holder_text(output: Path, name: str) -> str:
    holder = holder_of(output, name=name)
    if not holder:
        return "a process that has not written its details yet"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
        f"{holder.get('command')}"
    )


def _refusal(output: Path, who: str) -> CheckpointError:
    return CheckpointError(
        f"--output-dir {output} is in use by another run ({who}); two runs in one folder would interleave "
        "their checkpoints and metrics.",
        fix="wait for that run to finish (or stop it), then --resume; or choose another --output-dir",
    )
