"""A run's identity: what must be equal for a checkpoint to continue exactly, written to ``OUTPUT/run.json``.

Fingerprints (sha256) of the model config, the tokenizer files, the chat template and the training data, plus
every setting that changes the numbers: which examples exist, how they pack and reach the model (``--packing``),
their order, the compute dtype (``--param-dtype``), the optimizer and the LR schedule. Settings that only
change speed, memory or logging (``--max-steps``, ``--save-steps``, activation checkpointing, resharding, eval
cadence, profiling) are not part of it: changing them between a run and its resume is fine. Four that change
how the same math is computed (``--loss``, ``--attention``, ``--compile``, ``--fused-norms``: float rounding
only) are recorded under ``"harmless"`` so a resume that changes them says so in one line and continues.

A run.json written before a setting was recorded (version 1: no ``packing``, ``param_dtype`` or optimizer
settings) is read with the default each of them had then, which is today's default for every one of them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError, ConfigError

from ..common.atomic_file import write_text_atomically
from ..common.run_folder import RUN_FILE
from ..settings.config import RENAMED, TrainConfig

__all__ = [
    "HARMLESS_KEY",
    "IDENTITY_VERSION",
    "RUN_FILE",
    "chat_template_fingerprint",
    "config_fingerprint",
    "data_fingerprint",
    "differences",
    "flag_text",
    "harmless_changes",
    "judge_resume",
    "read_identity",
    "run_identity",
    "setting_changes",
    "tokenizer_fingerprint",
    "write_identity",
]

IDENTITY_VERSION = 2

# Settings that change the examples, their packing and order, or the schedule (see the module docstring).
_SETTINGS = (
    "max_length",
    "seed",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "learning_rate",
    "min_lr_ratio",
    "warmup_steps",
    "schedule_steps",
    "dataset_format",
    "messages_column",
    "columns",
    "split",
    "overlong",
    "skip_bad_rows",
    "assistant_only_loss",
    "eval_fraction",
    "packing",
    "param_dtype",
    "lr_scheduler_type",
    "warmup_ratio",
    "weight_decay",
    "adam_betas",
    "max_grad_norm",
)
# Added in version 2: an older identity lacks them, and was trained with these values (their defaults then,
# unchanged since: git history of kernelguard/train/settings/config.py).
_V1_DEFAULTS: dict[str, Any] = {
    "packing": "packed",
    "param_dtype": "bf16",
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.0,
    "weight_decay": 0.0,
    "adam_betas": [0.9, 0.95],
    "max_grad_norm": 1.0,
}
# Same math computed another way (kernels, fusion, chunking): a change is accepted with one line.
_HARMLESS = ("loss", "attention", "compile", "fused_norms")
HARMLESS_KEY = "harmless"
# Bool settings whose flag has a --no- twin (default True, or negatable): see config_cli._flag_kwargs.
_NEGATABLE = frozenset({"assistant_only_loss", "compile", "fused_norms", "first_row_probe", "export"})
# Keys of a config's to_dict() that differ between equal models (bookkeeping, not architecture).
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "use_cache", "_attn_implementation", "attn_implementation",
     "_attn_implementation_autoset", "dtype", "torch_dtype", "_commit_hash"}
)  # fmt: skip
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_files(paths: Iterable[Path], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.relative_to(root) if root else path.name).encode() + b"\0")
        try:
            with path.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
        except OSError as e:
            raise ConfigError(
                f"cannot read {path}: {e.strerror or e}.", fix="check the file's permissions"
            ) from e
    return h.hexdigest()


def config_fingerprint(config: Any) -> str:
    """sha256 of the model config's architecture fields (to_dict minus bookkeeping), canonical JSON."""
    raw = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha256_bytes(json.dumps(raw, sort_keys=True, default=str).encode())


def _is_tokenizer_file(path: Path) -> bool:
    name = path.name
    if not path.is_file() or name.endswith(_WEIGHT_SUFFIXES):
        return False
    return (
        name.startswith(
            ("tokenizer", "chat_template", "special_tokens_map", "added_tokens", "vocab", "merges")
        )
        or path.suffix == ".tiktoken"
    )


def tokenizer_fingerprint(tokenizer: str) -> str:
    """sha256 over the tokenizer files of a local tokenizer folder (never its model weights)."""
    folder = Path(tokenizer)
    files = sorted(p for p in folder.iterdir() if _is_tokenizer_file(p)) if folder.is_dir() else []
    return _sha256_files(files) if files else f"unhashed:{tokenizer}"


def chat_template_fingerprint(chat_template: str | None) -> str | None:
    if chat_template is None:
        return None
    path = Path(chat_template)
    return _sha256_files([path]) if path.is_file() else f"name:{chat_template}"


def data_fingerprint(data: str, split: str) -> str:
    """sha256 over the content of the local data files; a dataset name is identified by name and split."""
    from .sources import resolve_files

    files = resolve_files(data)
    if files is None:
        return f"dataset:{data}:{split}"
    root = Path(data) if Path(data).is_dir() else None
    return _sha256_files(files, root)


def run_identity(cfg: TrainConfig, *, world_size: int, model_config: Any) -> dict[str, Any]:
    """The identity of the run ``cfg`` describes (see the module docstring)."""
    assert cfg.model.tokenizer is not None
    identity: dict[str, Any] = {
        "version": IDENTITY_VERSION,
        "model_config_sha256": config_fingerprint(model_config),
        "tokenizer_sha256": tokenizer_fingerprint(cfg.model.tokenizer),
        "chat_template_sha256": chat_template_fingerprint(cfg.model.chat_template),
        "data_sha256": data_fingerprint(cfg.data.data, cfg.data.split),
        "world_size": world_size,
    }
    flags = cfg.flags()
    for name in _SETTINGS:
        value = flags[name]
        identity[name] = list(value) if isinstance(value, tuple) else value
    identity[HARMLESS_KEY] = {name: flags[name] for name in _HARMLESS}
    return identity


