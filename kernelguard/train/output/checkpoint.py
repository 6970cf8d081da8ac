"""Atomic, verified DCP checkpoints, resume and retention (the safetensors export: kernelguard.train.output.export).

Layout under ``OUTPUT/checkpoints/``: ``step_N/`` holds the DCP shards (model + optimizer, sharded as
trained), ``trainer.json`` (step, scheduler, data position, world size, run identity), ``rng_rank{r}.pt``,
``manifest.json`` (every file's size and sha256) and the ``COMPLETE`` marker, which holds the manifest's own
sha256 and so seals it. Everything is written into ``step_N.tmp/`` first; rank 0 writes the manifest and the
marker last and renames the folder. A folder without its marker (a crash mid-save) is never resumed from and
is removed. ``--resume`` verifies the newest checkpoint against its manifest before loading and falls back to
the newest valid one, naming the bad file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kernelguard.errors import CheckpointError, KernelGuardError, TrainingDiverged

from ..common.logs import logger
from ..common.write_errors import describe, is_torch_short_write, root_cause, write_failure
from ..step.step import StepResult
from .checkpoint_layout import MARKER, checkpoint_root, complete_checkpoints, latest_checkpoint
from .checkpoint_layout import step_of as _step_of

__all__ = [
    "MANIFEST",
    "MARKER",
    "TRAINER_STATE",
    "Resumable",
    "checkpoint_root",
    "complete_checkpoints",
    "diverged",
    "find_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "read_trainer_state",
    "remove_incomplete",
    "resumable",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "unsealed_checkpoints",
    "unsealed_warnings",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
_SEAL = "manifest sha256 "


def unsealed_checkpoints(output: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_N`` folder without its marker, oldest first. A save in progress writes
    ``step_N.tmp``, so these were sealed once and lost the marker (deleted by hand, a partial copy): never
    resumed from, never deleted unasked, said once at ``--resume`` (:func:`unsealed_warnings`)."""
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    return sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and not (p / MARKER).exists())


def unsealed_warnings(output: Path, resumed: Path | None) -> list[str]:
    """One line per marker-less checkpoint newer than ``resumed``: skipped, and replaced if its step is saved."""
    newest = _step_of(resumed) if resumed is not None else -1
    start = f"resuming from {resumed.name}" if resumed is not None else "starting from step 0"
    return [
        f"checkpoint {path.name} has no {MARKER} marker (deleted, or a partial copy): skipped, {start}; it will "
        f"be replaced when this run saves step {step} again: copy it away now to keep it"
        for step, path in unsealed_checkpoints(output) if step > (newest or -1)
    ]


def remove_incomplete(output: Path) -> list[Path]:
    """Delete the ``*.tmp`` folders a crash mid-save left (rank 0 only). Marker-less ``step_N`` folders stay:
    see :func:`unsealed_checkpoints`."""
    removed: list[Path] = []
    for root in (checkpoint_root(output), output):
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.is_dir() and p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


# ------------------------------------------------------------------------------------------- manifest ---
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(paths: list[Path]) -> dict[Path, str]:
    # hashlib releases the GIL on large buffers: shards of one checkpoint hash in parallel.
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return dict(zip(paths, pool.map(_sha256, paths)))


