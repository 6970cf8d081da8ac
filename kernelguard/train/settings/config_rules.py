"""The one table of rules a `kernelguard train` setting is checked against, and the value spellings its
flags accept, and ``validate``: what each section of kernelguard.train.settings.config runs in ``__post_init__`` (its
fields against their annotations, then each row of RULES whose settings it holds). The argparse parser takes
its ``choices`` from here too."""

from __future__ import annotations

import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import extra_command

from .packing_modes import PACKING_MODES

__all__ = [
    "ATTENTION_CHOICES",
    "AUTO_SWITCHES",
    "CHECKPOINTING_VALUES",
    "COLUMN_ROLES",
    "DATASET_FORMATS",
    "DEFAULT_MAX_SHARD_SIZE",
    "INIT_CHOICES",
    "LOG_LEVELS",
    "LOSS_CHOICES",
    "LR_SCHEDULER_TYPES",
    "OVERLONG_POLICIES",
    "PACKING_MODES",
    "PARAM_DTYPES",
    "REPORT_TO_CHOICES",
    "RULES",
    "TRACKERS",
    "Rule",
    "blocks_per_forward_value",
    "check_blocks_per_forward",
    "check_trackers",
    "checkpointing_value",
    "choices_of",
    "field_kinds",
    "normalize_report_to",
    "parse_columns",
    "parse_size",
    "validate",
]

PARAM_DTYPES = ("bf16", "fp32", "fp16")
OVERLONG_POLICIES = ("truncate", "drop")
ATTENTION_CHOICES = ("auto", "varlen", "sdpa", "flash_attention_2", "eager")
LOSS_CHOICES = ("chunked", "logits")  # kernelguard.train.step.loss.linear_cross_entropy / the full logits
# Hugging Face's names; kernelguard.train.step.step.lr_lambda implements each.
LR_SCHEDULER_TYPES = ("cosine", "linear", "constant", "constant_with_warmup")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # logging's, for --log-level
DATASET_FORMATS = ("auto", "messages", "prompt-completion", "text", "sharegpt")
# --columns ROLE=COLUMN,...: the roles a row's columns can be mapped to (kernelguard.train.inputs.rows).
COLUMN_ROLES = ("system", "user", "assistant")
_COLUMNS_EXAMPLE = "user=question,assistant=answer"
INIT_CHOICES = ("pretrained", "random")  # where a run's weights come from (kernelguard.train.startup.preflight)
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb", "trackio")
# --activation-checkpointing / --compile / --reshard-after-forward VALUE -> the RuntimeSection field (None: auto)
AUTO_SWITCHES = ("activation_checkpointing", "compile", "reshard_after_forward")
CHECKPOINTING_VALUES: dict[str, bool | None] = {
    "auto": None,
    "on": True,
    "true": True,
    "yes": True,
    "off": False,
    "false": False,
    "no": False,
}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # as save_pretrained's default
# --max-shard-size units, Hugging Face's spelling (GB = 10^9, GiB = 2^30); no unit: bytes
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
              "GIB": 2**30}


@dataclass(frozen=True, slots=True)
class Rule:
    """``ok(*values of names)`` must hold; else ConfigError(says, fix). ``says`` is formatted with ``name`` and
    ``value`` (the first setting's) and every setting by its own name. A one-setting rule skips None (unset)."""

    names: tuple[str, ...]
    ok: Callable[..., bool]
    says: str
    fix: str
    choices: tuple[str, ...] | None = None


def _must(name: str, ok: Callable[[Any], bool], what: str, fix: str) -> Rule:
    return Rule((name,), ok, "{name} is {value!r}; it must be " + what + ".", fix)


def _positive(name: str, fix: str) -> Rule:
    return _must(name, lambda v: v > 0, "a positive integer", fix)


def _one_of(name: str, choices: tuple[str, ...], fix: str) -> Rule:
    return Rule(
        (name,),
        lambda v: v in choices,
        "{name} is {value!r}; expected one of " + ", ".join(choices) + ".",
        fix,
        choices,
    )


