"""Which rank of a multi-node job failed first: error records every node's launcher can read.

With ``--nnodes N > 1`` a rank that fails on one node makes the others fail too — their next collective loses
its peer (gloo: "Connection closed by peer", NCCL: a watchdog timeout or a communicator abort) — and each
node's launcher sees only its own ranks. So every rank, on an exception, also writes one small record to
``OUTPUT/.kernelguard-errors/node-N-rank-R.json`` (atomically: a temporary file, then a rename): its rank,
node, host, pid, exit code, the exception's type and message, its first useful frame (the innermost one in
kernelguard or the user's code, not torch's), the time. The ``--output-dir`` must be shared by the nodes
anyway (checkpoints and the export are written there by all ranks); where it is not, a launcher finds only
its own node's records and says so.

Global rank 0 clears the folder at start, under the run lock (:func:`clear`), so the records of an earlier
run are never read. The launcher of each node, once one of its ranks has failed, waits up to
``KERNELGUARD_ERROR_WAIT_S`` (10) seconds for a record that is a root cause — one that is not such a
consequence (:func:`is_secondary`) — and names the earliest: :func:`first_cause`. Times come from each
node's clock: nodes whose clocks differ by more than the seconds between two failures can name the later one.
The records stay after a failed run (the evidence, for anyone reading the folder) until the next run starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .common.atomic_file import write_text_atomically

__all__ = [
    "ERRORS_DIR",
    "SHARED_ERRORS_ENV",
    "clear",
    "first_cause",
    "first_frame",
    "is_secondary",
    "read_records",
    "wait_for_cause",
    "where_line",
    "write_record",
]

ERRORS_DIR = ".kernelguard-errors"
SHARED_ERRORS_ENV = "KERNELGUARD_SHARED_ERRORS"  # set by a multi-node launcher for its ranks: the folder
WAIT_ENV = "KERNELGUARD_ERROR_WAIT_S"
# What a rank reports when it only lost a peer that failed first (gloo, NCCL, the c10d store, torchelastic).
_SECONDARY = re.compile(
    r"connection (reset|closed|refused)|closed by peer|broken pipe|timed? ?out|timeout|watchdog|"
    r"communicator was aborted|\bncclRemoteError\b|remote process exited|socket|recvBytes|sendBytes|"
    r"peer .*(closed|exited|died)|rank 0 failed:",
    re.IGNORECASE,
)
_SECONDARY_TYPES = ("DistNetworkError", "DistBackendError", "DistStoreError", "ConnectionResetError",
                    "BrokenPipeError", "TimeoutError", "ConnectionError")
_NOT_USER = (os.sep + "torch" + os.sep, os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def is_secondary(record: dict[str, Any]) -> bool:
    """A rank that failed because a peer did (a lost connection, a timeout, an aborted communicator): never a
    kernelguard error (those name their own cause)."""
    if not record.get("crash"):
        return False
    text = f"{record.get('type', '')}: {record.get('error', '')}"
    return record.get("type") in _SECONDARY_TYPES or bool(_SECONDARY.search(text))


def first_frame(error: BaseException | None) -> str | None:
    """``file:line in function`` of the innermost frame of ``error`` in kernelguard or the user's code (not in
    torch or another installed package, kernelguard excepted); else the innermost frame."""
    if error is None or error.__traceback__ is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    useful = [f for f in frames if "kernelguard" in f.filename or not any(p in f.filename for p in _NOT_USER)]
    frame = (useful or frames)[-1] if frames else None
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else None


def write_record(record: dict[str, Any], error: BaseException | None) -> Path | None:
    """In a rank of a multi-node launch: write this rank's record to the shared folder (None elsewhere, or
    when the folder cannot be written: the launcher then has this node's own record only)."""
    folder = os.environ.get(SHARED_ERRORS_ENV)
    if not folder:
        return None
    node = int(os.environ.get("GROUP_RANK", "0") or 0)
    full = {
        **record,
        "node": node,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "type": type(error).__name__ if error is not None else None,
        "error": str(error).splitlines()[0][:500] if error is not None and str(error) else None,
        "frame": first_frame(error),
        "time": time.time(),
    }
    path = Path(folder) / f"node-{node}-rank-{record['rank']}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(full))
    except OSError as e:
        print(f"kernelguard train: cannot write the error record {path}: {e}", file=sys.stderr, flush=True)
        return None
    return path


def clear() -> None:
    """Global rank 0 of a multi-node launch, holding the run lock: remove the records of an earlier run."""
    folder = os.environ.get(SHARED_ERRORS_ENV)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every complete record in ``folder`` (a temporary file being written is not one)."""
    records = []
    for path in sorted(folder.glob("node-*-rank-*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "rank" in data:
                records.append(data)
    return records


def first_cause(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The earliest record that is not a consequence of another rank's failure. Ranks that all raised the same
    error (rank 0's refusal, shared with every rank) are named by their lowest rank."""
    causes = [r for r in records if not is_secondary(r)]
    if not causes:
        return None
    earliest = min(causes, key=lambda r: (float(r.get("time", 0.0)), int(r["rank"])))
    same = [r for r in causes if r.get("message") == earliest.get("message")]
    return min(same, key=lambda r: int(r["rank"]))


def wait_for_cause(folder: Path, *, since: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Poll ``folder`` until a root-cause record newer than ``since`` is there, at most the wait; return it
    (None: none came) and every record read."""
    try:  # checked before any rank started (kernelguard.train.startup.preflight.check_environment); never fatal here
        limit = max(0.0, float(os.environ.get(WAIT_ENV, "10") or 0))
    except ValueError:
        limit = 10.0
    deadline = time.monotonic() + limit
    while True:
        records = [r for r in read_records(folder) if float(r.get("time", 0.0)) >= since]
        cause = first_cause(records)
        if cause is not None or time.monotonic() >= deadline:
            return cause, records
        time.sleep(0.2)


def where_line(cause: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """One line: where the first failure happened, and what the other ranks died of."""
    when = time.strftime("%H:%M:%S", time.localtime(float(cause.get("time", 0.0))))
    line = (
        f"kernelguard train: this failure happened first on node {cause.get('node')} (host {cause.get('host')}), "
        f"rank {cause['rank']} (pid {cause.get('pid')}) at {when}"
    )
    if cause.get("frame"):
        line += f", in {cause['frame']}"
    others = sorted((r for r in records if r is not cause and is_secondary(r)), key=lambda r: int(r["rank"]))
    if others:
        names = ", ".join(f"rank {r['rank']} on node {r.get('node')}" for r in others)
        error = str(others[0].get("error") or "")
        error = error if len(error) <= 100 else error[:99] + "…"
        line += f"; {names} then lost a peer ({others[0].get('type')}: {error})"
    return line + "."
