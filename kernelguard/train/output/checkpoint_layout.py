"""Where a run's checkpoints are and which are complete: ``OUTPUT/checkpoints/step_N`` sealed by its ``COMPLETE``
marker. Paths only, no torch: `kernelguard export` refuses a checkpoint that is not one before torch loads."""

from __future__ import annotations

from pathlib import Path

from kernelguard.errors import CheckpointError

from ..common.run_folder import CHECKPOINTS

__all__ = ["MARKER", "checkpoint_root", "complete_checkpoints", "latest_checkpoint", "not_a_checkpoint", "step_of"]

MARKER = "COMPLETE"


def checkpoint_root(output: Path) -> Path:
    return output / CHECKPOINTS


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step_") or name.endswith(".tmp"):
        return None
    try:
        return int(name[len("step_") :])
    except ValueError:
        return None


def complete_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint with its marker, oldest first (nothing verified yet)."""
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    return sorted((s, p) for p in root.iterdir() if (s := step_of(p)) is not None and (p / MARKER).is_file())


def latest_checkpoint(output: Path) -> Path | None:
    done = complete_checkpoints(output)
    return done[-1][1] if done else None


def not_a_checkpoint(checkpoint: Path) -> CheckpointError | None:
    """None for a sealed checkpoint; else the refusal naming the steps the run does have, with the nearest one
    as the folder to pass (``details["replace"]``: the command line puts it in place of the one given)."""
    if (checkpoint / MARKER).is_file():
        return None
    asked = step_of(checkpoint)
    unsealed = checkpoint.name.startswith("step_") and checkpoint.name.endswith(".tmp")  # a save being written
    run = checkpoint.parent if checkpoint.name == CHECKPOINTS else (
        checkpoint.parent.parent if asked is not None or checkpoint.parent.name == CHECKPOINTS else
        checkpoint.parent if unsealed else checkpoint)
    done = complete_checkpoints(run)
    what = ("has no COMPLETE marker (a save cut short, or a partial copy)" if checkpoint.is_dir() and asked is not None
            else "is a save still being written or cut short (a .tmp folder is never a complete checkpoint)"
            if unsealed else "does not exist" if not checkpoint.exists()
            else "is not a checkpoint folder (OUTPUT/checkpoints/step_N)")
    if not done:
        return CheckpointError(
            f"{checkpoint} {what}, and {run} has no complete checkpoint (a run saves one every --save-steps N "
            "steps and at its end).",
            fix=f"pass a complete checkpoint: a run's OUTPUT/checkpoints/step_N folder holding a {MARKER} file",
        )
    steps = [s for s, _ in done]
    # The nearest step to the one asked (a typo of it), the newest when none was asked or two are as near.
    best = max(done, key=lambda d: (-abs(d[0] - asked), d[0]) if asked is not None else (0, d[0]))[1]
    shown = ", ".join(map(str, steps[-8:])) if len(steps) <= 8 else f"... {', '.join(map(str, steps[-8:]))}"
    return CheckpointError(
        f"{checkpoint} {what}. The complete checkpoints of {run} are at step{'s' * (len(steps) > 1)} {shown}.",
        fix=f"pass {best}", details={"replace": (str(checkpoint), str(best))})
