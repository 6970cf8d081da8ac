"""`kernelguard train --nproc-per-node N ...`: torchrun's launcher, with kernelguard's exit codes kept.

Plain ``torchrun ... -m kernelguard.train`` exits 1 whenever a rank fails — whatever the rank's own exit
code — and prints a ``ChildFailedError`` traceback with a table of per-rank exit codes under the ranks'
output. This launcher runs the same machinery in-process (``torch.distributed.run.run``), but each rank
writes its kernelguard error (one line, plus the guard's report for exit 3) to a file in a private folder
instead of printing it; when the ranks stop, the launcher prints the lowest failing rank's message once and
exits with its code: 2 usage/config/data error, 3 the guard refused. A rank that dies otherwise (a Python
traceback, a signal) is named with its exit code, and the launcher exits with that code (128 + N for
signal N, as a shell does); a launcher stopped by a signal (Ctrl-C) exits 128 + N too; ranks that cannot
rendezvous exit 1. With several nodes each rank's record also goes to the shared ``--output-dir``
(kernelguard.train.failures), and every node's launcher prints the job's first root cause, naming its node,
rank and host, instead of its own ranks' lost-peer errors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernelguard.errors import (
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    ConfigError,
    children_start_with_interrupts_held,
    end_startup_interrupts,
)

from . import failures
from .common.atomic_file import write_text_atomically
from .common.run_folder_lock import HOLDER_ENV, acquire
from .settings.config_cli import LaunchOptions

__all__ = [
    "LAUNCH_DIR_ENV",
    "launch",
    "launched_by_kernelguard",
    "torchrun_argv",
    "write_rank_error",
    "write_torchelastic_error",
]

LAUNCH_DIR_ENV = "KERNELGUARD_LAUNCH_DIR"  # set for the ranks: where each writes its error record
_CLOCK_SKEW_S = 120.0  # records of this job may carry another node's clock; older ones are an earlier run's
_QUIET_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def launched_by_kernelguard() -> bool:
    """True in a rank started by :func:`launch` (launcher flags are then ignored and errors go to files)."""
    return bool(os.environ.get(LAUNCH_DIR_ENV))


def write_rank_error(
    exit_code: int, message: str, report: str | None = None, *, crash: bool = False,
    error: BaseException | None = None,
) -> bool:
    """In a rank started by :func:`launch`: record this rank's error for the launcher to print once
    (``crash``: an unexpected exception, whose ``report`` is its traceback; ``error``: the exception, for the
    multi-node record of :mod:`kernelguard.train.failures`).

    Returns False (nothing written) outside such a rank: the caller prints the error itself."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "exit_code": exit_code, "message": message, "report": report, "crash": crash}
    failures.write_record(record, error)
    write_text_atomically(Path(folder) / f"rank-{rank}.json", json.dumps(record))
    return True


def write_torchelastic_error(message: str) -> None:
    """Under plain torchrun: put this rank's message in torchelastic's error file, so its ChildFailedError table
    shows kernelguard's message for every failed rank (only rank 0 prints it) instead of "To enable traceback"."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))


def torchrun_argv(opts: LaunchOptions, train_argv: list[str]) -> list[str]:
    """torchrun's command line for these options, running ``-m kernelguard.train TRAIN_ARGV`` in each rank."""
    out = [
        "--nproc-per-node",
        opts.nproc_per_node,
        "--nnodes",
        opts.nnodes,
        "--node-rank",
        str(opts.node_rank),
    ]
    for flag, value in (
        ("--rdzv-backend", opts.rdzv_backend),
        ("--rdzv-endpoint", opts.rdzv_endpoint),
        ("--rdzv-id", opts.rdzv_id),
        ("--master-addr", opts.master_addr),
        ("--master-port", opts.master_port),
    ):
        if value is not None:
            out += [flag, str(value)]
    single_node = opts.nnodes == "1" and not (opts.rdzv_endpoint or opts.master_addr or opts.master_port)
    if single_node:
        out.append("--standalone")  # a free local port: two jobs on one machine never collide
    return [*out, "-m", "kernelguard.train", *train_argv]


