"""Checks a run passes before any expensive work (model build, guard, tokenisation, data reading), and the
claim of the output folder once the gate has passed.

Preflight reads, never writes: a refusal leaves the output folder exactly as it was. It checks that the
inputs exist, the flags agree, the output folder can take at least one checkpoint, and how this start
relates to a run already in the folder: without ``--resume`` a folder holding a run is refused unless
``--overwrite``; with ``--resume`` the newest checkpoint is verified against its manifest (falling back to
the newest valid one) and its run identity must equal this one (``--resume-anyway`` overrides, warning).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError, ConfigError
from kernelguard.resolution import estimated_params

from ..common.run_folder import FINAL
from ..inputs.identity import RUN_FILE, judge_resume, run_identity, write_identity
from ..model.parallel import model_source
from ..model.weight_files import safetensors_header, weights_to_load
from ..output import checkpoint as ckpt
from ..output.checkpoint_layout import step_of
from ..settings.config import TrainConfig, save_config
from .startup_checks import (
    check_environment,
    check_flags,
    check_inputs,
    check_model_family,
    check_model_size,
    check_paths,
    check_profile_window,
    check_writable_folder,
    run_artifacts,
)

__all__ = [
    "StartPlan",
    "check_checkpoint_shapes",
    "check_environment",
    "check_flags",
    "check_image_lock",
    "check_inputs",
    "check_model_size",
    "check_output",
    "check_packed_segments",
    "segment_limit_note",
    "check_paths",
    "check_writable_folder",
    "checkpoint_bytes_estimate",
    "claim_output",
    "plan_resume",
    "check_something_left",
    "nothing_left_to_train",
    "preflight",
]

# fp32 master weights + AdamW's two fp32 moments, per parameter (DCP stores them as trained).
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True, slots=True)
class StartPlan:
    """What preflight decided: this run's identity, the verified checkpoint to resume from, warnings, and
    notices (what the user asked for, said once at info level: e.g. random init from a config file)."""

    identity: dict[str, Any]
    resume_from: Path | None = None
    warnings: tuple[str, ...] = field(default=())
    notices: tuple[str, ...] = field(default=())


def preflight(cfg: TrainConfig, *, world_size: int) -> StartPlan:
    """Every check that needs no model, no tokenizer load and no data parse. Raises ConfigError/DataError."""
    check_environment()
    check_flags(cfg)
    check_inputs(cfg)
    check_paths(cfg)
    check_profile_window(cfg)  # after the paths: a --profile-trace under a file is the first thing to fix
    config, _ = model_source(cfg.model.model)
    check_model_size(config, model=str(cfg.model.model))
    check_model_family(config, model=str(cfg.model.model), packing=cfg.packing.packing)
    weights, notice = weights_to_load(cfg.model.model, init=cfg.model.init)
    check_output(cfg.checkpoint.output_dir, need_bytes=checkpoint_bytes_estimate(config, weights))
    identity = run_identity(cfg, world_size=world_size, model_config=config)
    notices = (notice,) if notice else ()
    if not cfg.checkpoint.resume:  # check_paths refused a folder that holds another run
        return StartPlan(identity, notices=notices)
    plan = plan_resume(cfg, identity)
    return StartPlan(plan.identity, plan.resume_from, plan.warnings, (*notices, *plan.notices))


def check_checkpoint_shapes(model: Any, checkpoint: Path | None) -> None:
    """Refuse resuming a checkpoint whose tensors have other shapes than this model's (a wider or deeper
    config under --resume-anyway): no flag can continue across that, and the checkpoint itself is fine."""
    if checkpoint is None:
        return
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata is find_resumable's to report, not this check's
        return
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [
        f"{name[6:]}: {tuple(entry.size)} in the checkpoint, {expected[name[6:]]} now"
        for name, entry in meta.items()
        if name.startswith("model.") and name[6:] in expected and hasattr(entry, "size")
        and tuple(entry.size) != expected[name[6:]]
    ]
    if wrong:
        raise CheckpointError(
            f"--resume: {checkpoint} holds a model of another shape ({len(wrong)} tensor(s) differ, e.g. "
            + "; ".join(wrong[:2]) + "); --resume-anyway cannot continue across a change of architecture.",
            fix="resume with the model config it was trained with (the checkpoint is intact: keep it), or start "
            "the new architecture in another --output-dir",
        )


def _weight_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from safetensors headers (no tensor data read); {} for other formats."""
    index = folder / "model.safetensors.index.json"
    files = [folder / "model.safetensors"]
    if index.is_file():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            files = [folder / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    shapes: dict[str, list[int]] = {}
    for path in files:
        header = _safetensors_header(path) or {}
        shapes.update(
            {k: v.get("shape", []) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
        )
    return shapes


def check_output(output: Path, *, need_bytes: int) -> None:
    """The output folder (or its nearest existing parent) is a writable folder with room for a checkpoint."""
    existing = check_writable_folder(output, flag="--output-dir")
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise ConfigError(
            f"--output-dir {output}: {free / 2**30:.1f} GiB free on its disk; one checkpoint needs about "
            f"{need_bytes / 2**30:.1f} GiB (12 bytes per parameter).",
            fix="free disk space or put --output-dir on a larger disk",
        )


def plan_resume(cfg: TrainConfig, identity: dict[str, Any]) -> StartPlan:
    """The newest verified checkpoint, refused when its run identity differs (unless --resume-anyway)."""
    found = ckpt.resumable(cfg.checkpoint.output_dir)
    warnings, notices = judge_resume(
        identity, saved=found.identity, checkpoint=found.path, output=cfg.checkpoint.output_dir,
        anyway=cfg.checkpoint.resume_anyway,
    )
    return StartPlan(identity, found.path, (*found.warnings, *warnings), tuple(notices))


def check_something_left(cfg: TrainConfig, resume_from: Path | None) -> None:
    """A --resume whose checkpoint already reached --max-steps (and exported, if asked), refused before the gate
    and the data (it took 41 s to say): after the identity and the checkpoint's shapes, which name a run of other
    settings or another model first. Without --max-steps the run's length needs the data: the loop says it."""
    if resume_from is None or cfg.training.max_steps is None:
        return
    step = step_of(resume_from) or 0
    export_pending = cfg.checkpoint.export and not (cfg.checkpoint.output_dir / FINAL).exists()
    if step > cfg.training.max_steps or (step == cfg.training.max_steps and not export_pending):
        raise nothing_left_to_train(resume_from, step, cfg.training.max_steps)


def nothing_left_to_train(checkpoint: Path, step: int, stop: int) -> CheckpointError:
    """--resume of a run that already reached its last step: what to do instead (train further, or use it)."""
    final = checkpoint.parent.parent / FINAL
    use = f"use {final} (the exported model)" if final.exists() else "use the checkpoint as it is"
    return CheckpointError(
        f"--resume: {checkpoint} is at step {step}, and this run stops at step {stop}: there is nothing left "
        "to train.",
        fix=f"raise --max-steps above {step} to train further (with --schedule-steps to keep the LR schedule), "
        f"or {use}",
    )


def claim_output(cfg: TrainConfig, plan: StartPlan) -> list[str]:
    """Rank 0, after the gate passed: --overwrite deletes the old run's artifacts (returned), then the folder
    is created, leftovers of a crash mid-save are removed and this run's identity and configuration
    (``train_config.json``) are written."""
    removed = []
    fresh = not (cfg.checkpoint.output_dir / RUN_FILE).exists()
    try:
        for name in run_artifacts(cfg.checkpoint.output_dir) if cfg.checkpoint.overwrite else []:
            target = cfg.checkpoint.output_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
            removed.append(name)
        cfg.checkpoint.output_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_incomplete(cfg.checkpoint.output_dir)
        write_identity(cfg.checkpoint.output_dir, plan.identity)
        save_config(cfg, cfg.checkpoint.output_dir)  # a --config file that repeats this run
    except OSError as e:  # the cause named (a full disk is not a permission problem), nothing trained yet
        from ..common.write_errors import write_failure

        if fresh:  # a run.json without its train_config.json would make the folder look like a run's
            with contextlib.suppress(OSError):
                (cfg.checkpoint.output_dir / RUN_FILE).unlink()
        raise write_failure(f"--output-dir {cfg.checkpoint.output_dir}: writing the run's record", e,
                            folder=cfg.checkpoint.output_dir, after="run the same command again") from None
    return removed


# ---------------------------------------------------------------------------------------- disk estimate ---
def checkpoint_bytes_estimate(config: Any, weights: Path | None) -> int:
    """Bytes of one checkpoint: parameters (from the weight files' headers, else the config) x 12."""
    params = _params_from_weights(weights) if weights is not None else None
    return CHECKPOINT_BYTES_PER_PARAM * (params or estimated_params(config))


def _params_from_weights(folder: Path) -> int | None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        counts = [_safetensors_params(folder / s) for s in shards]
        return None if None in counts else sum(c for c in counts if c is not None)
    single = folder / "model.safetensors"
    if single.is_file():
        return _safetensors_params(single)
    binary = folder / "pytorch_model.bin"
    return binary.stat().st_size // 2 if binary.is_file() else None  # assume 16-bit weights


def _safetensors_header(path: Path) -> dict[str, Any] | None:
    """A safetensors header, None when the file is not one (the weight check says why, later)."""
    try:
        return safetensors_header(path)[0]
    except (OSError, ValueError):
        return None


def _safetensors_params(path: Path) -> int | None:
    """Parameter count from a safetensors header."""
    header = _safetensors_header(path)
    if header is None:
        return None
    total = 0
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict):
            n = 1
            for dim in entry.get("shape", []):
                n *= int(dim)
            total += n
    return total


def _over_segment_limit(counts: list[int], config: Any) -> tuple[int, int, list[tuple[int, int]]] | None:
    """(limit, value heads, over-limit blocks as (index, segments)) when a block passes fla < 0.6.0's limit."""
    from kernelguard.resolution import FLA_1077_GRID_LIMIT, gdn_dims

    dims = gdn_dims(config)
    if dims is None or not counts:
        return None
    limit = FLA_1077_GRID_LIMIT // dims.num_v_heads
    over = [(i, n) for i, n in enumerate(counts) if n > limit]
    return (limit, dims.num_v_heads, over) if over else None


def _over_text(found: tuple[int, int, list[tuple[int, int]]]) -> str:
    limit, heads, over = found
    worst = max(over, key=lambda item: item[1])
    return (f"{len(over)} packed block(s) hold more than {limit} segments (65,535 // {heads} value heads), the "
            f"most {worst[1]} in block {worst[0]}")


def check_packed_segments(counts: list[int], *, config: Any, fla_version: str | None = None) -> None:
    """fla < 0.6.0 (fla PR #1077) launches its GDN state kernels with N * HV on a grid axis CUDA caps at 65,535:
    a block with more than 65,535 // HV segments fails at its first step. Refused here, before step 1."""
    from packaging.version import InvalidVersion, Version

    from kernelguard.errors import GuardRefused
    from kernelguard.resolution import by_id, distribution_version

    issue = by_id("fla-1077-too-many-segments")
    version = fla_version or distribution_version("fla-core") or distribution_version("flash-linear-attention")
    try:
        affected = version is not None and Version(Version(version).base_version) < Version("0.6.0")
    except InvalidVersion:
        affected = False
    found = _over_segment_limit(counts, config) if affected else None
    if issue is None or found is None:
        return
    raise GuardRefused(
        f"known issue {issue.id} ({issue.source}): {_over_text(found)}; fla {version} would fail the launch of "
        "that step with 'Triton Error [CUDA]: invalid argument'.",
        fix=issue.fix,
    )


def segment_limit_note(counts: list[int], *, config: Any) -> str | None:
    """Off the GPU, where fla does not run: the same count, said once, because this data goes to a GPU next."""
    found = _over_segment_limit(counts, config)
    if found is None:
        return None
    return (f"{_over_text(found)}: on a GPU with fla < 0.6.0 this run would be refused before step 1 (known issue "
            "fla-1077-too-many-segments); fla >= 0.6.0 has no such limit")


def check_image_lock(lock: str | None, policy: Any) -> None:
    """--lock / KERNELGUARD_LOCK, on every device and before the model is built: a node whose stack differs from
    the image's lock is refused (exit 3) with one line per difference; so is one where the lock's check fails.
    The run's --allow items are compared with the lock's: the guard will run with them."""
    from kernelguard.errors import GuardRefused, LockMismatch
    from kernelguard.runtime import check_lock

    try:
        result = check_lock(lock, allow=policy)  # the run's own --allow: it must be the lock's
    except LockMismatch as e:
        raise GuardRefused(str(e)) from e
    if result is not None and not result.ok:
        from kernelguard.stack import render

        raise GuardRefused(render(result))
