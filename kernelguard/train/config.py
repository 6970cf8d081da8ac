"""TrainConfig: every knob of `kernelguard train`, validated once, with the fix in every error."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError

from .config_file import file_defaults, load_config_file

PARAM_DTYPES = ("bf16", "fp32", "fp16")
OVERLONG_POLICIES = ("truncate", "drop")
ATTENTION_CHOICES = ("auto", "varlen", "sdpa", "flash_attention_2", "eager")
LOSS_CHOICES = ("chunked", "logits")  # kernelguard.train.loss.linear_cross_entropy / the full logits
DATASET_FORMATS = ("auto", "messages", "prompt-completion", "text")
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb", "trackio")
# --activation-checkpointing VALUE -> TrainConfig.activation_checkpointing (None: auto, decided per run from
# kernelguard.train.memory's estimate by kernelguard.train.build.resolve_activation_checkpointing)
CHECKPOINTING_VALUES: dict[str, bool | None] = {
    "auto": None,
    "on": True,
    "true": True,
    "yes": True,
    "off": False,
    "false": False,
    "no": False,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_strings(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))


# TrainConfig annotation (without "| None") -> (what to say, check)
_FIELD_TYPES: dict[str, tuple[str, Any]] = {
    "int": ("an integer", _is_int),
    "float": ("a number", _is_number),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, (str, os.PathLike))),
    "Path": ("a path", lambda v: isinstance(v, (str, os.PathLike))),
    "tuple[str, ...]": ("a string or a list of strings", _is_strings),
    "tuple[float, float]": (
        "two numbers",
        lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v),
    ),
}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str
    data: str
    output: Path
    tokenizer: str | None = None
    block_size: int = 8192
    max_steps: int | None = None
    schedule_steps: int | None = None
    epochs: int = 1
    grad_accum: int = 1
    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    resume: bool = False
    allow: tuple[str, ...] = ()
    messages_column: str = "messages"
    split: str = "train"
    overlong: str = "truncate"
    skip_bad_rows: bool = False
    assistant_only_loss: bool = True
    param_dtype: str = "bf16"
    attention: str = "auto"
    activation_checkpointing: bool | None = None  # None: auto (off when the run fits the GPU without it)
    # Regional torch.compile of each decoder layer (kernelguard.train.compile). Off by default until measured
    # beyond one model on one H200: compile pauses and recompiles on new shapes are a cost every run would pay.
    compile: bool = False
    loss: str = "chunked"
    reshard_after_forward: bool = True
    save_every: int = 0
    peak_tflops: float | None = None
    export: bool = True
    max_shard_size: str = "5GB"  # largest safetensors file of the export (kernelguard.train.export)
    plot: bool = True
    progress: bool = True
    chat_template: str | None = None
    dataset_format: str = "auto"
    eval_data: str | None = None
    eval_fraction: float = 0.0
    eval_every: int = 0
    save_total_limit: int | None = None
    report_to: tuple[str, ...] = ()
    overwrite: bool = False
    resume_anyway: bool = False
    dry_run: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, str):  # "auto", "on", "off" from an API caller
            self.activation_checkpointing = checkpointing_value(
                self.activation_checkpointing, source="activation_checkpointing"
            )
        self._check_types()
        self._check_ranges()
        self.output = Path(self.output)
        self.allow = (self.allow,) if isinstance(self.allow, str) else tuple(self.allow)
        self.report_to = normalize_report_to(self.report_to)
        from .export import parse_size

        parse_size(self.max_shard_size, source="--max-shard-size")  # refused now, not after training
        self._validate_new_fields()
        # A missing tracker library is refused now, not after the model build.
        from .metrics import check_trackers

        check_trackers(self.report_to)
        if self.tokenizer is None:
            self.tokenizer = self.model
        _positive("block_size", self.block_size, "--max-length 8192")
        _positive("epochs", self.epochs, "--num-train-epochs 1")
        _positive("grad_accum", self.grad_accum, "--gradient-accumulation-steps 1")
        if self.max_steps is not None:
            _positive(
                "max_steps",
                self.max_steps,
                "--max-steps 100, or leave it out to train for --num-train-epochs",
            )
        if self.schedule_steps is not None:
            _positive(
                "schedule_steps", self.schedule_steps, "leave --schedule-steps out to use the epoch length"
            )
        if self.warmup_steps < 0:
            raise ConfigError(
                f"warmup_steps is {self.warmup_steps}; it must be >= 0.", fix="--warmup-steps 0"
            )
        if self.save_every < 0:
            raise ConfigError(f"save_every is {self.save_every}; it must be >= 0.", fix="--save-steps 0")
        if not self.lr > 0:
            raise ConfigError(f"lr is {self.lr}; it must be > 0.", fix="--learning-rate 1e-5")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"min_lr_ratio is {self.min_lr_ratio}; it must be in [0, 1].", fix="--min-lr-ratio 0.1"
            )
        if not self.grad_clip >= 0:
            raise ConfigError(
                f"grad_clip is {self.grad_clip}; it must be >= 0 (0 disables).", fix="--max-grad-norm 1.0"
            )
        if self.param_dtype not in PARAM_DTYPES:
            raise ConfigError(
                f"param_dtype is {self.param_dtype!r}; expected one of {', '.join(PARAM_DTYPES)}.",
                fix="--param-dtype bf16 (GPU) or --param-dtype fp32 (CPU tests)",
            )
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(
                f"overlong is {self.overlong!r}; expected one of {', '.join(OVERLONG_POLICIES)}.",
                fix="--overlong truncate",
            )
        if self.attention not in ATTENTION_CHOICES:
            raise ConfigError(
                f"attention is {self.attention!r}; expected one of {', '.join(ATTENTION_CHOICES)}.",
                fix="--attention auto",
            )
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"peak_tflops is {self.peak_tflops}; it must be > 0.", fix="--peak-tflops 989")
        if self.output.exists() and not self.output.is_dir():
            raise ConfigError(
                f"output {self.output} exists and is not a directory.", fix="pass a directory path"
            )

    def _check_types(self) -> None:
        """Every field against its annotation, so API callers get the same one-line errors as the CLI."""
        for f in fields(self):
            annotation = str(f.type)
            value = getattr(self, f.name)
            if value is None and annotation.endswith(" | None"):
                continue
            expected, ok = _FIELD_TYPES[annotation.removesuffix(" | None")]
            if not ok(value):
                raise ConfigError(
                    f"{f.name} is {value!r} ({type(value).__name__}); expected {expected}.",
                    fix=f"give {f.name} {expected}",
                )
            if isinstance(value, os.PathLike) and annotation.startswith("str"):
                setattr(self, f.name, os.fspath(value))
            elif annotation == "float":
                setattr(self, f.name, float(value))
            elif annotation == "tuple[float, float]":
                setattr(self, f.name, tuple(float(x) for x in value))

    def _check_ranges(self) -> None:
        """What the per-field checks below do not cover: empty paths, non-finite numbers, seeds, betas."""
        for name, flag in (("model", "--model"), ("data", "--data"), ("output", "--output-dir")):
            if not str(getattr(self, name)).strip():
                raise ConfigError(f"{name} is empty.", fix=f"pass {flag} with a path")
        for f in fields(self):
            value = getattr(self, f.name)
            numbers = value if f.name == "betas" else (value,)
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                raise ConfigError(
                    f"{f.name} is {value!r}; it must be a finite number.", fix=f"give {f.name} a real value"
                )
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed is {self.seed}; it must be in [0, 2**32).", fix="--seed 0")
        if self.weight_decay < 0:
            raise ConfigError(
                f"weight_decay is {self.weight_decay}; it must be >= 0.", fix="--weight-decay 0.1"
            )
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(
                f"betas are {tuple(self.betas)}; each must be in [0, 1).", fix="--adam-betas 0.9 0.95"
            )

    def _validate_new_fields(self) -> None:
        if self.dataset_format not in DATASET_FORMATS:
            raise ConfigError(
                f"dataset_format is {self.dataset_format!r}; expected one of {', '.join(DATASET_FORMATS)}.",
                fix="--dataset-format auto",
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(
                f"eval_fraction is {self.eval_fraction}; it must be in [0, 1).", fix="--eval-fraction 0.05"
            )
        if self.eval_fraction > 0 and self.eval_data is not None:
            raise ConfigError(
                f"eval_data ({self.eval_data}) and eval_fraction ({self.eval_fraction}) were both given; "
                "the eval set comes from one of them.",
                fix="pass either --eval-data PATH or --eval-fraction F, not both",
            )
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(
                f"eval_every is {self.eval_every!r}; it must be >= 0 (0: evaluate at the end only).",
                fix="--eval-every 100",
            )
        if self.save_total_limit is not None:
            _positive(
                "save_total_limit", self.save_total_limit, "--save-total-limit 2, or leave it out to keep all"
            )
        if self.resume_anyway and not self.resume:
            raise ConfigError(
                "resume_anyway was given without resume; it only overrides --resume's identity check.",
                fix="add --resume, or drop --resume-anyway",
            )
        if self.overwrite and self.resume:
            raise ConfigError(
                "overwrite and resume were both given: --overwrite discards the run that --resume continues.",
                fix="pass either --resume or --overwrite",
            )


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
                f"report_to has {name!r}; expected one of {', '.join(REPORT_TO_CHOICES)}.",
                fix="--report-to tensorboard (several: --report-to tensorboard,wandb)",
            )
    if "none" in items and len(set(items)) > 1:
        raise ConfigError(
            f"report_to is {','.join(items)}: 'none' cannot be combined with a tracker.",
            fix="--report-to none, or list only trackers",
        )
    return tuple(dict.fromkeys(n for n in items if n != "none"))


def checkpointing_value(value: str, *, source: str) -> bool | None:
    """``auto`` -> None, ``on``/``true``/``yes`` -> True, ``off``/``false``/``no`` -> False."""
    key = value.strip().lower()
    if key not in CHECKPOINTING_VALUES:
        raise ConfigError(
            f"{source} is {value!r}; expected auto, on or off.",
            fix="--activation-checkpointing auto (the default), on or off",
        )
    return CHECKPOINTING_VALUES[key]


def _positive(name: str, value: int, fix: str) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} is {value!r}; it must be a positive integer.", fix=fix)


# ------------------------------------------------------------------------------------------------ argv ---
PROG = "kernelguard train"
CONFIG_FILENAME = "train_config.json"  # the resolved configuration, written to the output folder at start
# Per-invocation switches: what to do with an existing output folder, not how the run trains.
INVOCATION_FIELDS = ("resume", "resume_anyway", "overwrite", "dry_run")
# Old flag -> its HF-style name. The old names still parse (hidden from --help, with a warning) for one release.
DEPRECATED_FLAGS = {
    "--output": "--output-dir",
    "--lr": "--learning-rate",
    "--epochs": "--num-train-epochs",
    "--grad-accum": "--gradient-accumulation-steps",
    "--grad-clip": "--max-grad-norm",
    "--save-every": "--save-steps",
}
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")  # torchrun's named --nproc-per-node values
LAUNCH_FIELDS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "master_addr",
    "master_port",
)
_REQUIRED = (
    ("model", "--model DIR_OR_CONFIG_JSON"),
    ("data", "--data FILE_DIR_OR_NAME"),
    ("output", "--output-dir DIR"),
)


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    """torchrun's options, for `kernelguard train --nproc-per-node N ...` (kernelguard.train.launch)."""

    nproc_per_node: str
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        n = self.nproc_per_node
        if not (n.isdigit() and int(n) > 0) and n not in NPROC_NAMES:
            raise ConfigError(
                f"--nproc-per-node is {n!r}; expected a positive integer or one of {', '.join(NPROC_NAMES)}.",
                fix="--nproc-per-node 8 (one process per GPU)",
            )
        nodes = self.nnodes.split(":")
        if not (
            len(nodes) <= 2
            and all(x.isdigit() and int(x) > 0 for x in nodes)
            and int(nodes[0]) <= int(nodes[-1])
        ):
            raise ConfigError(
                f"--nnodes is {self.nnodes!r}; expected a positive integer N or MIN:MAX with MIN <= MAX.",
                fix="--nnodes 2 (or --nnodes 1:4 for an elastic job)",
            )
        if self.node_rank < 0 or (len(nodes) == 1 and self.node_rank >= int(nodes[0])):
            raise ConfigError(
                f"--node-rank is {self.node_rank}; expected 0 to {int(nodes[-1]) - 1} for --nnodes {self.nnodes}.",
                fix="--node-rank 0 on the first node, 1 on the second, ...",
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(
                f"--master-port is {self.master_port}; expected 1 to 65535.", fix="--master-port 29500"
            )


@dataclass(frozen=True, slots=True)
class Command:
    """One parsed `kernelguard train` command line: the run, how to launch it, and what to warn about."""

    config: TrainConfig
    launch: LaunchOptions | None = None
    warnings: tuple[str, ...] = ()


class _ArgumentParser(argparse.ArgumentParser):
    deprecated_used: list[str]

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message, fix=f"see `{self.prog} --help`")