def write_manifest(folder: Path, step: int) -> None:
    """Record every file's size and sha256, then seal the manifest with the COMPLETE marker (fsync'ed)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, MARKER))
    digests = _hash_files(files)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": digests[p]} for p in files}
    text = json.dumps({"step": step, "files": entries}, indent=1, sort_keys=True)
    (folder / MANIFEST).write_text(text)
    with open(folder / MARKER, "w") as f:
        f.write(f"step {step}\n{_SEAL}{hashlib.sha256(text.encode()).hexdigest()}\n")
        f.flush()
        os.fsync(f.fileno())


def _sealed_digest(folder: Path) -> str | None:
    """The manifest checksum written into the marker; None for a marker from before manifests existed."""
    for line in (folder / MARKER).read_text().splitlines():
        if line.startswith(_SEAL):
            return line[len(_SEAL) :].strip()
    return None


def verify_checkpoint(folder: Path) -> str | None:
    """None when every file matches the sealed manifest, else what is wrong, naming the file."""
    try:
        seal = _sealed_digest(folder)
        if seal is None:
            return None  # written before manifests existed: nothing to verify against
        text = (folder / MANIFEST).read_text()
    except FileNotFoundError as e:
        return f"{e.filename} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{getattr(e, 'filename', None) or folder / MARKER} is unreadable ({e})"
    if hashlib.sha256(text.encode()).hexdigest() != seal:
        return f"{folder / MANIFEST} does not match the checksum sealed in {folder / MARKER}"
    try:
        entries = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{folder / MANIFEST} is not a valid manifest ({e})"
    return _verify_files(folder, entries)


def _verify_files(folder: Path, entries: dict[str, dict[str, Any]]) -> str | None:
    present: list[Path] = []
    for name, entry in sorted(entries.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{path} has {size} bytes; the manifest says {entry['size']} (truncated or overwritten)"
        present.append(path)
    digests = _hash_files(present)
    for path in present:
        if digests[path] != entries[str(path.relative_to(folder))]["sha256"]:
            return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None


@dataclass(frozen=True, slots=True)
class Resumable:
    """What ``--resume`` finds in a run folder, read in one call (:func:`resumable`)."""

    path: Path | None  # the newest checkpoint that verifies; None: none saved yet
    warnings: tuple[str, ...]  # each newer checkpoint skipped, and why
    identity: dict[str, Any] | None  # the run identity saved with ``path`` (None: none saved there)


def resumable(output: Path) -> Resumable:
    """The checkpoint ``--resume`` continues from, every newer one it skips (and what replaces it), and the run
    identity saved with it. Raises CheckpointError when checkpoints exist but none verifies."""
    path, unusable = _newest_verified(output)
    warnings = [_unusable_line(folder, problem) for folder, problem in unusable]
    warnings += unsealed_warnings(output, path)
    if unusable:
        warnings.append(
            f"falling back to {path.name}, the newest checkpoint that verifies; the unusable "
            f"{', '.join(folder.name for folder, _ in unusable)} (all of its files, intact ones too) will be "
            "replaced when this run saves that step again: copy it away now to keep it"
        )
    saved = read_trainer_state(path).get("identity") if path is not None else None
    return Resumable(path, tuple(warnings), saved if isinstance(saved, dict) else None)


def find_resumable(output: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one that did not (naming its bad file).

    Raises CheckpointError when checkpoints exist but none verifies."""
    path, unusable = _newest_verified(output)
    return path, [_unusable_line(folder, problem) for folder, problem in unusable]