def launch(opts: LaunchOptions, train_argv: list[str], *, output: Path | None = None) -> int:
    """Run ``kernelguard.train`` in ``opts.nproc_per_node`` ranks; return the run's documented exit code.

    On one node the launcher holds ``output``'s run lock (kernelguard.train.common.run_folder_lock) for the whole job, before
    any rank starts; with several nodes global rank 0 takes it."""
    if "LOCAL_RANK" in os.environ and not launched_by_kernelguard():
        raise ConfigError(
            "--nproc-per-node was given inside a process that torchrun already started.",
            fix="drop the launcher flags (torchrun launched the ranks), or run `kernelguard train "
            "--nproc-per-node N ...` without torchrun",
        )
    if opts.nnodes != "1" and not (opts.rdzv_endpoint or opts.master_addr):
        # torchrun would wait for the other nodes at localhost:29400, silently, until its rendezvous timeout.
        raise ConfigError(
            f"--nnodes {opts.nnodes} needs to know where the nodes meet: no --rdzv-endpoint (or --master-addr) "
            "was given.",
            fix="add --rdzv-endpoint HOST:PORT (the same on every node; HOST is one node's address, e.g. the "
            "first's) and --rdzv-id JOB, or --master-addr HOST --master-port PORT",
        )
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_argv(opts, train_argv))
    single_node = opts.nnodes == "1"
    shared = None if single_node or output is None else output / failures.ERRORS_DIR
    since = time.time() - _CLOCK_SKEW_S
    end_startup_interrupts()  # the run lock comes next: Ctrl-C must unwind through its release
    with contextlib.ExitStack() as stack:
        if output is not None and single_node:
            stack.enter_context(acquire(output))
            stack.enter_context(_env(HOLDER_ENV, str(os.getpid())))
        if shared is not None:
            stack.enter_context(_env(failures.SHARED_ERRORS_ENV, str(shared)))
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kernelguard-launch-"))
        stack.enter_context(_env(LAUNCH_DIR_ENV, folder))
        stack.enter_context(_quiet())
        stack.enter_context(_ranks_start_with_interrupts_held())
        try:
            run(args)
        except ChildFailedError as e:
            if shared is not None:
                cause, records = failures.wait_for_cause(shared, since=since)
                if cause is not None:
                    return _print_cause(cause, records)
                _say_unshared(shared, records, local={int(r) for r in e.failures})
            return _report_failure(e, Path(folder), output)
        except SignalException as e:  # Ctrl-C or a scheduler's SIGTERM: the agent already stopped the ranks
            return _report_signal(e.sigval, Path(folder), output)
        except RendezvousError as e:
            print(f"kernelguard train: the ranks could not meet: {e}", file=sys.stderr, flush=True)
            return 1
        except ValueError as e:  # torchrun's own option checks, e.g. --nproc-per-node gpu without a GPU
            raise ConfigError(
                f"the launcher refused its options: {e}", fix="see `kernelguard train --help`"
            ) from None
    return 0


def _report_signal(sigval: signal.Signals, folder: Path, output: Path | None) -> int:
    """The launcher's one line for a Ctrl-C or SIGTERM; its exit code."""
    record = _first_record(folder)  # what the ranks saved before stopping, when they could
    # A rank that only lost its peer to the same signal ("Connection reset by peer") is not the news.
    if record is not None and not failures.is_secondary(
            {"crash": record.get("crash"), "type": "", "error": record.get("message", "")}):
        print(record["message"], file=sys.stderr, flush=True)
    else:
        from .signals import stopped_lines

        how = "interrupted (Ctrl-C)" if sigval == signal.SIGINT else f"stopped by {sigval.name}"
        print("\n".join(stopped_lines(output, how)), file=sys.stderr, flush=True)
    return 128 + int(sigval)


