"""What ``kernelguard export`` checks before it writes (kernelguard.train.output.export): the destination (absent
unless ``--overwrite``, writable, with room), who else is writing (a live run, another export: their lock
refusals), where the config, tokenizer and carried tensors come from (kernelguard.train.output.provenance), and
whether the shard size makes an absurd number of files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError, ConfigError

from ..common.run_folder import CHECKPOINTS, CONFIG_FILE

__all__ = [
    "MANY_SHARDS",
    "SMALL_SHARD_BYTES",
    "ExportSource",
    "check_destination",
    "check_room",
    "export_in_use",
    "export_source",
    "many_shards_warning",
    "run_in_use",
]

# An export is said to be split into many files when it has more than MANY_SHARDS of them and its
# --max-shard-size is under SMALL_SHARD_BYTES: then the size was almost surely a typo (1KB for 1GB) or a test
# value. Real exports of the largest models at the default 5GB are hundreds of files and are not said; a small
# model at 1KB (45 files) is. The one rule of `kernelguard train`'s final export and of `kernelguard export`.
MANY_SHARDS = 16
SMALL_SHARD_BYTES = 100 * 10**6


def many_shards_warning(count: int, max_bytes: int) -> str | None:
    """A line when ``--max-shard-size`` makes an export of more than :data:`MANY_SHARDS` files, each under
    :data:`SMALL_SHARD_BYTES`."""
    if count <= MANY_SHARDS or max_bytes >= SMALL_SHARD_BYTES:
        return None
    return (f"--max-shard-size {max_bytes:,} bytes splits the export into {count:,} files (more than "
            f"{MANY_SHARDS} files under {SMALL_SHARD_BYTES // 10**6} MB each: a size in bytes or KB where MB or "
            "GB was meant?); file systems and the Hub handle fewer, larger files better: the default is 5GB")


def check_destination(final: Path, *, overwrite: bool, checkpoint: Path | None = None) -> None:
    """``final`` does not exist (or ``overwrite``), and its nearest existing folder is a writable folder; it is
    neither the run folder of ``checkpoint`` nor inside its checkpoints (``--overwrite`` would delete them)."""
    if checkpoint is not None:
        run, here = checkpoint.resolve().parent.parent, final.resolve()
        if here == run or here in run.parents or here.is_relative_to(run / CHECKPOINTS):
            raise ConfigError(
                f"--output {final} would put the export over the run's own folder or its checkpoints "
                f"({run}); --overwrite would delete them.",
                fix=f"pass --output {run / 'final'} (the default) or a folder outside {run / 'checkpoints'}")
    if final.exists() and not overwrite:
        fresh = next(final.with_name(f"{final.name}-{n}") for n in range(2, 10**6)
                     if not final.with_name(f"{final.name}-{n}").exists())
        raise ConfigError(f"--output {final} already exists.",
                          fix=f"pass --output {fresh} (a new folder), or --overwrite to replace it")
    if final.exists() and not final.is_dir():
        raise ConfigError(f"--output {final} is a file.", fix="pass --output NEW_DIR")
    existing = final.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--output {final}: {existing} is a file, not a folder.", fix="pass --output NEW_DIR")
    if not os.access(existing, os.W_OK | os.X_OK):
        readonly = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        why = "is on a read-only file system" if readonly else f"is not writable by this user (uid {os.getuid()})"
        raise ConfigError(f"--output {final}: {existing} {why}.",
                          fix="pass --output DIR on a writable disk")


def check_room(final: Path, *, need_bytes: int) -> None:
    from ..common.write_errors import disk_free

    free = disk_free(final.parent)
    if free is not None and free < need_bytes:
        raise ConfigError(
            f"--output {final}: {free / 2**30:.2f} GiB free on its disk; the export needs "
            f"{need_bytes / 2**30:.2f} GiB.", fix="free disk space, or pass --output DIR on a larger disk")


def run_in_use(run: Path, who: str) -> CheckpointError:
    return CheckpointError(
        f"{run} is in use ({who}): a live run writes its own final/ and checkpoints there, and an export "
        "meanwhile would race it.",
        fix="wait for that process to finish (or stop it), then export; a finished run has final/ already")


def export_in_use(folder: Path, who: str) -> CheckpointError:
    return CheckpointError(f"another export is writing into {folder} right now ({who}).",
                           fix="wait for it to finish, or pass another --output")


@dataclass(frozen=True, slots=True)
class ExportSource:
    """Where an export of a checkpoint reads its config, tokenizer and carried tensors from."""

    config: Any
    tokenizer: Path
    chat_template: str | None
    folder: Path | None  # its generation_config.json is kept
    model: Path  # the run's model folder: the carried tensors' files
    multimodal: bool
    carried: tuple[str, ...]

    def plan(self, meta: Any) -> Any:
        from ..model.weights import SourceLayout, WeightPlan, plan_weights

        if self.carried or (self.model.is_dir() and not self.multimodal and self.folder == self.model):
            if not (self.model / "config.json").is_file():
                raise CheckpointError(
                    f"this checkpoint copies {len(self.carried)} tensor(s) (e.g. {self.carried[0]}) unchanged "
                    f"from the run's model folder {self.model}, which is gone.",
                    fix=f"restore {self.model} (the folder the run trained from) at that path; the trained "
                    "weights come from the checkpoint")
            return plan_weights(meta, self.model)[0]
        layout = SourceLayout(self.model, {}, self.multimodal)
        names = {k: layout.file_key(k) for k in meta.state_dict()}
        return WeightPlan(layout, names, (), False)


def export_source(checkpoint: Path, saved: dict[str, Any], *, accept_changed_tokenizer: bool) -> ExportSource:
    from ..model.parallel import model_source
    from .checkpoint import read_trainer_state
    from .provenance import read_source, tokenizer_changes

    record = read_source(checkpoint)
    if record is not None:
        config, _ = model_source(str(record["config_path"]))
        chat = record["chat_template_path"]
        return ExportSource(config, record["tokenizer_path"], str(chat) if chat else None,
                             checkpoint / "source", Path(record["model"]), bool(record["multimodal"]),
                             tuple(record["carried"]))
    # A checkpoint from before checkpoints carried their sources: the folders the run named, as they are now.
    model, tokenizer = Path(str(saved["model"])), Path(str(saved.get("tokenizer") or saved["model"]))
    for what, path in (("model", model), ("tokenizer", tokenizer)):
        if not path.exists():
            raise CheckpointError(
                f"the run's {what} {path} (named in {checkpoint.parent.parent / CONFIG_FILE}) is gone, "
                "and this checkpoint was written before checkpoints carried their config and tokenizer.",
                fix=f"restore {path} at that path, then export again")
    identity = read_trainer_state(checkpoint).get("identity") or {}
    changes = tokenizer_changes(identity, tokenizer=str(tokenizer), chat_template=saved.get("chat_template"))
    if changes and not accept_changed_tokenizer:
        raise CheckpointError(
            "; ".join(changes) + f" (the record is {checkpoint / 'trainer.json'}): the export would ship a "
            "tokenizer the model was not trained with.",
            fix="restore the files the run trained with, or pass --accept-changed-tokenizer to export with "
            "them as they are now")
    config, weights = model_source(str(model))
    layout_folder = weights if weights is not None else model
    return ExportSource(config, tokenizer, saved.get("chat_template"), model if model.is_dir() else None,
                         layout_folder, False, ())
