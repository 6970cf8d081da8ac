"""What a failed checkpoint or export write says: the real cause, not a guess.

``torch.distributed.checkpoint`` wraps every rank's failure (an ``OSError``, a ``KeyboardInterrupt`` raised
mid-write...) into one ``CheckpointException`` whose text is a multi-rank traceback. :func:`root_cause`
unwraps it to the first rank's own exception; :func:`write_failure` turns that into a CheckpointError whose
message names the errno (``No space left on device``, ``Permission denied``, ``File too large``) and the
file, and whose fix follows from it. A Ctrl-C or SIGTERM that interrupted the write is re-raised as itself, so
the run stops the way an interrupt always does.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from kernelguard.errors import CheckpointError, KernelGuardError

__all__ = ["describe", "disk_free", "is_torch_short_write", "root_cause", "write_failure"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_ACCESS = (errno.EACCES, errno.EPERM, errno.EROFS)


def root_cause(error: BaseException) -> BaseException:
    """The exception behind ``error``: a DCP CheckpointException's lowest failing rank's (an interrupt
    first: it explains the others), a safetensors I/O error's OSError when its text carries an errno,
    else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        causes = [failures[r][0] if isinstance(failures[r], tuple) else failures[r] for r in sorted(failures)]
        causes = [c for c in causes if isinstance(c, BaseException)]
        interrupts = [c for c in causes if isinstance(c, KeyboardInterrupt | KernelGuardError)]
        if interrupts or causes:
            return root_cause((interrupts or causes)[0])
    return _errno_from_text(error) or error


def _errno_from_text(error: BaseException) -> OSError | None:
    """safetensors reports I/O failures as ``SafetensorError: ... I/O error: No space left on device (os error
    28)``: recover the errno."""
    import re

    if isinstance(error, OSError):
        return None
    found = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(error))
    if found is None:
        return None
    import os

    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code))


def describe(cause: BaseException) -> str:
    """One line: ``No space left on device (ENOSPC): FILE`` for an OSError, else ``Type: first line``."""
    if isinstance(cause, OSError) and cause.errno:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        where = f": {cause.filename}" if cause.filename else ""
        return f"{cause.strerror} ({name}){where}"
    first = str(cause).splitlines()[0] if str(cause) else ""
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__


def disk_free(folder: Path) -> int | None:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def is_torch_short_write(error: BaseException) -> bool:
    """torch.save's zip writer reports a write(2) that wrote less (ENOSPC on a full disk) as ``RuntimeError:
    [enforce fail at inline_container.cc] unexpected pos``, without the errno."""
    return not isinstance(error, OSError) and "unexpected pos" in str(error)


def _full_disk_behind_short_write(cause: BaseException, folder: Path, need_bytes: int | None) -> bool:
    """A short write of torch's was a full disk when the disk of ``folder`` has less room than the write needs."""
    if not is_torch_short_write(cause) or not need_bytes:
        return False
    free = disk_free(folder)
    return free is not None and free < need_bytes


def write_failure(
    what: str, error: BaseException, *, folder: Path, need_bytes: int | None = None, after: str | None = None
) -> BaseException:
    """The exception to raise for a failed write of ``what`` into ``folder``: the interrupt itself, or a
    CheckpointError naming the real cause and its fix. ``after`` is what to do once fixed."""
    cause = root_cause(error)
    if isinstance(cause, KeyboardInterrupt | KernelGuardError):
        return cause
    after = after or "--resume from the last complete checkpoint"
    said = ""
    if _full_disk_behind_short_write(cause, folder, need_bytes):
        said = f" (torch's writer said: {str(cause).splitlines()[0]})"
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    code = cause.errno if isinstance(cause, OSError) else None
    message = f"{what} failed: {describe(cause)}."
    if code in (*_NO_SPACE, errno.EFBIG):
        free = disk_free(folder)
        room = f"; {_size(free)} free there" if free is not None else ""
        need = f", about {_size(need_bytes)} is needed" if need_bytes else ""
        message = f"{what} failed: {describe(cause)}{said}{need}{room}."
    if code in _NO_SPACE:
        fix = f"free disk space on the disk of {folder} (or move it to a larger disk), then {after}"
    elif code in _NO_ACCESS:
        fix = f"make {folder} writable by this user, then {after}"
    elif code == errno.EFBIG:
        fix = f"raise the file-size limit (`ulimit -f unlimited`) or use a file system without one, then {after}"
    else:
        fix = f"fix the cause above, then {after}"
    return CheckpointError(message, fix=fix)
