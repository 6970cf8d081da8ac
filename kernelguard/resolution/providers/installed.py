"""Facts about an installed provider package: version, the exact import transformers makes, its .so files.

Live probing lives here (and in ``hub``); judging the facts is the pure resolver's job.

A compiled extension can kill the interpreter on import (an abort in a static initialiser, a segfault in
``PyInit``): such a package is first imported in a child process with a timeout (one child per package,
only for packages that ship .so files), and only imported here when the child survived. A crash becomes
the fact ``import_error = "crashes on import (signal 11: SIGSEGV) in <.so path>"`` (or ``... while
importing <module>`` when the package's Python code dies after its extensions loaded), and the rest of
the report still prints. The child is forked (~35 ms) unless this process already initialised CUDA, where
a fresh interpreter is spawned instead (seconds: it imports torch again);
``KERNELGUARD_IMPORT_PROBE=fork|spawn|off`` forces one (``off`` imports in-process, unprotected).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kernelguard.errors import ConfigError

from ..catalog import PackageSpec
from ..facts import ExtensionFacts, PackageFacts

__all__ = ["CRASH_PREFIX", "IMPORT_PROBE_TIMEOUT_S", "probe_package"]


def _installed_distribution(spec: PackageSpec) -> tuple[str | None, str | None]:
    for name in spec.distributions:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def _built_for_torch(distribution: str, version: str) -> str | None:
    """Prebuilt CUDA wheels name their torch in the file name (``...+cu12torch2.6cxx11abiTRUE``)."""
    candidates = [version]
    try:
        direct_url = metadata.distribution(distribution).read_text("direct_url.json")
    except (metadata.PackageNotFoundError, FileNotFoundError):
        direct_url = None
    if direct_url:
        try:
            candidates.append(json.loads(direct_url).get("url", ""))
        except json.JSONDecodeError:
            pass
    for text in candidates:
        found = re.search(r"torch(\d+\.\d+)", text)
        if found:
            return found.group(1)
    return None


def _extension_files(distribution: str) -> list[Path]:
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    found = []
    for record in files:
        if record.name.endswith(".so") or ".so." in record.name:
            found.append(Path(str(record.locate())).resolve())
    return found


def _module_name(path: Path, distribution: str) -> str | None:
    """``site-packages/causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so`` -> ``causal_conv1d_cuda``."""
    # The deepest sys.path entry holding the file: a parent entry such as the cwd ("" under `python -m`)
    # would turn site/x.so into the module "site.x".
    relatives = []
    for entry in sys.path:
        try:
            relatives.append(path.relative_to(Path(entry or ".").resolve()))
        except (ValueError, OSError):
            continue
    if not relatives:
        return None
    parts = list(min(relatives, key=lambda r: len(r.parts)).parts)
    parts[-1] = parts[-1].split(".", 1)[0]
    return ".".join(parts)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load_extension(path: Path, distribution: str) -> str | None:
    module = _module_name(path, distribution)
    if module is None:
        return None
    try:
        # Extensions link against libtorch: load torch first so a failure means *this* .so is wrong.
        import torch  # noqa: F401

        importlib.import_module(module)
    except BaseException as exc:  # noqa: BLE001 - includes SystemExit from misbehaving extension inits
        return _error_text(exc)
    return None


def _read_archs(path: Path) -> tuple[frozenset[str], frozenset[str], str | None, str | None]:
    try:
        from .fatbin import read_cuda_targets
    except ImportError as exc:  # pragma: no cover - shipped together
        return frozenset(), frozenset(), f"arch reader unavailable: {exc}", None
    targets = read_cuda_targets(path)
    return targets.sass, targets.ptx, targets.error, targets.method


# Long enough for a cold torch + CUDA extension import on a busy node; a hang past this is reported.
IMPORT_PROBE_TIMEOUT_S = 120.0
CRASH_PREFIX = "crashes on import"

# Run in a fresh interpreter (spawn mode, or where fork is missing): argv = [sys.path as JSON, *modules].
_CHILD_SOURCE = """
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[1])
try:
    import torch
except BaseException:
    pass
for index, name in enumerate(sys.argv[2:]):
    os.write(1, b"%d\\n" % index)
    try:
        importlib.import_module(name)
    except BaseException:
        pass
