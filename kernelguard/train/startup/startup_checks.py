"""Checks that need nothing but the settings, the environment and the file system, run before any rank starts
(the launcher) and again in preflight: every folder a run writes into, the ``KERNELGUARD_*`` variables that
take a number or a word, a layer count no model has. Each is one usage error (ConfigError, exit 2)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

from kernelguard.errors import CheckpointError, ConfigError

from ..common.run_folder import RUN_ARTIFACTS
from ..inputs.tokenizer import check_tokenizer_folder

__all__ = [
    "ENVIRONMENT",
    "MAX_LAYERS",
    "RUN_ARTIFACTS",
    "check_environment",
    "check_flags",
    "check_inputs",
    "check_model_family",
    "check_model_size",
    "check_paths",
    "check_profile_window",
    "check_writable_folder",
    "no_tokenizer_error",
    "refuse_existing_run",
    "run_artifacts",
]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # an unreadable parent: treat as absent and look further up
        return False


def check_writable_folder(path: Path, *, flag: str) -> Path:
    """``path`` (a folder to be created or written into) can be: its nearest existing ancestor is a folder
    this user may write, on a writable file system. Returns that ancestor."""
    existing = path
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path}: {existing} is a file, not a folder; {flag} names a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            raise ConfigError(f"{flag} {path}: {existing} is on a read-only file system; {flag} must be on a "
                              "writable disk.")
        raise ConfigError(
            f"{flag} {path}: {existing} is not writable by this user (uid {os.getuid()}, owner uid "
            f"{existing.stat().st_uid}); pick a folder this user may write.",
        )
    return existing


def run_artifacts(output: Path) -> list[str]:
    """Names of a previous run's artifacts in ``output``."""
    return [name for name in RUN_ARTIFACTS if _exists(output / name)] if output.is_dir() else []


def refuse_existing_run(cfg: Any) -> None:
    """A new run (no --resume, no --overwrite) never lands on top of another."""
    found = run_artifacts(cfg.checkpoint.output_dir)
    if found and not cfg.checkpoint.overwrite:
        from ..common.command_line import resume_command

        raise CheckpointError(
            f"--output-dir {cfg.checkpoint.output_dir} already holds a run ({', '.join(found)}). The command "
            "below continues it; --overwrite instead deletes it and starts again; another --output-dir keeps it.",
            fix=resume_command(),
        )


def check_paths(cfg: Any) -> None:
    """Every folder the run will write into, checked before anything is written or any rank starts (a
    ``--profile-trace`` under a plain file would otherwise fail at the profiled step, mid-run), and a new
    run's folder holds no other run (checked here, before torch loads: a second, not seconds)."""
    check_writable_folder(cfg.checkpoint.output_dir, flag="--output-dir")
    if not cfg.checkpoint.resume:
        refuse_existing_run(cfg)
    if cfg.metrics.profile_trace is not None:
        check_writable_folder(Path(cfg.metrics.profile_trace), flag="--profile-trace")


# Far above any released model (the largest have ~100-200 layers); each layer takes ~10 ms to build even on the
# meta device, so a config with tens of thousands (a typo, a generated file) would spend minutes building.
MAX_LAYERS = 1024


def check_model_size(config: Any, *, model: str) -> None:
    """Refuse a layer count no model has (num_hidden_layers above :data:`MAX_LAYERS`) before building it."""
    from kernelguard.resolution import text_config

    layers = getattr(text_config(config), "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise ConfigError(
            f"--model {model}: num_hidden_layers is {layers:,}; kernelguard train builds at most {MAX_LAYERS:,} "
            "(no released model comes close; building this many would take minutes before anything is said): "
            "check num_hidden_layers in the config (and layer_types, which lists one type per layer).",
        )