@contextlib.contextmanager
def _ranks_start_with_interrupts_held() -> Iterator[None]:
    """Each rank starts with Ctrl-C held until its handler is in place (kernelguard.errors.interrupts): one that
    reached a rank still importing kernelguard ended it in a KeyboardInterrupt traceback under the launcher's
    line. torchelastic starts every rank through ``SubprocessHandler._popen``; where a torch lacks it, ranks
    start as before."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )
    except ImportError:
        yield
        return
    real = getattr(SubprocessHandler, "_popen", None)
    if real is None:
        yield
        return

    def popen(self: Any, *args: Any, **kwargs: Any) -> Any:
        with children_start_with_interrupts_held():
            return real(self, *args, **kwargs)

    SubprocessHandler._popen = popen  # type: ignore[method-assign]
    try:
        yield
    finally:
        SubprocessHandler._popen = real  # type: ignore[method-assign]


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value  # the ranks inherit the launcher's environment
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchrun's own banners and per-failure ERROR lines would repeat what the launcher says once.
    LOGLEVEL (torchrun's variable) set by the user keeps them."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    # torchelastic gives each module's logger its own level, so the parents' level is not enough.
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_QUIET_LOGGERS)]
    loggers = [logging.getLogger(name) for name in {*_QUIET_LOGGERS, *names}]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_record(folder: Path, *, causes_first: bool = False) -> dict[str, Any] | None:
    """The lowest rank's error record (write_rank_error), if any rank wrote one. ``causes_first``: once a rank
    fails the agent SIGTERMs the others, and their "stopped by SIGTERM" records (exit 143) are consequences:
    whichever rank failed first, its own record is the one to print."""
    records = []
    for path in folder.glob("rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    if causes_first:
        records = [r for r in records if int(r.get("exit_code", 0)) != EXIT_PREEMPTED] or records
    return min(records, key=lambda r: r["rank"]) if records else None


def _report_failure(error: Any, folder: Path, output: Path | None = None) -> int:
    """Print the failing rank's kernelguard message once; return its exit code. A rank killed by a signal
    is the cause when the others only crashed (their collectives lost a peer). A rank that left on Ctrl-C
    before it wrote anything was interrupted, whether or not the launcher saw the Ctrl-C first."""
    first = _first_record(folder, causes_first=True)
    # The agent SIGTERMs the other ranks once one fails: a rank killed otherwise is the cause.
    signalled = [(int(f.exitcode) == -15, f.timestamp, r) for r, f in error.failures.items() if int(f.exitcode) < 0]
    killed = [r for *_, r in sorted(signalled)]
    # The agent's SIGTERM reached a rank (which saved and said so, exit 143) before the rank it stopped for,
    # killed by another signal, wrote anything: the kill is the news, not its consequence.
    consequence = first is not None and int(first.get("exit_code", 0)) == EXIT_PREEMPTED and any(
        -int(f.exitcode) not in (0, signal.SIGTERM) for f in error.failures.values() if int(f.exitcode) < 0
    )
    if first is not None and killed and (first.get("crash") or consequence):
        first = None
    if first is not None:
        if first.get("report"):
            print(first["report"], file=sys.stderr)
        print(first["message"], file=sys.stderr, flush=True)
        return int(first["exit_code"])
    rank, failure = (killed[0], error.failures[killed[0]]) if killed else error.get_first_failure()
    code = int(failure.exitcode)
    # a rank that left on Ctrl-C is the cause; the agent then SIGTERMs the others, which is not the news
    if any(int(f.exitcode) in (EXIT_INTERRUPTED, -signal.SIGINT) for f in error.failures.values()):
        code = EXIT_INTERRUPTED
    if code in (EXIT_INTERRUPTED, -signal.SIGINT):
        from .signals import stopped_lines

        print("\n".join(stopped_lines(output, "interrupted (Ctrl-C)")), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        print(f"kernelguard train: rank {rank} was killed by {name}.", file=sys.stderr, flush=True)
        return 128 - code
    print(
        f"kernelguard train: rank {rank} failed with exit code {code}; its output is above.",
        file=sys.stderr,
        flush=True,
    )
    return code


def _print_cause(cause: dict[str, Any], records: list[dict[str, Any]]) -> int:
    """The first failure of a multi-node job, with where it happened; its exit code (kernelguard.errors)."""
    if cause.get("report"):
        print(cause["report"], file=sys.stderr)
    print(cause["message"], file=sys.stderr)
    print(failures.where_line(cause, records), file=sys.stderr, flush=True)
    return int(cause["exit_code"])


def _say_unshared(shared: Path, records: list[dict[str, Any]], *, local: set[int]) -> None:
    """No rank left a root cause: say what that means before naming this node's own failure (``local``: the
    global ranks of this node that failed; with c10d the node ranks are only known to the ranks)."""
    if any(int(r["rank"]) not in local for r in records):
        return  # other nodes' records are there: their ranks only lost peers too
    print(
        f"kernelguard train: no rank of another node left an error record in {shared} (a rank killed by a "
        "signal leaves none; where --output-dir is not shared by the nodes, none can arrive): the other "
        "nodes' logs say what they saw.",
        file=sys.stderr,
        flush=True,
    )