os.write(1, b"done\\n")
"""


@dataclass(frozen=True, slots=True)
class _Crash:
    index: int  # which of the probed modules was being imported when the child died
    text: str  # "crashes on import (signal 11: SIGSEGV)"


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a half-imported or stand-in torch: assume the careful answer
        return True


def _probe_mode() -> str:
    raw = os.environ.get("KERNELGUARD_IMPORT_PROBE", "")
    mode = raw.strip().lower()
    if mode in ("fork", "spawn", "off"):
        return mode
    if mode:
        raise ConfigError(
            f"KERNELGUARD_IMPORT_PROBE={raw!r} is not a probe mode; expected fork, spawn or off.",
            fix="unset KERNELGUARD_IMPORT_PROBE (automatic choice) or set it to fork, spawn or off",
        )
    # fork costs ~35 ms; a fresh interpreter seconds (it imports torch again). But a process that already
    # initialised CUDA (a GPU node: env.probe read the device capabilities) is not forked: the CUDA driver
    # does not support use after fork, and a child stuck in it would read as an extension that hangs.
    return "fork" if hasattr(os, "fork") and not _cuda_initialized() else "spawn"


def _child_imports(modules: list[str], write_fd: int) -> None:
    """The forked child: say which module comes next, import it, and never return."""
    try:
        import faulthandler

        faulthandler.disable()  # the parent's (pytest's) handler would print a traceback for our crash
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            import torch  # noqa: F401 - extensions need libtorch loaded first, as in the parent
        except BaseException:  # noqa: BLE001, S110 - torch's own failure is env.probe's fact
            pass
        for index, name in enumerate(modules):
            os.write(write_fd, b"%d\n" % index)
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001, S110 - errors are read in-process; only deaths count here
                pass
        os.write(write_fd, b"done\n")
    finally:
        os._exit(0)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's wait status, or None after killing it at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)


def _run_forked(modules: list[str], timeout: float) -> tuple[bytes, int | None]:
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork in a threaded process; the child only imports and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child_imports(modules, write_fd)
    os.close(write_fd)
    status = _wait(pid, timeout)
    with os.fdopen(read_fd, "rb") as pipe:
        output = pipe.read()  # a few bytes: the child writes only indices
    return output, (None if status is None else os.waitstatus_to_exitcode(status))


def _run_spawned(modules: list[str], timeout: float) -> tuple[bytes, int | None]:
    command = [sys.executable, "-c", _CHILD_SOURCE, json.dumps(sys.path), *modules]
    try:
        done = subprocess.run(command, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return exc.stdout or b"", None
    return done.stdout, done.returncode


def _death_text(code: int | None, timeout: float) -> str:
    if code is None:
        return f"hangs on import (no result within {timeout:g} s)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"{CRASH_PREFIX} (signal {-code}: {name})"
    return f"exits the interpreter on import (exit code {code})"


def _import_crash(modules: list[str]) -> _Crash | None:
    """Import ``modules`` in order in a child process; which one killed it, if any."""
    timeout = IMPORT_PROBE_TIMEOUT_S
    mode = _probe_mode()
    if mode == "off" or not modules:
        return None
    output, code = (_run_forked if mode == "fork" else _run_spawned)(modules, timeout)
    lines = output.decode(errors="replace").split()
    if lines[-1:] == ["done"]:  # every import returned (a spawned child dying at exit is not our concern)
        return None
    started = [int(line) for line in lines if line.isdigit()]
    if not started:  # died before the first import (importing torch itself): not this package's fault
        return None
    return _Crash(started[-1], _death_text(code, timeout))


def _extension_facts(path: Path, distribution: str, load_error: str | None) -> ExtensionFacts:
    sass, ptx, arch_error, method = _read_archs(path)
    return ExtensionFacts(
        path=str(path),
        module=_module_name(path, distribution) or path.name,
        load_error=load_error,
        sass=sass,
        ptx=ptx,
        arch_error=arch_error,
        arch_method=method,
    )


def _probe_extensions(
    distribution: str, module: str, load_extensions: bool
) -> tuple[list[ExtensionFacts], str | None]:
    """Each .so's facts, and the package's import error when importing it kills the interpreter."""
    paths = _extension_files(distribution)
    loadable = [(p, name) for p in paths if (name := _module_name(p, distribution)) is not None]
    probed = [name for _, name in loadable] if load_extensions else []
    crash = _import_crash([*probed, module]) if paths else None
    if crash is None:
        loads = {p: _load_extension(p, distribution) if load_extensions else None for p in paths}
        return [_extension_facts(p, distribution, loads[p]) for p in paths], None
    if crash.index == len(probed):  # every extension loaded; the package's own import code died
        loads = {p: _load_extension(p, distribution) if load_extensions else None for p in paths}
        return [_extension_facts(p, distribution, loads[p]) for p in paths], f"{crash.text} while importing {module}"
    crashed = loadable[crash.index][0]
    survived = {p for p, _ in loadable[: crash.index]}  # imported in the child before the crash: safe here
    extensions = []
    for path in paths:
        if path == crashed:
            error: str | None = crash.text
        elif path in survived:
            error = _load_extension(path, distribution)
        else:
            error = f"not tried: importing {crashed.name} killed the probe first"
        extensions.append(_extension_facts(path, distribution, error))
    return extensions, f"{crash.text} in {crashed}"


def probe_package(spec: PackageSpec, module: str, attribute: str, *, load_extensions: bool = True) -> PackageFacts:
    """Everything knowable about ``spec`` without a GPU. Never dies with the package; raises only ConfigError
    for a misspelt KERNELGUARD_IMPORT_PROBE."""
    distribution, version = _installed_distribution(spec)
    extensions: list[ExtensionFacts] = []
    crash: str | None = None
    if distribution and spec.compiled:
        # Before any in-process import: a crashing extension must not take kernelguard down with it.
        extensions, crash = _probe_extensions(distribution, module, load_extensions)
    import_error: str | None = crash
    devices, devices_source = spec.default_devices, "kernelguard default for this package"
    if crash is None:
        try:
            imported = importlib.import_module(module)
            if getattr(imported, attribute, None) is None:
                import_error = f"AttributeError: module {module!r} has no attribute {attribute!r}"
            root = sys.modules.get(spec.import_name)
            declared = getattr(root, "__kernelguard_devices__", None)
            if declared:
                devices, devices_source = tuple(declared), f"{spec.import_name}.__kernelguard_devices__"
        except BaseException as exc:  # noqa: BLE001 - transformers catches everything here too
            import_error = _error_text(exc)
    if version is None and import_error is None:
        # Importable without a distribution (a source checkout on PYTHONPATH): read its own version.
        version = getattr(sys.modules.get(spec.import_name), "__version__", None)
    return PackageFacts(
        import_name=spec.import_name,
        distribution=distribution,
        version=version,
        module=module,
        attribute=attribute,
        import_error=import_error,
        devices=devices,
        devices_source=devices_source,
        built_for_torch=_built_for_torch(distribution, version) if distribution and version else None,
        extensions=tuple(extensions),
    )
