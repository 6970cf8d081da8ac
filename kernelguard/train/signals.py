"""How a run meets signals: ranks die with their launcher, and SIGTERM (a preemptible scheduler's notice)
stops training at the next step boundary with a checkpoint, exiting 143 (``EXIT_PREEMPTED``).

``die_with_parent``: a rank started by torchrun (or ``kernelguard train --nproc-per-node``) asks Linux to
SIGKILL it when its parent, the launcher's agent, dies (``prctl(PR_SET_PDEATHSIG)``), so ``kill -9`` of the
launcher leaves no rank training and holding the GPU. The parent pid is checked once more after the call:
a launcher that died before it would otherwise go unnoticed.

``StopRequest``: before training starts SIGTERM stops the process at once (nothing to save); once the loop
runs it only sets a flag, which every rank reads at each step boundary through one all-reduce, so all ranks
save the same step and stop together. Further SIGTERMs change nothing (a scheduler signals the launcher and
the ranks, and the launcher forwards its own); the hard stop is SIGKILL, which torchrun's agent sends 30 s
after its SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

from kernelguard.errors import Preempted

from .common.command_line import resume_command

__all__ = [
    "StopRequest",
    "die_with_parent",
    "stop_request",
    "stopped_lines",
]

def stopped_lines(output: Any, how: str) -> list[str]:
    """What a stopped run says last: what was saved, and on a line of its own the command to paste."""
    from pathlib import Path

    from .output.checkpoint import complete_checkpoints
    from .startup.startup_checks import run_artifacts

    done = complete_checkpoints(Path(output)) if output is not None else []
    if done:
        newest = done[-1][1].name
        return [f"kernelguard train: {how}; the newest checkpoint is {newest}. Continue exactly from it with:",
                _fitted(resume_command())]
    if output is not None and run_artifacts(Path(output)):
        said = f"kernelguard train: {how} before any checkpoint was saved (--save-steps N saves every N steps)."
        return [f"{said} Start again with:", _fitted(resume_command("--overwrite"))]
    return [f"kernelguard train: {how}; nothing was written. Start again with the same command."]

def _fitted(command: str) -> str:
    """The command for a person's terminal, broken with ` \\` so it still pastes; whole in a log."""
    from kernelguard.resolution import command_lines
    from kernelguard.stack import read_by_a_person, terminal_width

    return "\n".join(command_lines(command, terminal_width())) if read_by_a_person() else command


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """In a rank started by torchrun: be SIGKILLed when the launcher dies. False where Linux's prctl is
    unavailable (the rank then outlives a killed launcher, as torchrun's ranks always did)."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent or parent == 1:  # the launcher is already gone
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class StopRequest:
    """SIGTERM's state for this process (see the module docstring)."""

    def __init__(self) -> None:
        self.requested = False
        self.deferring = False  # True while the training loop runs: stop at the next step boundary
        self.when = "before training started; nothing was saved"  # said when SIGTERM stops at once
        self._previous: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.deferring:
            raise Preempted(f"kernelguard train: stopped by SIGTERM {self.when}.")
        self.requested = True

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGTERM for the duration (main thread only; elsewhere it keeps its default)."""
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, self._previous)

    def agreed(self, device: Any) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same boundary)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


_STOP = StopRequest()


def stop_request() -> StopRequest:
    """This process's one StopRequest."""
    return _STOP