def _newest_verified(output: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and each newer one with why it does not; refused when none does."""
    unusable: list[tuple[Path, str]] = []
    for _, folder in reversed(complete_checkpoints(output)):
        problem = verify_checkpoint(folder)
        if problem is None:
            return folder, unusable
        unusable.append((folder, problem))
    if unusable:
        raise CheckpointError(
            f"--resume found no valid checkpoint in {checkpoint_root(output)}:\n  "
            + "\n  ".join(_unusable_line(folder, problem) for folder, problem in unusable),
            fix="restore the damaged files, or start again with --overwrite (deletes this run's checkpoints "
            "and metrics)",
        )
    return None, []


def _unusable_line(folder: Path, problem: str) -> str:
    return f"checkpoint {folder.name} is unusable: {problem}"


def prune_checkpoints(output: Path, *, keep: int, newest: int) -> list[Path]:
    """Keep the ``keep`` newest complete checkpoints up to step ``newest`` (just saved, always kept); delete
    older ones. Checkpoints after ``newest`` (left by a run that resumed from an earlier one) are untouched."""
    older = [p for s, p in complete_checkpoints(output) if s < newest]
    removed = []
    for path in older[: max(0, len(older) - (keep - 1))]:
        try:
            shutil.rmtree(path)
        except OSError as e:  # retention must not stop a healthy run: say so and keep going
            logger.warning(f"could not delete old checkpoint {path}: {e}")
            continue
        removed.append(path)
    return removed


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _save_rng_state(path: Path) -> None:
    # Through a Python file object: a full disk then raises OSError(ENOSPC), which write_failure names; on a
    # path torch's own writer reports it only as "[enforce fail at inline_container.cc] unexpected pos".
    with open(path, "wb") as f:
        torch.save(rng_state(), f)


def save_checkpoint(
    output: Path,
    *,
    step: int,
    model: Any,
    optimizer: Any,
    trainer_state: dict[str, Any],
    is_main: bool,
    keep: int | None = None,
    carry: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``step_N`` atomically (all ranks), seal it with its manifest, then apply ``keep`` (retention).
    ``carry`` (rank 0) adds files into the folder before it is sealed (kernelguard.train.output.provenance)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoint_root(output) / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        _save_rng_state(tmp / f"rng_rank{dist.get_rank()}.pt")
    except (CheckpointException, OSError, RuntimeError) as e:  # disk full, permissions changed, Ctrl-C inside DCP
        if not isinstance(e, (CheckpointException, OSError)) and not is_torch_short_write(e):
            raise  # not a write's failure (a lost peer's gloo error): the launcher names its real cause
        need = _state_bytes(model_sd, optim_sd) * dist.get_world_size()  # every rank's shards, on a shared disk
        raise write_failure(f"writing checkpoint {tmp}", e, folder=output, need_bytes=need) from None
    dist.barrier()
    outcome: list[Any] = [None]
    if is_main:
        try:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
            if carry is not None:
                carry(tmp)
            write_manifest(tmp, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except OSError as e:
            outcome[0] = write_failure(f"writing checkpoint {tmp}", e, folder=output)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(outcome, src=0)  # rank 0's failure stops every rank, none waits
    if outcome[0] is not None:
        raise outcome[0]
    if is_main and keep is not None:
        prune_checkpoints(output, keep=keep, newest=step)
    dist.barrier()
    return final


def _state_bytes(*states: Any) -> int:
    """Bytes of the tensors in nested state dicts (this rank's shards of a DTensor)."""
    import torch

    total, stack = 0, list(states)
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            total += local.numel() * local.element_size()
    return total


def read_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer.json`` of a checkpoint; CheckpointError naming the file when it cannot be read."""
    file = path / TRAINER_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(
            f"{file} cannot be read ({e}).", fix="restore the file, or start again with --overwrite"
        ) from e
    if not isinstance(state, dict) or "step" not in state or "scheduler" not in state:
        raise CheckpointError(
            f"{file} is not a kernelguard trainer state.", fix="start again with --overwrite"
        )
    return state


def load_checkpoint(path: Path, *, model: Any, optimizer: Any) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG in place; return the trainer state.

    Verify first (:func:`find_resumable`): DCP reading a damaged shard fails deep inside torch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    trainer_state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    try:
        dcp.load(state, checkpoint_id=str(path))
        rng = (
            torch.load(rng_file, weights_only=False) if rng_file.exists() else None
        )  # absent: more ranks now
    # A checkpoint from before manifests is not verified: its damage surfaces here, inside torch.
    except (CheckpointException, OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
        cause = root_cause(e)
        if isinstance(cause, KeyboardInterrupt | KernelGuardError):  # Ctrl-C or SIGTERM while loading
            raise cause from None
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded: {describe(cause)}",
            fix=f"delete {path} to resume from the checkpoint before it, or start again with --overwrite",
        ) from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rng is not None:
        set_rng_state(rng)
    return trainer_state


def diverged(cfg: Any, step: int, result: StepResult) -> TrainingDiverged:
    """The error for a step whose loss or gradient norm was not finite (its update was not applied)."""
    which = ", ".join(
        f"{name} is {value}" for name, value in (("loss", result.loss), ("gradient norm", result.grad_norm))
        if not math.isfinite(value)
    )
    saved = complete_checkpoints(cfg.checkpoint.output_dir)
    kept = f"the last good checkpoint is {saved[-1][1]}" if saved else "no checkpoint was saved before it"
    opt = cfg.optimizer
    return TrainingDiverged(
        f"step {step}: {which}; training diverged and stopped before applying that step. Nothing was saved or "
        f"exported after it; {kept}.",
        fix=f"lower --learning-rate (now {opt.learning_rate:g}) or raise --warmup-steps (now {opt.warmup_steps}); "
        f"keep --max-grad-norm above 0 (now {opt.max_grad_norm:g})"
        + ("; prefer --param-dtype bf16 to fp16" if cfg.runtime.param_dtype == "fp16" else "")
        + "; then --resume from the last good checkpoint (or --overwrite to start again)",
        details={"step": step, "loss": result.loss, "grad_norm": result.grad_norm},
    )