def parse_columns(spec: str) -> dict[str, tuple[str, ...]]:
    """``user=instruction+input,assistant=output`` -> ``{"user": ("instruction", "input"), "assistant":
    ("output",)}``: which columns make each role's message (several joined by a blank line)."""
    out: dict[str, tuple[str, ...]] = {}
    for pair in (p.strip() for p in str(spec).split(",") if p.strip()):
        role, sep, names = pair.partition("=")
        columns = tuple(c.strip() for c in names.split("+"))
        if not sep or role.strip() not in COLUMN_ROLES or role.strip() in out or not all(columns):
            raise ConfigError(f"--columns {spec}: {pair!r} is not ROLE=COLUMN.", fix="--columns " + _COLUMNS_EXAMPLE)
        out[role.strip()] = columns
    if not {"user", "assistant"} <= set(out):
        raise ConfigError(f"--columns {spec}: a user and an assistant column are needed.",
                          fix="--columns " + _COLUMNS_EXAMPLE)
    return out


def _parses(parse: Callable[[Any], Any], value: Any) -> bool:
    try:
        parse(value)
    except ConfigError:
        return False
    return True


def _is_size(value: Any) -> bool:
    try:
        parse_size(value)
    except ConfigError:
        return False
    return True


def _not_empty(name: str, flag: str) -> Rule:
    """An empty path ("" or spaces: what an unset shell variable gives) would mean the current folder."""
    return Rule(
        (name,),
        lambda v: bool(str(v).strip()),
        "{name} is empty; it must name a path (an unset shell variable gives an empty argument).",
        f"pass {flag} with a path",
    )


