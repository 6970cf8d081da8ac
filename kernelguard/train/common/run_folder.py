"""The names inside a run's output folder: what a run writes there, each spelled once."""

from __future__ import annotations

__all__ = [
    "CHECKPOINTS",
    "CONFIG_FILE",
    "FINAL",
    "FINAL_TMP",
    "LOCK_FILE",
    "METRICS_FILE",
    "METRICS_PLOT",
    "RUN_ARTIFACTS",
    "RUN_FILE",
]

RUN_FILE = "run.json"  # the run's identity: what its inputs were (inputs.identity)
CONFIG_FILE = "train_config.json"  # the resolved configuration, written at start
CHECKPOINTS = "checkpoints"  # step_N/ folders, each sealed by its COMPLETE marker
FINAL = "final"  # the Hugging Face export
FINAL_TMP = "final.tmp"  # the export while it is written; renamed onto FINAL when whole
METRICS_FILE = "metrics.jsonl"
METRICS_PLOT = "metrics.png"
LOCK_FILE = ".kernelguard.lock"  # held while a run or an export writes here (common.run_folder_lock)

# What a run writes into its output folder; --overwrite removes exactly these.
RUN_ARTIFACTS = (
    RUN_FILE,
    CONFIG_FILE,
    CHECKPOINTS,
    FINAL,
    FINAL_TMP,
    METRICS_FILE,
    METRICS_PLOT,
    "tensorboard",
    "wandb",
)
