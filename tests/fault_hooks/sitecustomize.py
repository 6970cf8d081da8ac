"""Fault injection for tests/train/test_faults.py, loaded by every Python process of a test run (the launcher and its
ranks) when this folder is on PYTHONPATH. ``KERNELGUARD_FAULT`` picks the fault:

- ``export``: the final export hits a full disk: part of the first shard is written, then write(2) fails with
  ENOSPC, as kernelguard.train.output.export's shard writer would see it.
- ``export-slow``: every shard of an export waits 2 s before it is written, so two exports overlap for sure.
- ``checkpoint:NAME``: DCP's shard writes into a checkpoint folder named ``NAME.tmp`` fail with ``ENOSPC``
  after half of their first write reached the file, as write(2) on a full disk does.
- ``checkpoint-rng:NAME``: the RNG file each rank adds to checkpoint ``NAME.tmp`` is opened on /dev/full, so
  writing it fails with the kernel's own ENOSPC (torch's writer on a path called it "unexpected pos").
- ``enospc-file:NAME``: every file called NAME (or NAME.tmp, .NAME.xxxx: the temporary file an atomic write
  renames onto it) that Python opens for writing (``open``, ``Path.write_text``) is opened on /dev/full, and ``os.write`` to a descriptor of a file called NAME fails with ENOSPC: the
  kernel's own error at that one write site, the rest of the disk writable (tests/train/test_full_disk.py walks them).
- ``teardown-marker``: a process that runs the interpreter's teardown (atexit) says so on stderr.
- ``ctrl-c-in-torch-numpy-import``: Ctrl-C (SIGINT to this process) at the moment torch's C extension imports
  numpy, whose failures (a KeyboardInterrupt included) torch clears: the window where Ctrl-C used to be lost.
- ``ctrl-c-in-launcher-torch-import``: Ctrl-C as the ``--nproc-per-node`` launcher (the process torchrun did not
  start) begins importing torch. The launcher loads the tokenizer first, which imports numpy, so torch's own
  numpy import cannot be the moment there.
- ``ctrl-c-as-a-rank-imports-kernelguard``: Ctrl-C (SIGINT to the whole process group, as a terminal sends it)
  at the moment a launched rank 0 imports kernelguard's train module, before any of its own code runs.
- ``signal-as-the-cli-imports:SIG``: SIGINT or SIGTERM to this process as the command line's modules begin to
  import (``kernelguard.stack.report``), before any command's own handler exists.
- ``ranks-meet-at-start``: each rank of a torchrun launch, at its first import once kernelguard's SIGTERM
  handler is in place (before its inputs are read), waits there until every rank got that far: a rank the agent
  stops later always has its handler (the first ~0.1 s of an interpreter, before any kernelguard code, is not
  what the tests are about). ``ranks-meet-at-start-then-rank-0-stalls``: rank 0 then waits until the agent stops
  it, so the other rank fails first, for sure.
- ``steady-steps``: not a fault but a fixed clock: the step profiler's clock ticks 0.1 s per read, so every step
  takes the same time and the profiled windows' schedule (three steady steps first) does not depend on the load
  of the machine running the test (tests/diagnosis/test_profiling.py).
"""

from __future__ import annotations

import os
import signal  # here, not in find_spec: an import there would call find_spec again
import sys
import time

_FAULT = os.environ.get("KERNELGUARD_FAULT", "")


def _export_disk_full() -> None:
    import errno

    from kernelguard.train.output import export
    def write_safetensors(path, tensors, fetch):  # type: ignore[no-untyped-def]
        with open(path, "wb") as f:  # the part that fitted
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))  # what write(2) gives on a full disk

    export.write_safetensors = write_safetensors