RULES: tuple[Rule, ...] = (
    _not_empty("model", "--model"),
    _not_empty("tokenizer", "--tokenizer"),
    _not_empty("chat_template", "--chat-template"),
    _not_empty("data", "--data"),
    _not_empty("eval_data", "--eval-data"),
    _not_empty("output_dir", "--output-dir"),
    _not_empty("profile_trace", "--profile-trace"),
    _not_empty("lock", "--lock"),
    _one_of("init", INIT_CHOICES, "--init pretrained (a model folder's weights) or --init random"),
    _one_of("dataset_format", DATASET_FORMATS, "--dataset-format auto"),
    Rule(("columns",), lambda v: _parses(parse_columns, v),
         "{name} is {value!r}; expected ROLE=COLUMN pairs joined by commas, a user and an assistant column at "
         "least (roles: " + ", ".join(COLUMN_ROLES) + "; several columns of one role joined by +, e.g. "
         "user=instruction+input).", "--columns " + _COLUMNS_EXAMPLE),
    Rule(("dataset_format", "columns"), lambda fmt, columns: columns is None or fmt == "auto",
         "columns ({columns}) maps the rows to a conversation, so dataset_format {dataset_format} cannot apply.",
         "drop --dataset-format, or drop --columns"),
    _must("eval_fraction", lambda v: 0.0 <= v < 1.0, "in [0, 1)", "--eval-fraction 0.05"),
    _must("eval_every", lambda v: v >= 0, ">= 0 (0: evaluate at the end only)", "--eval-every 100"),
    Rule(
        ("eval_data", "eval_fraction"),
        lambda data, fraction: not (fraction > 0 and data is not None),
        "eval_data ({eval_data}) and eval_fraction ({eval_fraction}) were both given; "
        "the eval set comes from one of them.",
        "pass either --eval-data PATH or --eval-fraction F, not both",
    ),
    _positive("max_length", "--max-length 8192"),
    _one_of("overlong", OVERLONG_POLICIES, "--overlong truncate"),
    _one_of("packing", PACKING_MODES, "--packing packed"),
    _positive("max_steps", "--max-steps 100, or leave it out to train for --num-train-epochs"),
    _positive("schedule_steps", "leave --schedule-steps out to use the epoch length"),
    _positive("num_train_epochs", "--num-train-epochs 1"),
    _positive("gradient_accumulation_steps", "--gradient-accumulation-steps 2"),
    _positive("blocks_per_forward", "--blocks-per-forward auto"),
    _must("seed", lambda v: 0 <= v < 2**32, "in [0, 2**32)", "--seed 0"),
    _must("learning_rate", lambda v: v > 0, "> 0", "--learning-rate 1e-5"),
    _must("min_lr_ratio", lambda v: 0.0 <= v <= 1.0, "in [0, 1]", "--min-lr-ratio 0.1"),
    _must("warmup_steps", lambda v: v >= 0, ">= 0", "--warmup-steps 0"),
    _must("warmup_ratio", lambda v: 0.0 <= v < 1.0, "in [0, 1)", "--warmup-ratio 0.03"),
    Rule(
        ("warmup_steps", "warmup_ratio"),
        lambda steps, ratio: not (steps and ratio),
        "warmup_steps ({warmup_steps}) and warmup_ratio ({warmup_ratio}) were both given; the warmup's "
        "length comes from one of them.",
        "pass either --warmup-steps N or --warmup-ratio F, not both",
    ),
    _one_of("lr_scheduler_type", LR_SCHEDULER_TYPES, "--lr-scheduler-type cosine"),
    Rule(
        ("lr_scheduler_type", "warmup_steps", "warmup_ratio"),
        lambda kind, steps, ratio: kind != "constant" or not (steps or ratio),
        "lr_scheduler_type is 'constant', which has no warmup, but a warmup was given (warmup_steps "
        "{warmup_steps}, warmup_ratio {warmup_ratio}).",
        "--lr-scheduler-type constant_with_warmup, or drop the warmup",
    ),
    _must("weight_decay", lambda v: v >= 0, ">= 0", "--weight-decay 0.1"),
    Rule(
        ("adam_betas",),
        lambda v: all(0.0 <= b < 1.0 for b in v),
        "adam_betas are {value!r}; each must be in [0, 1).",
        "--adam-betas 0.9 0.95",
    ),
    _must("max_grad_norm", lambda v: v >= 0, ">= 0 (0 disables)", "--max-grad-norm 1.0"),
    _one_of("param_dtype", PARAM_DTYPES, "--param-dtype bf16 (GPU) or --param-dtype fp32 (CPU tests)"),
    _one_of("attention", ATTENTION_CHOICES, "--attention auto"),
    _one_of("loss", LOSS_CHOICES, "--loss chunked"),
    _must("peak_tflops", lambda v: v > 0, "> 0", "--peak-tflops 989"),
    _must("save_steps", lambda v: v >= 0, ">= 0", "--save-steps 0"),
    Rule(
        ("max_shard_size",),
        _is_size,
        "{name} is {value!r}; expected a size such as 5GB, 500MB or 2GiB.",
        "--max-shard-size 5GB",
    ),
    _must("profile_step", lambda v: v is None or v >= 0, ">= 0 (0: never profile)", "--profile-step 10"),
    _must("profile_every", lambda v: v >= 0, ">= 0 (0: profile once)", "--profile-every 500"),
    Rule(
        ("profile_trace", "profile_step"),
        lambda trace, step: trace is None or step != 0,
        "profile_trace ({profile_trace}) was given with profile_step 0; the trace is of the profiled step.",
        "pass --profile-step N (or leave it out: step 10 on a GPU) with --profile-trace DIR",
    ),
    _must("logging_steps", lambda v: v >= 0, ">= 0 (0: no log line per step)", "--logging-steps 10"),
    _one_of("log_level", LOG_LEVELS, "--log-level info"),
    _positive("save_total_limit", "--save-total-limit 2, or leave it out to keep all"),
    Rule(
        ("resume_anyway", "resume"),
        lambda anyway, resume: resume or not anyway,
        "resume_anyway was given without resume; it only overrides --resume's identity check.",
        "add --resume, or drop --resume-anyway",
    ),
    Rule(
        ("overwrite", "resume"),
        lambda overwrite, resume: not (overwrite and resume),
        "overwrite and resume were both given: --overwrite discards the run that --resume continues.",
        "pass either --resume or --overwrite",
    ),
)