class _CheckpointingSwitch(argparse.BooleanOptionalAction):
    """``--activation-checkpointing [auto|on|off]`` (alone: on) and its ``--no-`` twins (off). A
    BooleanOptionalAction, so a --config file sets it like any switch: true, false, or null (auto)."""

    VALUES = "auto|on|off"

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"  # after BooleanOptionalAction's own nargs=0, so the positive names take a value
        self.metavar = self.VALUES

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value (got {values!r}); it means off")
            setattr(namespace, self.dest, False)
            return
        flag = option_string or "--activation-checkpointing"
        setattr(namespace, self.dest, True if values is None else checkpointing_value(values, source=flag))

    @staticmethod
    def from_file(value: Any, *, where: str) -> bool | None:
        """A --config file's value: true, false, null (auto) or the strings auto/on/off (for config_file's
        ``_file_value``, which today accepts only the booleans and null of any switch)."""
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, str):
            return checkpointing_value(value, source=where)
        raise ConfigError(
            f"{where} is {value!r} ({type(value).__name__}); expected auto, on, off, true or false.",
            fix="activation_checkpointing: auto",
        )


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help line states its default (booleans only when the flag has a --no- twin)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=110)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, _CheckpointingSwitch):  # the --no- names take no value
            names = sorted(action.option_strings, key=lambda o: o.startswith("--no-"))  # positives first
            return f"{names[0]} [{_CheckpointingSwitch.VALUES}], " + ", ".join(names[1:])
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        plain_switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        default = action.default
        if "%(default)" in text or plain_switch or default in (None, argparse.SUPPRESS) or default == []:
            return text
        return f"{text} (default: %(default)s)"


