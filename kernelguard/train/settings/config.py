"""The `kernelguard train` configuration: one schema, validated once, with the fix in every error.

Each setting is a field of one section dataclass, named exactly like its flag (``learning_rate`` <->
``--learning-rate`` <-> ``learning_rate:`` in a ``--config`` file), with its help text beside it. Each section
checks its fields in ``__post_init__``, against its annotations and against the one table ``RULES``.
kernelguard.train.settings.config_cli derives the argparse parser and ``--help`` from these fields; kernelguard.train.
config_file reads ``--config`` files through that parser.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import extra_command

from .. import chat_templates
from ..common.atomic_file import write_text_atomically
from ..common.run_folder import CONFIG_FILE
from .config_rules import (
    ATTENTION_CHOICES,
    DATASET_FORMATS,
    DEFAULT_MAX_SHARD_SIZE,
    LOG_LEVELS,
    LOSS_CHOICES,
    LR_SCHEDULER_TYPES,
    OVERLONG_POLICIES,
    PARAM_DTYPES,
    REPORT_TO_CHOICES,
    check_blocks_per_forward,
    normalize_report_to,
    validate,
)

__all__ = [
    "ATTENTION_CHOICES",
    "DATASET_FORMATS",
    "INVOCATION_FIELDS",
    "LOG_LEVELS",
    "LOSS_CHOICES",
    "LR_SCHEDULER_TYPES",
    "OVERLONG_POLICIES",
    "PARAM_DTYPES",
    "RENAMED",
    "REPORT_TO_CHOICES",
    "SECTIONS",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "MetricsSection",
    "ModelSection",
    "OptimizerSection",
    "PackingSection",
    "RuntimeSection",
    "TrainConfig",
    "TrainingSection",
    "config_dict",
    "save_config",
    "setting",
]

# Per-invocation switches: what to do with an existing output folder, not how the run trains.
INVOCATION_FIELDS = ("resume", "resume_anyway", "overwrite", "dry_run")
# Names the settings had before they were named like their flags: still read from config files, saved
# train_config.json / run.json files and API callers, as the same setting with the same value.
RENAMED = {
    "output": "output_dir",
    "lr": "learning_rate",
    "epochs": "num_train_epochs",
    "grad_accum": "gradient_accumulation_steps",
    "grad_clip": "max_grad_norm",
    "save_every": "save_steps",
    "block_size": "max_length",
    "betas": "adam_betas",
}


def setting(default: Any = MISSING, help: str = "", **cli: Any) -> Any:
    """A field with its ``--help`` text and how its flag is spelled, read by kernelguard.train.settings.config_cli:
    ``metavar``, ``aliases`` (more flag names), ``required`` (the metavar of a required flag's usage line),
    ``negatable`` (a False switch with a --no- twin), ``negated`` (an extra store-false flag and its help),
    ``append`` (a repeatable flag, one value each). No default: a required setting."""
    meta = {"help": help, **cli}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------------- sections ---
# Zero-argument super() fails in slots dataclasses on Python 3.11, so each section calls validate() itself.
@dataclass(kw_only=True, slots=True)
class ModelSection:
    """What is fine-tuned: the model, its tokenizer and its chat template."""

    model: str = setting(
        help="local model directory, or a config.json for random init (required)",
        required="DIR_OR_CONFIG_JSON",
    )
    tokenizer: str | None = setting(None, "local tokenizer directory (default: --model)")
    chat_template: str | None = setting(
        None,
        "a Jinja chat template file, or a shipped template's name: "
        f"{', '.join(n for n in chat_templates.shipped_names() if n.endswith('_training'))} (training variants; "
        "the export ships each one's original). Default: the tokenizer's own, replaced by its training variant "
        "when it is a known Qwen template",
        metavar="FILE_OR_NAME",
    )
    init: str | None = setting(
        None,
        "pretrained: load the model folder's weights (refused when it has none); random: a seeded random "
        "init (default: pretrained for a folder, random for a config.json)",
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.tokenizer is None:
            self.tokenizer = self.model


@dataclass(kw_only=True, slots=True)
class DataSection:
    """The training rows and how they are read."""

    data: str = setting(
        help="jsonl/json/parquet file or folder, or a dataset name (required)", required="FILE_DIR_OR_NAME"
    )
    dataset_format: str = setting(
        "auto", "row layout: chat messages, prompt/completion pairs or plain text; auto detects it"
    )
    messages_column: str = setting("messages", "column that holds the conversation")
    columns: str | None = setting(
        None,
        "map other columns to a conversation: ROLE=COLUMN pairs (roles system, user, assistant; several columns "
        "of one role joined by +), e.g. user=question,assistant=answer. question/answer, instruction/input/output "
        "(Alpaca) and prompt/response rows are mapped without it",
        metavar="ROLE=COLUMN,...",
    )
    split: str = setting("train", "dataset split to train on")
    skip_bad_rows: bool = setting(False, "skip malformed rows instead of stopping")
    assistant_only_loss: bool = setting(
        True,
        "train only on assistant tokens",
        negated=("--all-tokens-loss", "same as --no-assistant-only-loss"),
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class EvalSection:
    """The held-out set and when its loss is measured (kernelguard.train.step.evaluate)."""

    eval_data: str | None = setting(None, "held-out data for the eval loss", metavar="PATH")
    eval_fraction: float = setting(0.0, "hold out this fraction of --data for eval", metavar="F")
    eval_every: int = setting(0, "eval every N steps (0: at the end)", metavar="N", aliases=("--eval-steps",))

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class PackingSection:
    """How examples become packed blocks (kernelguard.train.step.packing)."""

    max_length: int = setting(
        8192,
        "tokens per packed block (one sequence of packed examples)",
        metavar="N",
        aliases=("--block-size",),
    )
    overlong: str = setting("truncate", "examples longer than a block")
    packing: str = setting(
        "packed",
        "how a step's examples reach the model. packed: whole examples in blocks with their boundaries "
        "(cu_seq_lens, seq_idx) for the GDN layers and attention. none: the same examples of each block as one "
        "right-padded batch with an attention mask (no packing; lets an --allow'ed torch GDN reference run). "
        "leaky: a deliberate bug, for quality checks only - packed blocks with the boundaries withheld "
        "(position ids only, as a stock flattening collator sends by default), so GDN state leaks across "
        "examples. naive: the same control with no boundaries at all (positions not reset either), what plain "
        "concatenation gives. Both controls need --allow packed-without-boundaries",
    )
    first_row_probe: bool = setting(
        True,
        "run the first packed block's first examples alone too (no grad, once) and refuse when a decoder layer's "
        "outputs differ from theirs: the packing checked by construction (kernelguard.runtime.equivalence)",
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class TrainingSection:
    """How long the run trains, in what steps, from what seed."""

    max_steps: int | None = setting(
        None,
        "stop after this optimizer step. The LR schedule spans the longer of this and the epochs' steps "
        "(unless --schedule-steps is given): a value beyond the epochs' length stretches the schedule; "
        "--resume with a larger value extends a run, and its schedule with it",
        metavar="N",
    )
    schedule_steps: int | None = setting(
        None, "length of the LR schedule (default: epochs of data)", metavar="N"
    )
    num_train_epochs: int = setting(1, "passes over the data", metavar="N")
    gradient_accumulation_steps: int = setting(
        2, "packed blocks per rank per optimizer step, the same on every card (16,384 tokens by default)", metavar="N"
    )
    seed: int = setting(0, "seed for init, data order and packing")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class OptimizerSection:
    """AdamW and its learning-rate schedule (linear warmup, then --lr-scheduler-type)."""

    learning_rate: float = setting(1e-5, "peak learning rate", metavar="LR")
    lr_scheduler_type: str = setting(
        "cosine",
        "after the warmup: cosine or linear decay to LR x --min-lr-ratio at the schedule's end, or constant "
        "(no warmup), or constant_with_warmup",
    )
    min_lr_ratio: float = setting(0.1, "cosine/linear decay ends at LR x R", metavar="R")
    warmup_steps: int = setting(0, "linear warmup steps", metavar="N")
    warmup_ratio: float = setting(
        0.0,
        "linear warmup over this fraction of the schedule's steps, rounded up; instead of --warmup-steps",
        metavar="F",
    )
    weight_decay: float = setting(0.0, "AdamW weight decay", metavar="W")
    adam_betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas", metavar=("B1", "B2"))
    max_grad_norm: float = setting(1.0, "clip the gradient norm to X (0 disables)", metavar="X")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class RuntimeSection:
    """How the model runs: allowed fallbacks, dtype, kernels, memory savers, FSDP2."""

    allow: tuple[str, ...] = setting(
        (),
        "explicitly allowed slow paths: a kernel name (chunk_gated_delta_rule, causal_conv1d_fn), attention, "
        "a known-issue ID; repeatable",
        metavar="ID",
    )
    lock: str | None = setting(
        None,
        "the image's kernelguard.lock (kernelguard lock): refuse to start, before the model is built, on a node "
        "whose stack differs from it (default: KERNELGUARD_LOCK when set)",
        metavar="FILE",
    )
    param_dtype: str = setting("bf16", "FSDP2 compute/parameter dtype")
    attention: str = setting("auto", "full-attention implementation")
    # None: auto, decided per run from kernelguard.train.model.memory's estimate (build.resolve_activation_checkpointing)
    activation_checkpointing: bool | None = setting(
        None,
        "recompute each layer's forward in the backward: same results, less memory, slower steps. auto "
        "(default): off when --dry-run's memory estimate fits the GPU without it (keeping 8% free), else on; "
        "on for CPU runs. The flag alone means on",
        aliases=("--gradient-checkpointing",),
    )
    # None: auto (build.resolve_step_layout); blocks per forward from the memory estimate (memory.choose_layout).
    compile: bool | None = setting(
        None,
        "regional torch.compile of each decoder layer before FSDP2 sharding, GDN kernels, causal conv and attention "
        "left opaque; the first steps pause to compile. auto (default): on for GPU runs. The flag alone means on",
    )
    blocks_per_forward: int | None = setting(
        None,
        "how many of a step's blocks run through the model as one packed row (same examples, boundaries and loss; "
        "fewer, larger launches). auto (default): as many as the memory estimate fits (all on CPU); N must divide "
        "--gradient-accumulation-steps",
        metavar="auto|N",
    )
    # Off by default: compile fuses what it fuses, and costs more with it (bench/RESULTS.md 1.10).
    fused_norms: bool = setting(
        False,
        "Liger-Kernel's fused RMSNorm and SiLU-gate kernels for every norm and MLP that computes exactly what "
        "they compute (kernelguard.train.model.fused_norms); CUDA only, needs pip install liger-kernel",
        negatable=True,
    )
    loss: str = setting(
        "chunked",
        "chunked: cross-entropy from the final hidden states in 4,096-token chunks, never materialising the fp32 "
        "tokens x vocab logits; logits: the model's full logits",
    )
    # None: auto (build.resolve_step_layout): the memory estimate decides with the layout (memory.choose_layout).
    reshard_after_forward: bool | None = setting(
        None,
        "FSDP2: free each layer's gathered weights after its forward, gather them again for its backward (less "
        "memory, more work). auto (default): kept when the estimate fits the GPU, else freed (CPU: freed). Alone: on",
    )
    peak_tflops: float | None = setting(None, "accelerator peak for MFU (default: known GPUs)", metavar="T")

    def __post_init__(self) -> None:
        validate(self)


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    """The run folder: checkpoints, retention, resume, the final export."""

    output_dir: Path = setting(help="run folder (required)", metavar="DIR", required="DIR")  # noqa: RUF009
    save_steps: int = setting(0, "checkpoint every N steps (0: only at the end)", metavar="N")
    save_total_limit: int | None = setting(None, "keep only the newest N checkpoints", metavar="N")
    resume: bool = setting(False, "continue from the newest complete checkpoint")
    resume_anyway: bool = setting(False, "with --resume: continue although the run identity changed")
    overwrite: bool = setting(
        False,
        "start a new run in an output folder that already holds one",
        aliases=("--overwrite-output-dir",),
    )
    export: bool = setting(True, "safetensors at the end")
    max_shard_size: str = setting(
        DEFAULT_MAX_SHARD_SIZE,
        "largest safetensors file of the export: a size such as 5GB, 500MB, 2GiB, or bytes",
        metavar="SIZE",
    )
    dry_run: bool = setting(False, "print the memory estimate and exit without training")

    def __post_init__(self) -> None:
        validate(self)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise ConfigError(f"the output folder {self.output_dir} is a file, not a folder.")


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    """What the run reports besides OUTPUT/metrics.jsonl (kernelguard.train.output.metrics)."""

    report_to: tuple[str, ...] = setting(
        (),
        f"also log metrics to {', '.join(REPORT_TO_CHOICES[1:])} (repeatable or comma list; none: off). "
        "tensorboard writes OUTPUT/tensorboard; wandb honours WANDB_MODE=offline, WANDB_PROJECT; trackio logs "
        f"locally (TRACKIO_PROJECT); each is an extra: {extra_command('NAME')}",
        metavar="NAME",
        append=True,
    )
    plot: bool = setting(True, "write metrics.png")
    progress: bool = setting(True, "progress bar")
    # One profiled step every few hundred keeps the cost far below the 2% a run can spare (measured and
    # reported with the figures). The first window waits for steady steps (after compilation, autotuning and
    # the first evals); a CPU-only run has no GPU to judge, so it profiles only when asked.
    profile_step: int | None = setting(
        None,
        "profile this step, or the first steady one after it, said in the log (default: step 10 on a GPU; never "
        "on a CPU-only run; 0: never): GPU time by kernel class, time launched from torch reference paths, MFU "
        "and a verdict into metrics.jsonl, and one warning line when the step is on a slow path",
        metavar="N",
    )
    profile_every: int = setting(500, "profile again every N steps after --profile-step (0: once)", metavar="N")
    profile_trace: Path | None = setting(  # noqa: RUF009
        None, "also write the first profiled step as a Chrome/Perfetto trace (DIR/trace_stepN.json)", metavar="DIR"
    )
    logging_steps: int = setting(
        0,
        "log a line with loss, LR, grad norm and tokens/s every N steps (0: none; metrics.jsonl and "
        "--report-to get every step)",
        metavar="N",
    )
    log_level: str = setting("info", "the least severe log lines rank 0 prints (logging's level names)")

    def __post_init__(self) -> None:
        validate(self)
        self.report_to = normalize_report_to(self.report_to)
        from .config_rules import (
            check_trackers,  # a missing tracker library is refused now, not after the build
        )

        check_trackers(self.report_to)


# Section attribute -> class, in --help order.
SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "evaluation": EvalSection,
    "packing": PackingSection,
    "training": TrainingSection,
    "optimizer": OptimizerSection,
    "runtime": RuntimeSection,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
}
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Every setting of one `kernelguard train` run, by section. ``TrainConfig.from_flags(learning_rate=...)``
    builds one from flag names; ``cfg.flags()`` gives them back."""

    model: ModelSection
    data: DataSection
    evaluation: EvalSection = field(default_factory=EvalSection)
    packing: PackingSection = field(default_factory=PackingSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    checkpoint: CheckpointSection
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} is not a {cls.__name__}.", fix=f"pass {name}={cls.__name__}(...)")
        check_blocks_per_forward(self.runtime.blocks_per_forward, self.training.gradient_accumulation_steps)

    @classmethod
    def from_flags(cls, **values: Any) -> TrainConfig:
        """A config from flag names (``learning_rate=3e-4``, ``output_dir=...``); a name in RENAMED is read as
        its new name. Unknown names are a TypeError, as for any keyword."""
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            name = RENAMED.get(key, key)
            if name not in _SECTION_OF:
                raise TypeError(f"TrainConfig has no setting {key!r}")
            if name in by_section.get(_SECTION_OF[name], {}):
                raise TypeError(f"TrainConfig got {name!r} twice (once as {key!r})")
            by_section.setdefault(_SECTION_OF[name], {})[name] = value
        required = {"model": "model", "data": "data", "checkpoint": "output_dir"}
        for section, name in required.items():
            if section not in by_section:
                raise TypeError(f"TrainConfig.from_flags() missing required setting {name!r}")
        return cls(**{s: SECTIONS[s](**kw) for s, kw in by_section.items()})

    def flags(self) -> dict[str, Any]:
        """Every setting by its flag name, in --help order."""
        return {f.name: getattr(getattr(self, s), f.name) for s, c in SECTIONS.items() for f in fields(c)}


# ----------------------------------------------------------------------------------------- saved config ---
def config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The run's resolved configuration as JSON values, keyed by flag name like a --config file (per-invocation
    switches such as --resume left out), so ``kernelguard train --config OUTPUT/train_config.json`` repeats it."""
    out: dict[str, Any] = {}
    for name, value in cfg.flags().items():
        if name in INVOCATION_FIELDS:
            continue
        out[name] = (
            str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        )
    return out


def save_config(cfg: TrainConfig, path: Path) -> Path:
    """Write ``config_dict(cfg)`` to ``path`` (a file, or a folder to hold CONFIG_FILE) atomically; rank 0."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomically(path, json.dumps(config_dict(cfg), indent=2) + "\n")
