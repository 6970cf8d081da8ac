"""The lock file itself: where a job finds it, and reading it with errors that say which lock and how to fix it.

The lock's content (what it holds, how two are compared) is :mod:`kernelguard.stack.stack_lock`'s.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import pin_command

__all__ = ["DEFAULT_LOCK", "ENV_LOCK", "LOCK_SCHEMA", "kernelguard_version", "lock_option", "lock_path", "read_lock"]

LOCK_SCHEMA = 1
ENV_LOCK = "KERNELGUARD_LOCK"
DEFAULT_LOCK = "kernelguard.lock"


def lock_path(lock: str | os.PathLike[str] | None) -> str | None:
    """The lock a job enforces: the one it names, else ``KERNELGUARD_LOCK`` (empty or unset: none)."""
    if lock is not None and str(lock):
        return str(lock)
    return os.environ.get(ENV_LOCK, "").strip() or None


def lock_option(lock: str | os.PathLike[str] | None, option: str) -> str:
    """How an error names the lock's source: ``option`` (--lock, lock=) when it was given, else the variable."""
    return option if lock is not None and str(lock) else ENV_LOCK


def kernelguard_version() -> str:
    try:
        from kernelguard.resolution import DISTRIBUTION

        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        from importlib import import_module

        return str(getattr(import_module("kernelguard"), "__version__", "unknown"))


def read_lock(path: str | os.PathLike[str], *, option: str = "--lock") -> dict[str, Any]:
    where = Path(path)
    rewrite = "write it again where the image is built: kernelguard lock --output kernelguard.lock"
    named = f"{ENV_LOCK}={where}" if option == ENV_LOCK else f"{option} {where}"
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        fix = f"point {ENV_LOCK} at the image's lock file, or unset it" if option == ENV_LOCK else rewrite
        raise ConfigError(f"{named}: no such file.", fix=fix) from None
    except IsADirectoryError:
        inside = where / DEFAULT_LOCK
        if inside.is_file():  # the folder holds the lock: name it
            fix = (f"export {ENV_LOCK}={inside}" if option == ENV_LOCK
                   else f"{option}{str(inside)!r}" if option.endswith("=") else f"{option} {inside}")
        else:  # never a path that does not exist
            fix = (f"point {ENV_LOCK} at the image's lock file, or unset it" if option == ENV_LOCK
                   else f"pass the lock file itself; {rewrite}")
        raise ConfigError(f"{named} is a directory, not a lock file.", fix=fix) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{option} {where} is not a kernelguard lock: {exc}.", fix=rewrite) from None
    if not isinstance(data, dict) or "kernelguard_lock" not in data:
        raise ConfigError(f"{option} {where} is not a kernelguard lock (no kernelguard_lock field).", fix=rewrite)
    if data["kernelguard_lock"] != LOCK_SCHEMA:
        schema, writer = data["kernelguard_lock"], (data.get("stack") or {}).get("kernelguard")
        newer = isinstance(schema, int) and schema > LOCK_SCHEMA
        # A newer lock is the image's truth: install the kernelguard that wrote it, never rewrite it here.
        fix = (pin_command("kernelguard", writer) if newer and isinstance(writer, str)
               else "pip install --upgrade kernelguard" if newer else rewrite)
        by = f", written by kernelguard {writer}" if isinstance(writer, str) else ""
        raise ConfigError(
            f"{option} {where} has lock schema {schema!r}{by}; this kernelguard ({kernelguard_version()}) reads "
            f"schema {LOCK_SCHEMA}.", fix=fix)
    return data