def _checkpoint_disk_full(folder: str) -> None:
    import contextlib
    import errno

    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    class _Full:
        def __init__(self, stream, path):  # type: ignore[no-untyped-def]
            self._stream, self._path = stream, path

        def write(self, data):  # type: ignore[no-untyped-def]
            self._stream.write(bytes(data)[: len(data) // 2])
            self._stream.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return getattr(self._stream, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):  # type: ignore[no-untyped-def]
        with real(self, path, mode) as stream:
            hit = "w" in mode and str(path).endswith(".distcp") and f"{folder}.tmp" in str(path)
            yield _Full(stream, path) if hit else stream

    filesystem.FileSystem.create_stream = create_stream


def _checkpoint_rng_disk_full(folder: str) -> None:
    """The per-rank RNG file of checkpoint ``folder`` is written to /dev/full: the kernel's own ENOSPC."""
    import builtins

    from kernelguard.train.output import checkpoint

    def full_open(path, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        hit = "w" in mode and f"{folder}.tmp" in str(path) and os.path.basename(str(path)).startswith("rng_rank")
        return builtins.open("/dev/full" if hit else path, mode, *args, **kwargs)

    checkpoint.open = full_open  # type: ignore[attr-defined]


def _export_slow() -> None:
    import time

    from kernelguard.train.output import export
    real = export.write_safetensors

    def write_safetensors(path, tensors, fetch):  # type: ignore[no-untyped-def]
        time.sleep(2)
        real(path, tensors, fetch)

    export.write_safetensors = write_safetensors


def _steady_steps() -> None:
    import itertools

    from kernelguard.train.output import profiling  # before kernelguard.train.loop binds step_profiler
    real = profiling.step_profiler

    def step_profiler(*args, **kwargs):  # type: ignore[no-untyped-def]
        profiler = real(*args, **kwargs)
        if profiler is not None:
            ticks = itertools.count()
            profiler.clock = lambda: next(ticks) / 10
        return profiler

    profiling.step_profiler = step_profiler


class _CtrlCInTorchsNumpyImport:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "numpy" and "torch" in sys.modules:  # torch is half imported: its C extension asks
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)


class _CtrlCAsTheLauncherImportsTorch:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" and "LOCAL_RANK" not in os.environ:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)


class _CtrlCAsARankImportsKernelguard:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "kernelguard.train.settings.config_cli" and os.environ.get("RANK") == "0":
            sys.meta_path.remove(self)
            os.killpg(os.getpgrp(), signal.SIGINT)


class _SignalAsTheCliImports:
    def __init__(self, sig: str) -> None:
        self.sig = getattr(signal, sig)

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "kernelguard.stack.report" and "LOCAL_RANK" not in os.environ:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), self.sig)


class _RanksMeetAtStart:
    def __init__(self, rank_0_stalls: bool) -> None:
        self.rank_0_stalls = rank_0_stalls

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if getattr(signal.getsignal(signal.SIGTERM), "__qualname__", "") != "main.<locals>.stop":
            return
        sys.meta_path.remove(self)
        folder = os.path.join("/tmp", f"kernelguard-fault-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        os.makedirs(folder, exist_ok=True)
        rank = os.environ.get("RANK", "0")
        open(os.path.join(folder, rank), "w").close()  # noqa: SIM115
        deadline = time.monotonic() + 120
        while len(os.listdir(folder)) < int(os.environ.get("WORLD_SIZE", "1")) and time.monotonic() < deadline:
            time.sleep(0.02)
        while self.rank_0_stalls and rank == "0":  # the agent's SIGTERM ends it, through kernelguard's handler
            signal.pause()


def _enospc_file(name: str) -> None:
    import builtins
    import errno
    import io

    real_open, real_write = builtins.open, os.write

    def _named(path: str) -> bool:  # the file, or the temporary one an atomic write renames onto it
        base = os.path.basename(path)
        return base == name or base.startswith((f"{name}.", f".{name}."))

    def full_open(file, mode="r", *args, **kwargs):  # type: ignore[no-untyped-def]
        writing = isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
        hit = writing and _named(os.fspath(file))
        return real_open("/dev/full" if hit else file, mode.replace("x", "w") if hit else mode, *args, **kwargs)

    def full_write(fd, data):  # type: ignore[no-untyped-def]
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if _named(target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    builtins.open = io.open = full_open  # type: ignore[assignment]
    os.write = full_write


if _FAULT == "teardown-marker":
    import atexit

    atexit.register(lambda: print(f"fault hook: interpreter teardown ran (pid {os.getpid()})", file=sys.stderr,
                                  flush=True))
elif _FAULT == "ctrl-c-in-torch-numpy-import":
    sys.meta_path.insert(0, _CtrlCInTorchsNumpyImport())
elif _FAULT == "ctrl-c-in-launcher-torch-import":
    sys.meta_path.insert(0, _CtrlCAsTheLauncherImportsTorch())
elif _FAULT.startswith("signal-as-the-cli-imports:"):
    sys.meta_path.insert(0, _SignalAsTheCliImports(_FAULT.split(":", 1)[1]))
elif _FAULT == "ctrl-c-as-a-rank-imports-kernelguard":
    sys.meta_path.insert(0, _CtrlCAsARankImportsKernelguard())
elif _FAULT.startswith("ranks-meet-at-start"):
    sys.meta_path.insert(0, _RanksMeetAtStart(_FAULT.endswith("then-rank-0-stalls")))
elif _FAULT == "export":
    _export_disk_full()
elif _FAULT == "export-slow":
    _export_slow()
elif _FAULT == "steady-steps":
    _steady_steps()
elif _FAULT.startswith("checkpoint:"):
    _checkpoint_disk_full(_FAULT.split(":", 1)[1])
elif _FAULT.startswith("enospc-file:"):
    _enospc_file(_FAULT.split(":", 1)[1])
elif _FAULT.startswith("checkpoint-rng:"):
    _checkpoint_rng_disk_full(_FAULT.split(":", 1)[1])