class _DeprecatedStore(argparse._StoreAction):
    """A renamed flag's old name: stores like the new one and records a warning for the caller to print."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(*args, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        parser.deprecated_used.append(
            f"{option_string} is deprecated and will be removed in the next release; use {self.replacement}"
        )


def _flag(group: Any, *names: str, **kwargs: Any) -> argparse.Action:
    """Add a flag; its deprecated old name (DEPRECATED_FLAGS) becomes a hidden twin with the same dest."""
    action: argparse.Action = group.add_argument(*names, **kwargs)
    for old, new in DEPRECATED_FLAGS.items():
        if new in names:
            twin = {k: v for k, v in kwargs.items() if k in ("type", "metavar", "choices")}
            group.add_argument(
                old,
                dest=action.dest,
                action=_DeprecatedStore,
                replacement=new,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
                **twin,
            )
    return action


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog=prog,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,  # a prefix of one flag must never silently mean another
        description="Packed FSDP2 supervised fine-tuning that starts only once kernelguard's guard passes. "
        "Flags follow Hugging Face's names; --flag_name spellings work too. Every flag can also be set in a "
        "--config file (key = the flag name with underscores); flags on the command line win.",
        epilog="Exit codes: 0 ok; 2 usage, config or data error; 3 the guard refused (a slow fallback would "
        "run). With --nproc-per-node, the same codes come back from the ranks. Plain `torchrun` exits 1 "
        "whenever a rank fails, whatever the rank's code. Renamed flags (old names work for one release): "
        + ", ".join(f"{old} -> {new}" for old, new in DEPRECATED_FLAGS.items())
        + ".",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML (.yaml/.yml), TOML (.toml) or JSON (.json) file of flag values, e.g. OUTPUT/"
        + CONFIG_FILENAME,
    )
    _add_data_flags(p.add_argument_group("model and data"))
    _add_optimisation_flags(p.add_argument_group("optimisation"))
    _add_model_runtime_flags(p.add_argument_group("model runtime"))
    _add_output_flags(p.add_argument_group("checkpoints, output and tracking"))
    _add_launch_flags(p.add_argument_group("launcher (runs torch.distributed.run; leave out under torchrun)"))
    return p


def _add_data_flags(g: Any) -> None:
    g.add_argument("--model", help="local model directory, or a config.json for random init (required)")
    g.add_argument("--tokenizer", help="local tokenizer directory (default: --model)")
    g.add_argument(
        "--chat-template", metavar="FILE", help="Jinja chat template file (default: the tokenizer's)"
    )
    g.add_argument("--data", help="jsonl/json/parquet file or folder, or a dataset name (required)")
    g.add_argument(
        "--dataset-format",
        choices=DATASET_FORMATS,
        default="auto",
        help="row layout: chat messages, prompt/completion pairs or plain text; auto detects it",
    )
    g.add_argument("--messages-column", default="messages", help="column that holds the conversation")
    g.add_argument("--split", default="train", help="dataset split to train on")
    g.add_argument("--eval-data", metavar="PATH", help="held-out data for the eval loss")
    g.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out this fraction of --data for eval",
    )
    g.add_argument(
        "--eval-every",
        "--eval-steps",
        type=int,
        default=0,
        metavar="N",
        help="eval every N steps (0: at the end)",
    )
    g.add_argument(
        "--max-length",
        "--block-size",
        dest="block_size",
        type=int,
        default=8192,
        metavar="N",
        help="tokens per packed block (one sequence of packed examples)",
    )
    g.add_argument(
        "--overlong", choices=OVERLONG_POLICIES, default="truncate", help="examples longer than a block"
    )
    g.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows instead of stopping")
    g.add_argument(
        "--assistant-only-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train only on assistant tokens",
    )
    g.add_argument(
        "--all-tokens-loss",
        dest="assistant_only_loss",
        action="store_false",
        help="same as --no-assistant-only-loss",
    )


def _add_optimisation_flags(g: Any) -> None:
    g.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="stop after this optimizer step (the schedule is not changed)",
    )
    g.add_argument(
        "--schedule-steps", type=int, metavar="N", help="length of the LR schedule (default: epochs of data)"
    )
    _flag(
        g, "--num-train-epochs", dest="epochs", type=int, default=1, metavar="N", help="passes over the data"
    )
    _flag(
        g,
        "--gradient-accumulation-steps",
        dest="grad_accum",
        type=int,
        default=1,
        metavar="N",
        help="packed blocks per rank per optimizer step",
    )
    _flag(g, "--learning-rate", dest="lr", type=float, default=1e-5, metavar="LR", help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, metavar="R", help="cosine decay ends at LR x R")
    g.add_argument("--warmup-steps", type=int, default=0, metavar="N", help="linear warmup steps")
    g.add_argument("--weight-decay", type=float, default=0.0, metavar="W", help="AdamW weight decay")
    g.add_argument(
        "--adam-betas",
        dest="betas",
        nargs=2,
        type=float,
        default=(0.9, 0.95),
        metavar=("B1", "B2"),
        help="AdamW betas",
    )
    g.add_argument("--adam-beta1", type=float, metavar="B1", help="AdamW beta1 alone (Hugging Face's name)")
    g.add_argument("--adam-beta2", type=float, metavar="B2", help="AdamW beta2 alone (Hugging Face's name)")
    _flag(
        g,
        "--max-grad-norm",
        dest="grad_clip",
        type=float,
        default=1.0,
        metavar="X",
        help="clip the gradient norm to X (0 disables)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for init, data order and packing")


def _add_model_runtime_flags(g: Any) -> None:
    g.add_argument(
        "--allow",
        nargs="+",
        action="extend",
        default=[],
        metavar="ID",
        help="explicitly allowed slow paths: a kernel name (chunk_gated_delta_rule, causal_conv1d_fn), attention, "
        "a known-issue ID; repeatable",
    )
    g.add_argument(
        "--param-dtype", choices=PARAM_DTYPES, default="bf16", help="FSDP2 compute/parameter dtype"
    )
    g.add_argument(
        "--attention", choices=ATTENTION_CHOICES, default="auto", help="full-attention implementation"
    )
    g.add_argument(
        "--activation-checkpointing",
        "--gradient-checkpointing",
        dest="activation_checkpointing",
        action=_CheckpointingSwitch,
        default=None,
        help="recompute each layer's forward in the backward: same results, less memory; off is ~24%% faster "
        "(bench/RESULTS.md). auto (default): off when --dry-run's memory estimate fits the GPU without it "
        "(keeping 8%% free), else on; on for CPU runs. The flag alone means on",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="regional torch.compile of each decoder layer before FSDP2 sharding, with the GDN kernels, the "
        "causal conv and attention left opaque: +12.6%% tokens/s measured on one H200 without checkpointing "
        "(bench/RESULTS.md); the first steps pause to compile",
    )
    g.add_argument(
        "--loss",
        choices=LOSS_CHOICES,
        default="chunked",
        help="chunked: cross-entropy from the final hidden states in 4,096-token chunks, never materialising "
        "the fp32 tokens x vocab logits; logits: the model's full logits",
    )
    g.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FSDP2: free gathered weights after each forward (less memory, one more all-gather)",
    )
    g.add_argument(
        "--peak-tflops", type=float, metavar="T", help="accelerator peak for MFU (default: known GPUs)"
    )


def _add_output_flags(g: Any) -> None:
    _flag(g, "--output-dir", dest="output", type=Path, metavar="DIR", help="run folder (required)")
    _flag(
        g,
        "--save-steps",
        dest="save_every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint every N steps (0: only at the end)",
    )
    g.add_argument("--save-total-limit", type=int, metavar="N", help="keep only the newest N checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    g.add_argument(
        "--resume-anyway",
        action="store_true",
        help="with --resume: continue although the run identity changed",
    )
    g.add_argument(
        "--overwrite",
        "--overwrite-output-dir",
        action="store_true",
        help="start a new run in an output folder that already holds one",
    )
    g.add_argument(
        "--report-to",
        action="append",
        default=[],
        metavar="NAME",
        help=f"also log metrics to {', '.join(REPORT_TO_CHOICES[1:])} (repeatable or comma list; none: off). "
        "tensorboard writes OUTPUT/tensorboard; wandb honours WANDB_MODE=offline, WANDB_PROJECT; trackio logs "
        "locally (TRACKIO_PROJECT); each is an extra: pip install 'kernelguard[NAME]'",
    )
    g.add_argument(
        "--export", action=argparse.BooleanOptionalAction, default=True, help="safetensors at the end"
    )
    g.add_argument("--max-shard-size", metavar="SIZE", default="5GB", help="largest safetensors file of the export: "
                   "5GB (default), 500MB, or bytes")
    g.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True, help="write metrics.png")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    g.add_argument(
        "--dry-run", action="store_true", help="print the memory estimate and exit without training"
    )


def _add_launch_flags(g: Any) -> None:
    g.add_argument("--nproc-per-node", metavar="N", help="processes per node (an int, or gpu/cpu/auto)")
    g.add_argument("--nnodes", metavar="N", help="nodes, or MIN:MAX (default: 1)")
    g.add_argument("--node-rank", type=int, metavar="R", help="this node's rank (default: 0)")
    g.add_argument("--rdzv-backend", metavar="NAME", help="rendezvous backend, e.g. c10d")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous endpoint")
    g.add_argument("--rdzv-id", metavar="ID", help="rendezvous job id")
    g.add_argument("--master-addr", metavar="HOST", help="static rendezvous host")
    g.add_argument("--master-port", type=int, metavar="PORT", help="static rendezvous port")


# ------------------------------------------------------------------------------------------------ parse ---
def _normalize_flag_spelling(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--output_dir x` -> `--output-dir x`, as Hugging Face's parser accepts both spellings."""
    known = set(parser._option_string_actions)
    out = []
    for tok in argv:
        name, sep, rest = tok.partition("=")
        dashed = name.replace("_", "-")
        out.append(dashed + sep + rest if tok.startswith("--") and "_" in name and dashed in known else tok)
    return out