def check_model_family(config: Any, *, model: str, packing: str) -> None:
    """Refuse, before anything is built, to pack a family whose layers cannot keep packed examples apart
    (:func:`kernelguard.resolution.packing_support`); ``--packing none`` trains it on padded batches."""
    from kernelguard.resolution import discovery, family_of_model_type, model_type, packing_support

    from ..settings.packing_modes import PACKED

    family = family_of_model_type(model_type(config))
    if packing != PACKED or family is None:  # no fast kernels: attention only, whose varlen path the guard checks
        return
    support = packing_support(discovery.families()[family])
    if not support.packs:
        raise ConfigError(
            f"--model {model}: kernelguard train packs examples into one row, and {family} cannot be packed: "
            f"{support.packed_problem}. Padded batches (--packing none) have nothing to keep apart; the families it "
            "packs are listed in docs/families.md.",
            fix="--packing none",
        )


# Environment variables kernelguard train reads, and what each must hold (one usage error lists every bad one).
def _seconds(raw: str) -> bool:
    try:
        return float(raw) >= 0 and float(raw) != float("inf")
    except ValueError:
        return False


ENVIRONMENT = {
    "KERNELGUARD_ERROR_WAIT_S": (_seconds, "a number of seconds >= 0, e.g. 10"),
    "KERNELGUARD_IMPORT_PROBE": (lambda raw: raw.strip().lower() in ("fork", "spawn", "off"), "fork, spawn or off"),
}


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Every KERNELGUARD_* variable that takes a number or a word holds one it can use."""
    environ = dict(os.environ if environ is None else environ)
    bad = [f"{name}={environ[name]!r}: expected {expected}" for name, (ok, expected) in ENVIRONMENT.items()
           if environ.get(name, "").strip() and not ok(environ[name])]
    if bad:
        raise ConfigError(
            "environment variable(s) kernelguard reads hold values it cannot use (set each as expected below, "
            "or unset it: its default is fine):\n  " + "\n  ".join(bad),
            fix="unset " + " ".join(b.split("=")[0] for b in bad),
        )


def no_tokenizer_error(cfg: Any, tokenizer: Path) -> ConfigError:
    """The refusal for a --tokenizer (or tokenizer-less --model) that is no local folder; nothing is downloaded."""
    from kernelguard.resolution import dangling_link

    broken = dangling_link(tokenizer)
    what = "is a file" if tokenizer.is_file() else (f"is a symbolic link to {broken.split(' to ', 1)[1]}"
                                                     if broken else "does not exist")
    hub_id = not tokenizer.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(tokenizer)) is not None
    download = f"hf download {tokenizer} --local-dir {shlex.quote(tokenizer.name)}" if hub_id else None
    flag = "--tokenizer" if str(cfg.model.tokenizer) != str(cfg.model.model) else "--model"
    if what == "does not exist" and (near := _nearest_folder(str(tokenizer), flag)) is not None:
        kind = "tokenizer" if flag == "--tokenizer" else "model"
        return ConfigError(f"{flag} {tokenizer} does not exist; did you mean {near.details['replace'][1]}? (a local "
                           f"{kind} folder; nothing is downloaded)", fix=near.fix, details=near.details)
    if str(cfg.model.tokenizer) != str(cfg.model.model):
        return ConfigError(f"--tokenizer {tokenizer} {what}; expected a local tokenizer folder (nothing is "
                           "downloaded).", fix=download or "pass --tokenizer DIR, a local tokenizer folder")
    if Path(str(cfg.model.model)).suffix == ".json":
        return ConfigError(f"--model {cfg.model.model} is a config.json, which holds no tokenizer: pass "
                           "--tokenizer DIR, a local tokenizer folder.",
                           fix="pass --tokenizer DIR, a local tokenizer folder")
    return ConfigError(
        f"--model {cfg.model.model} {what}; expected a local model folder (its tokenizer is read from it unless "
        "--tokenizer DIR is given) or a config.json. Nothing is downloaded.",
        fix=download or "pass --model DIR (a local model folder) or its config.json",
    )


def _nearest_folder(path: str, flag: str) -> ConfigError | None:
    """The existing name in ``path``'s folder nearest to it, as :func:`missing_path_error` finds one for --data
    (its ``details["replace"]``: the command line puts it in place); None when nothing is near."""
    from ..inputs.sources import missing_path_error

    found = missing_path_error(path, flag=flag)
    return found if found.details.get("replace") else None


def check_flags(cfg: Any) -> None:
    """Flags that need something the settings alone do not say: Liger for --fused-norms, an eval set for
    --eval-every; --allow items that exist (a typo is refused here, with the nearest name, not after torch is
    imported). (A profiled step within --max-steps: check_profile_window, after check_paths.)"""
    from kernelguard.resolution import AllowPolicy

    AllowPolicy.parse(cfg.runtime.allow, source="--allow")
    if cfg.runtime.fused_norms:
        from ..model.fused_norms import LIGER_FIX, liger_missing

        if (why := liger_missing()) is not None:
            raise ConfigError(why, fix=LIGER_FIX)
    if cfg.evaluation.eval_every and not (cfg.evaluation.eval_data or cfg.evaluation.eval_fraction):
        raise ConfigError(
            f"--eval-every {cfg.evaluation.eval_every} needs an eval set.",
            fix="add --eval-data FILE or --eval-fraction 0.05, or drop --eval-every",
        )


def check_profile_window(cfg: Any) -> None:
    """A profiled step (--profile-step, or the default step 10 that --profile-trace asks for) after
    --max-steps would never run: refused, rather than a run that ends without its profile or trace."""
    from ..output.profiling import first_profiled_step

    first, last = first_profiled_step(cfg, gpu=False), cfg.training.max_steps
    asked = cfg.metrics.profile_step is not None or cfg.metrics.profile_trace is not None
    if not asked or not first or last is None or first <= last:
        return
    given = f"--profile-step {first}" if cfg.metrics.profile_step else (
        f"--profile-trace {cfg.metrics.profile_trace} (its first profiled step is {first}, the default)"
    )
    raise ConfigError(
        f"{given} is after the run's last step (--max-steps {last}): no step would be profiled.",
        fix=f"--profile-step {last} (or any step up to {last}), or leave the profiling flags out",
    )


def check_inputs(cfg: Any) -> None:
    """The tokenizer folder holds tokenizer files, --chat-template is a readable file or a shipped name, the
    training and eval data exist (no downloads are made)."""
    from .. import chat_templates
    from ..inputs.sources import hub_offline_error, resolve_files

    tokenizer = Path(str(cfg.model.tokenizer))
    if not tokenizer.is_dir():
        raise no_tokenizer_error(cfg, tokenizer)
    check_tokenizer_folder(tokenizer)
    template = cfg.model.chat_template
    if template and (template.endswith(".jinja") or os.sep in template) and not Path(template).is_file():
        raise ConfigError(f"chat template file {template} does not exist.", fix="check --chat-template")
    if template:
        chat_templates.choose(None, template)  # an unknown name is refused here, before the tokenizer loads
    train_files = resolve_files(cfg.data.data, split=cfg.data.split)  # None for a dataset name
    if train_files is None and (offline := hub_offline_error(cfg.data.data)) is not None:
        raise offline
    if cfg.evaluation.eval_data:
        try:
            eval_files = resolve_files(cfg.evaluation.eval_data, split=None, flag="--eval-data")
        except ConfigError as e:
            if e.details.get("flag") == "--eval-data" or e.message.startswith("--eval-data "):
                raise
            raise ConfigError(f"--eval-data: {e.message}", fix="check --eval-data") from e
        if eval_files is None and (offline := hub_offline_error(cfg.evaluation.eval_data, flag="--eval-data")):
            raise offline
        same = {p.resolve() for p in train_files or ()} & {p.resolve() for p in eval_files or ()}
        if same or cfg.evaluation.eval_data == cfg.data.data:
            raise ConfigError(
                f"--eval-data {cfg.evaluation.eval_data} is training data too ({', '.join(sorted(map(str, same)))[:200] or cfg.data.data}): "
                "its eval loss would measure memorisation, not generalisation.",
                fix="pass held-out rows as --eval-data, or --eval-fraction 0.05 to hold some out of --data",
            )