def choices_of(name: str) -> tuple[str, ...] | None:
    """The values RULES allows for ``name``, when it is a choice (for argparse's ``choices``)."""
    return next((r.choices for r in RULES if r.names == (name,) and r.choices), None)


def normalize_report_to(value: object) -> tuple[str, ...]:
    """``"tensorboard,wandb"``, ``["tensorboard", "wandb"]`` or ``("none",)`` -> a tuple of known names;
    ``none`` alone means no tracker (empty tuple)."""
    items: list[str] = []
    raw = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    for entry in raw:
        if not isinstance(entry, str):
            raise ConfigError(
                f"report_to has {entry!r}; expected names from {', '.join(REPORT_TO_CHOICES)}.",
                fix="--report-to tensorboard",
            )
        items.extend(part.strip() for part in entry.split(",") if part.strip())
    for name in items:
        if name not in REPORT_TO_CHOICES:
            raise ConfigError(
                f"report_to has {name!r}; expected one of {', '.join(REPORT_TO_CHOICES)} (several: "
                "--report-to tensorboard,wandb).",
                fix="--report-to tensorboard",
            )
    if "none" in items and len(set(items)) > 1:
        raise ConfigError(
            f"report_to is {','.join(items)}: 'none' cannot be combined with a tracker; list only trackers, or "
            "none alone.",
            fix="--report-to none",
        )
    return tuple(dict.fromkeys(n for n in items if n != "none"))


def parse_size(text: str | int, *, source: str = "max_shard_size") -> int:
    """Bytes of ``5GB``, ``500MB``, ``2GiB`` or a plain number (kernelguard.train.output.export's shard limit)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS or float(match.group(1)) * _SIZE_UNITS[unit] < 1:
        raise ConfigError(
            f"{source} is {text!r}; expected a size such as 5GB, 500MB or 2GiB.", fix=f"{source} 5GB"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def checkpointing_value(value: str, *, source: str, flag: str = "--activation-checkpointing") -> bool | None:
    """An auto switch's value (``flag``, one of AUTO_SWITCHES): ``auto`` -> None, ``on``/``true``/``yes`` ->
    True, ``off``/``false``/``no`` -> False."""
    key = value.strip().lower()
    if key not in CHECKPOINTING_VALUES:
        raise ConfigError(
            f"{source} is {value!r}; expected auto (the default), on or off.",
            fix=f"{flag} auto",
        )
    return CHECKPOINTING_VALUES[key]


def check_blocks_per_forward(blocks: int | None, accum: int) -> None:
    """Every forward of a step takes the same number of its blocks: N must divide the blocks per step."""
    if blocks is not None and accum % blocks:
        nearest = max(d for d in range(1, min(blocks, accum) + 1) if accum % d == 0)
        raise ConfigError(
            f"--blocks-per-forward {blocks} does not divide --gradient-accumulation-steps {accum}: each "
            "forward takes the same number of a step's blocks.",
            fix=f"--blocks-per-forward {nearest}, or --blocks-per-forward auto",
        )


def blocks_per_forward_value(value: Any, *, source: str) -> int | None:
    """``--blocks-per-forward``: ``auto`` (None) or a positive number of blocks."""
    if value is None or (_is_int(value) and value > 0):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(
        f"{source} is {value!r}; expected auto (the default) or a positive number of blocks.",
        fix="--blocks-per-forward auto",
    )


# ------------------------------------------------------------------------------------------- checking ---
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_strings(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))


def _is_pair(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v)


def _is_pathlike(v: Any) -> bool:
    return isinstance(v, (str, os.PathLike))


# annotation (without "| None") -> (what to say, check, normalise)
_KINDS: dict[Any, tuple[str, Callable[[Any], bool], Callable[[Any], Any]]] = {
    int: ("an integer", _is_int, int),
    float: ("a number", _is_number, float),
    bool: ("true or false", lambda v: isinstance(v, bool), bool),
    str: ("a string", _is_pathlike, os.fspath),
    Path: ("a path", _is_pathlike, lambda v: Path(v) if str(v).strip() else v),  # "" stays "": empty
    tuple[str, ...]: (
        "a string or a list of strings",
        _is_strings,
        lambda v: (v,) if isinstance(v, str) else tuple(v),
    ),
    tuple[float, float]: ("two numbers", _is_pair, lambda v: tuple(float(x) for x in v)),
}
# Values a field may be given besides its type, turned into it first (the spellings its flag accepts).
_SPELLINGS: dict[str, Callable[[Any], Any]] = {
    "activation_checkpointing": lambda v: (
        checkpointing_value(v, source="activation_checkpointing") if isinstance(v, str) else v
    ),
    "compile": lambda v: checkpointing_value(v, source="compile", flag="--compile") if isinstance(v, str) else v,
    "reshard_after_forward": lambda v: checkpointing_value(v, source="reshard_after_forward",
                                                           flag="--reshard-after-forward") if isinstance(v, str) else v,
    "blocks_per_forward": lambda v: blocks_per_forward_value(v, source="blocks_per_forward")
    if isinstance(v, str) else v,
    "max_shard_size": lambda v: str(v) if _is_int(v) else v,  # a byte count, as from_pretrained takes it
}


@cache
def field_kinds(cls: type) -> dict[str, tuple[Any, bool]]:
    """Field name -> (its type without None, whether None is allowed)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args and typing.get_origin(hint) is not tuple
        base = next(a for a in args if a is not type(None)) if optional else hint
        out[name] = (base, optional)
    return out