def parse_command(argv: list[str] | None) -> Command:
    """The command line (plus its --config file) -> the validated run, launcher options and warnings."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    argv = _normalize_flag_spelling(argv, parser)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", type=Path)
    config_file = pre.parse_known_args(argv)[0].config
    from_file = file_defaults(parser, load_config_file(config_file), config_file) if config_file else {}
    lists = {
        a.dest for a in parser._actions if isinstance(a, (argparse._AppendAction, argparse._ExtendAction))
    }
    parser.set_defaults(**{k: v for k, v in from_file.items() if k not in lists})
    parser.deprecated_used = []  # type: ignore[attr-defined]
    ns = vars(parser.parse_args(argv))
    for dest in lists & from_file.keys():  # a list given on the command line replaces the file's
        ns[dest] = ns[dest] or from_file[dest]
    for dest, usage in _REQUIRED:
        if ns.get(dest) is None:
            where = f", or set {dest} in {config_file}" if config_file else ""
            raise ConfigError(f"{usage.split()[0]} is required.", fix=f"pass {usage}{where}")
    b1, b2 = ns.pop("adam_beta1"), ns.pop("adam_beta2")  # HF's one-beta flags refine --adam-betas
    ns["betas"] = (ns["betas"][0] if b1 is None else b1, ns["betas"][1] if b2 is None else b2)
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in ns.items() if k in names})
    return Command(cfg, _launch_options(ns), tuple(parser.deprecated_used))  # type: ignore[attr-defined]


def _launch_options(ns: dict[str, Any]) -> LaunchOptions | None:
    given = {k: ns[k] for k in LAUNCH_FIELDS if ns.get(k) is not None}
    if not given:
        return None
    if "nproc_per_node" not in given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ConfigError(f"{flags} given without --nproc-per-node.", fix="add --nproc-per-node N")
    values: dict[str, Any] = {k: str(v) if k in ("nproc_per_node", "nnodes") else v for k, v in given.items()}
    return LaunchOptions(**values)


def parse_args(argv: list[str] | None) -> TrainConfig:
    return parse_command(argv).config


# ----------------------------------------------------------------------------------------- saved config ---
def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The run's resolved configuration as JSON values, keyed like a --config file (per-invocation switches
    such as --resume left out), so ``kernelguard train --config OUTPUT/train_config.json`` repeats the run."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        if f.name in INVOCATION_FIELDS:
            continue
        value = getattr(cfg, f.name)
        out[f.name] = (
            str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        )
    return out


def save_config(cfg: TrainConfig, path: Path) -> Path:
    """Write ``config_dict(cfg)`` to ``path`` (a file, or a folder to hold CONFIG_FILENAME) atomically; rank 0."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config_dict(cfg), indent=2) + "\n")
    tmp.replace(path)
    return path