def flag_text(name: str, value: Any) -> str:
    """A setting as the flag that gives it, ready to paste: ``--param-dtype bf16``, ``--no-assistant-only-loss``,
    ``--adam-betas 0.9 0.95``; ``(no --schedule-steps)`` for an unset one."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}" if name in _NEGATABLE else f"(no {flag})"
    if value is None:
        return f"(no {flag})"
    if isinstance(value, list | tuple):
        return f"{flag} {' '.join(str(v) for v in value)}"
    return f"{flag} {value}"


def harmless_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per recorded harmless setting that changed (see the module docstring); [] for an old run.json."""
    before, now = old.get(HARMLESS_KEY), new.get(HARMLESS_KEY) or {}
    if not isinstance(before, dict):
        return []
    return [
        f"trained with {flag_text(k, before[k])}, now {flag_text(k, now.get(k))}: accepted (the same math "
        "computed another way; the numbers differ by float rounding only)"
        for k in _HARMLESS if k in before and before[k] != now.get(k)
    ]


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per field whose value differs: ``name: was X, now Y``. An old run.json's setting names
    (``lr``, ``block_size``...) are read as the flag names they became (RENAMED), and a setting it lacks (an
    identity of version 1) as the default it had then."""
    old = _as_now(old, new)
    skip = ("version", HARMLESS_KEY)
    keys = [k for k in new if k not in skip] + [k for k in old if k not in new and k not in skip]
    return [f"{k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def _as_now(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` by today's setting names, a setting it lacks (version 1) as the default it had then."""
    renamed = {RENAMED.get(k, k): v for k, v in old.items()}
    return {**{k: v for k, v in _V1_DEFAULTS.items() if k in new}, **renamed}


def setting_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(setting, value then, value now) for each recorded setting that differs."""
    old = _as_now(old, new)
    return [(k, old.get(k), new.get(k)) for k in _SETTINGS if k in new and old.get(k) != new.get(k)]


def judge_resume(
    identity: dict[str, Any], *, saved: dict[str, Any] | None, checkpoint: Path | None, output: Path, anyway: bool
) -> tuple[list[str], list[str]]:
    """``--resume`` judged in one place: this run's identity against the one saved with ``checkpoint`` (else the
    folder's run.json). Refused when a setting of the run's identity changed (unless ``anyway``) or across
    fp32 (never); returns (warnings, notices): what --resume-anyway continues across, and the harmless changes."""
    reference, source = saved, checkpoint
    if reference is None or source is None:
        source = output / RUN_FILE
        reference = read_identity(source) if source.is_file() else None
    if reference is None:
        return [], []
    _refuse_dtype_across_fp32(reference, identity, source)
    diffs = differences(reference, identity)
    if diffs and not anyway:
        _refuse_different_run(reference, identity, source, diffs)
    return ([f"--resume-anyway: {source} differs: {d}" for d in diffs],
            [f"--resume: {source} was {line}" for line in harmless_changes(reference, identity)])


def _refuse_different_run(
    reference: dict[str, Any], identity: dict[str, Any], source: Path, diffs: list[str]
) -> None:
    """One line naming the flag when a single setting changed; else the list of what differs."""
    changes = setting_changes(reference, identity)
    if len(diffs) == 1 and len(changes) == 1:  # the common case: one flag changed, said as that flag
        name, was, now = changes[0]
        raise CheckpointError(
            f"--resume: {source} was trained with {flag_text(name, was)}; now {flag_text(name, now)}.",
            fix=f"resume with {flag_text(name, was)} (the checkpoint is intact); or --resume-anyway to continue "
            "from it anyway (not an exact continuation); or --overwrite / another --output-dir to start again",
        )
    raise CheckpointError(
        f"--resume: {source} belongs to a different run; what differs:\n  " + "\n  ".join(diffs),
        fix="resume with the original inputs and settings; or --resume-anyway to continue from it "
        "anyway (not an exact continuation); or --overwrite / another --output-dir to start again",
    )


def _refuse_dtype_across_fp32(reference: dict[str, Any], identity: dict[str, Any], source: Path) -> None:
    """bf16/fp16 keep the GDN's fp32 parameters in an optimizer group of their own (model.build.make_optimizer),
    fp32 does not: a checkpoint's optimizer state cannot be loaded across that, even with --resume-anyway."""
    was = next((w for n, w, _ in setting_changes(reference, identity) if n == "param_dtype"), None)
    now = identity.get("param_dtype")
    if was is None or (was == "fp32") == (now == "fp32"):
        return
    raise CheckpointError(
        f"--resume: {source} was trained with --param-dtype {was}; now --param-dtype {now}: its optimizer state "
        "has other parameter groups (only a 16-bit dtype keeps the fp32 GDN parameters apart), so not even "
        "--resume-anyway can continue across this change.",
        fix=f"resume with --param-dtype {was} (the checkpoint is intact: keep it); or start the --param-dtype "
        f"{now} run in another --output-dir",
    )


def read_identity(file: Path) -> dict[str, Any]:
    try:
        identity = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(
            f"{file} cannot be read ({e}).", fix="restore it, or start again with --overwrite"
        ) from e
    if not isinstance(identity, dict):
        raise CheckpointError(f"{file} is not a run identity.", fix="start again with --overwrite")
    return identity


def write_identity(output: Path, identity: dict[str, Any]) -> Path:
    return write_text_atomically(output / RUN_FILE, json.dumps(identity, indent=1, sort_keys=True) + "\n")
