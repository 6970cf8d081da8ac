"""TrainConfig: every knob of `kernelguard train`, validated once, with the fix in every error."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from kernelguard.errors import ConfigError

PARAM_DTYPES = ("bf16", "fp32", "fp16")
OVERLONG_POLICIES = ("truncate", "drop")
ATTENTION_CHOICES = ("auto", "varlen", "sdpa", "flash_attention_2", "eager")
LOSS_CHOICES = ("chunked", "logits")  # kernelguard.train.loss.linear_cross_entropy / the full logits
DATASET_FORMATS = ("auto", "messages", "prompt-completion", "text")
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb", "trackio")


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
    activation_checkpointing: bool = True
    loss: str = "chunked"
    reshard_after_forward: bool = True
    save_every: int = 0
    peak_tflops: float | None = None
    export: bool = True
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
        self.output = Path(self.output)
        self.allow = tuple(self.allow)
        self.report_to = normalize_report_to(self.report_to)
        self._validate_new_fields()
        if self.tokenizer is None:
            self.tokenizer = self.model
        _positive("block_size", self.block_size, "--block-size 8192")
        _positive("epochs", self.epochs, "--epochs 1")
        _positive("grad_accum", self.grad_accum, "--grad-accum 1")
        if self.max_steps is not None:
            _positive("max_steps", self.max_steps, "--max-steps 100, or leave it out to train for --epochs")
        if self.schedule_steps is not None:
            _positive(
                "schedule_steps", self.schedule_steps, "leave --schedule-steps out to use the epoch length"
            )
        if self.warmup_steps < 0:
            raise ConfigError(
                f"warmup_steps is {self.warmup_steps}; it must be >= 0.", fix="--warmup-steps 0"
            )
        if self.save_every < 0:
            raise ConfigError(f"save_every is {self.save_every}; it must be >= 0.", fix="--save-every 0")
        if not self.lr > 0:
            raise ConfigError(f"lr is {self.lr}; it must be > 0.", fix="--lr 1e-5")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"min_lr_ratio is {self.min_lr_ratio}; it must be in [0, 1].", fix="--min-lr-ratio 0.1"
            )
        if not self.grad_clip >= 0:
            raise ConfigError(
                f"grad_clip is {self.grad_clip}; it must be >= 0 (0 disables).", fix="--grad-clip 1.0"
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
            _positive("save_total_limit", self.save_total_limit, "--save-total-limit 2, or leave it out to keep all")
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


def _positive(name: str, value: int, fix: str) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} is {value!r}; it must be a positive integer.", fix=fix)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message, fix=f"see `{self.prog} --help`")


def build_parser(prog: str = "python -m kernelguard.train") -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog=prog,
        description="Packed FSDP2 supervised fine-tuning that starts only once kernelguard's guard passes.",
        epilog="Exit codes: 0 ok; 2 usage, config or data error; 3 the guard refused (a slow fallback would run).",
    )
    p.add_argument("--model", required=True, help="local model directory, or a config.json for random init")
    p.add_argument("--tokenizer", help="local tokenizer directory (default: --model)")
    p.add_argument("--data", required=True, help="jsonl/json/parquet file or folder, or a dataset name")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument(
        "--max-steps", type=int, help="stop after this optimizer step (the schedule is not changed)"
    )
    p.add_argument("--schedule-steps", type=int, help="length of the LR schedule (default: epochs of data)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="packed blocks per rank per optimizer step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument(
        "--allow",
        nargs="+",
        action="extend",
        default=[],
        metavar="ID",
        help="explicitly allowed slow paths: a kernel name (chunk_gated_delta_rule, causal_conv1d_fn), attention, "
        "a known-issue ID; repeatable",
    )
    p.add_argument("--messages-column", default="messages")
    p.add_argument("--split", default="train")
    p.add_argument("--overlong", choices=OVERLONG_POLICIES, default="truncate")
    p.add_argument("--skip-bad-rows", action="store_true")
    p.add_argument("--all-tokens-loss", dest="assistant_only_loss", action="store_false")
    p.add_argument("--param-dtype", choices=PARAM_DTYPES, default="bf16")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto")
    p.add_argument(
        "--no-activation-checkpointing",
        dest="activation_checkpointing",
        action="store_false",
        help="keep activations instead of recomputing each layer's forward in the backward: ~25%% faster "
        "when they fit in memory (bench/RESULTS.md)",
    )
    p.add_argument(
        "--loss",
        choices=LOSS_CHOICES,
        default="chunked",
        help="chunked: cross-entropy from the final hidden states in 4,096-token chunks, never materialising "
        "the fp32 tokens x vocab logits (default); logits: the model's full logits",
    )
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--peak-tflops", type=float, help="override the accelerator's peak for MFU")
    p.add_argument("--no-export", dest="export", action="store_false")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--dataset-format", choices=DATASET_FORMATS, default="auto")
    p.add_argument("--eval-data", metavar="PATH", help="held-out data for eval loss")
    p.add_argument("--eval-fraction", type=float, default=0.0, metavar="F")
    p.add_argument("--eval-every", type=int, default=0, metavar="N")
    p.add_argument("--save-total-limit", type=int, metavar="N")
    p.add_argument("--report-to", action="append", default=[], metavar="NAME")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--resume-anyway", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    return p


def parse_args(argv: list[str] | None) -> TrainConfig:
    ns = vars(build_parser().parse_args(argv))
    ns["allow"] = tuple(ns["allow"] or ())
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in ns.items() if k in names})
