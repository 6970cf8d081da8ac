"""What a run reports: metrics.jsonl records (and --report-to trackers), the progress bar and its log lines."""


from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..common.logs import bar_safe_logging, log, logger
from ..common.ranks import DistInfo, on_main
from ..settings.config import TrainConfig, config_dict
from ..step.step import (
    StepResult,
)
from .metrics import MetricsLog, open_metrics, step_flops

__all__ = ["Reporter", "plain_progress_steps", "process_age_s", "progress_bar", "step_line", "step_record"]


class Reporter:
    """Rank 0's metrics.jsonl (and --report-to trackers) and progress bar; a no-op on other ranks.

    Opened right after the output folder is claimed, before the model is materialized: a tracker that cannot
    start refuses the run (on every rank) before any long work."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, *, start: int, total: int) -> None:
        opened: list[MetricsLog] = []
        run_config = config_dict(cfg)
        output, report_to = cfg.checkpoint.output_dir, cfg.metrics.report_to
        on_main(
            info,
            lambda: opened.append(
                open_metrics(output, report_to=report_to, run_config=run_config, resume_step=start)
            ),
        )
        self.metrics = opened[0] if opened else None
        self.bar: Any = None
        self.postfix: dict[str, str] = {}
        self._bar_args = (cfg, info, total, start)
        self._stack = contextlib.ExitStack()
        self.logging_steps, self.total = (cfg.metrics.logging_steps if info.is_main else 0), total
        self._window: tuple[float, int, int] = (0.0, 0, 0)  # loss x tokens, tokens, steps since the last line
        if info.is_main and cfg.metrics.progress and not self.logging_steps and not _on_a_terminal():
            self.logging_steps = plain_progress_steps(total)  # the bar's plain-line stand-in in a log

    def start(self) -> None:
        """Draw the progress bar from here on, with log lines printed above it."""
        cfg, info, total, start = self._bar_args
        self.bar = progress_bar(cfg, info, total=total, initial=start)
        self._stack.enter_context(bar_safe_logging(self.bar))

    def __enter__(self) -> Reporter:  # noqa: PYI034 - final in practice; py3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)
        if "loss" in record and "eval_loss" not in record:  # the window a logged line's mean covers
            tokens = max(1, int(record.get("loss_tokens") or 1))
            self._window = (self._window[0] + record["loss"] * tokens, self._window[1] + tokens, self._window[2] + 1)
        if self.logging_steps and record["step"] % self.logging_steps == 0:
            total_loss, tokens, steps = self._window
            mean = (total_loss / tokens, steps) if steps > 1 and "eval_loss" not in record else None
            logger.info(step_line(record, self.total, mean=mean))
            if "eval_loss" not in record:
                self._window = (0.0, 0, 0)
        if self.bar is None:
            return
        if "eval_loss" in record:
            self.postfix["eval_loss"] = f"{record['eval_loss']:.4f}"
        else:
            self.bar.update(1)
            self.postfix.update(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._stack.close()
        if self.metrics is not None:
            self.metrics.close()


def step_line(record: dict[str, Any], total: int, *, mean: tuple[float, int] | None = None) -> str:
    """The --logging-steps line of one metrics record (a step's, or an eval's). ``mean``: the token-weighted
    loss over the steps since the last line, and how many: one step's loss is noisy, and read alone in a log it
    can look like the loss rising (Hugging Face's Trainer logs the mean too)."""
    if "eval_loss" in record:
        return f"step {record['step']}/{total}: eval loss {record['eval_loss']:.4f}"
    smoothed = f" (mean of the last {mean[1]} steps: {mean[0]:.4f})" if mean is not None else ""
    return (
        f"step {record['step']}/{total}: loss {record['loss']:.4f}{smoothed}, lr {record['lr']:.3g}, "
        f"grad norm {record['grad_norm']:.3g}, {record['tokens_per_s']:,.0f} tokens/s"
    )


def plain_progress_steps(total: int) -> int:
    """Steps between the plain progress lines that stand in for the bar in a log: about ten lines a run."""
    return max(1, total // 10)


def _on_a_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def progress_bar(cfg: TrainConfig, info: DistInfo, *, total: int, initial: int) -> Any:
    """The tqdm bar on a terminal only: in a log (a pipe, a file) its carriage-return frames would be noise,
    so the log gets plain step lines instead (:func:`plain_progress_steps`)."""
    if not (info.is_main and cfg.metrics.progress and _on_a_terminal()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        log(info, "tqdm is not installed: no progress bar (metrics still go to metrics.jsonl)")
        return None
    return tqdm(total=total, initial=initial, desc="train", unit="step", file=sys.stderr)


def step_record(
    info: DistInfo,
    step: int,
    result: StepResult,
    seconds: float,
    seq_lens: list[int],
    hf_config: Any,
    peak: float,
    *,
    computed_tokens: int,
) -> dict[str, Any]:
    """The metrics.jsonl record of one step; throughput counts real (non-pad) tokens of all ranks, padding
    is the share of the ``computed_tokens`` (this rank's micro-batches, padding included) that were not real."""
    totals = torch.tensor(
        [float(sum(seq_lens)), step_flops(hf_config, seq_lens), float(computed_tokens)],
        dtype=torch.float64,
        device=info.device,
    )
    dist.all_reduce(totals)
    real_tokens, flops, capacity = float(totals[0]), float(totals[1]), float(totals[2])
    return {
        "step": step,
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": real_tokens / seconds,
        "loss_tokens": result.loss_tokens,
        "mfu": (flops / seconds / (peak * info.world_size)) if peak else None,
        "padding_pct": 100.0 * (1.0 - real_tokens / capacity),
        "peak_mem_gb": _peak_memory_gb(info.device),
        "step_time_s": seconds,
    }


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc: its start tick against the uptime, 10 ms
    resolution); None where there is no /proc. A launched rank counts from its own start."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, after "pid (comm) "
        return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None