def _typed(name: str, value: Any, base: Any) -> Any:
    expected, ok, normalise = _KINDS[base]
    if not ok(value):
        raise ConfigError(
            f"{name} is {value!r} ({type(value).__name__}); expected {expected}.",
            fix=f"give {name} {expected}",
        )
    value = normalise(value)
    numbers = value if isinstance(value, tuple) else (value,)
    if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
        raise ConfigError(
            f"{name} is {value!r}; it must be a finite number.", fix=f"give {name} a real value"
        )
    return value


def _check_rule(rule: Rule, section: Any) -> None:
    values = [getattr(section, n) for n in rule.names]
    if len(values) == 1 and values[0] is None:  # an optional setting left unset
        return
    if not rule.ok(*values):
        named = dict(zip(rule.names, values))
        raise ConfigError(rule.says.format(name=rule.names[0], value=values[0], **named), fix=rule.fix)


def validate(section: Any) -> None:
    """Types (with each flag's spellings and old API forms normalised), then the section's rows of RULES."""
    names = set()
    for f in fields(section):
        names.add(f.name)
        value = _SPELLINGS.get(f.name, lambda v: v)(getattr(section, f.name))
        base, optional = field_kinds(type(section))[f.name]
        if not (value is None and optional):
            value = _typed(f.name, value, base)
        object.__setattr__(section, f.name, value)
    for rule in RULES:
        if set(rule.names) <= names:
            _check_rule(rule, section)


# ------------------------------------------------------------------------------------------- trackers ---
# --report-to name -> (module to import, pip package, extra of kernelguard that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
}


def check_trackers(names: Sequence[str]) -> None:
    """Refuse at config time (not mid-run) when a --report-to library is not installed."""
    import importlib.util

    for name in names:
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"--report-to {name}: the {package} package is not installed (or leave --report-to {name} out).",
                fix=extra_command(name),
            )
