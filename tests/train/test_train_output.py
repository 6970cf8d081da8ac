"""`kernelguard train`'s own output as a person reads it: fitted to the terminal as `check`'s is, an allowed
slow path said once, plain lines (no progress-bar frames) in a log; and the command breaker behind it."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.resolution.paste import command_lines, is_command
from kernelguard.stack.report import fit_line

ALLOWED = (
    "kernelguard train: allowed slow paths (--allow): causal_conv1d_fn, chunk_gated_delta_rule run their torch "
    "reference, correct but several times slower (the ALLOWED-SLOW rows above say why)"
)


def _args(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    assets = h.write_train_assets(tmp_path / "assets", rows=40)
    return ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(out), "--block-size", "256", "--param-dtype", "fp32", "--packing", "none",
            "--no-plot", "--allow", "attention", "causal_conv1d_fn", "chunk_gated_delta_rule", *extra]


@pytest.mark.slow
def test_train_output_fits_80_columns_says_the_allowed_paths_once_and_draws_no_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # stdout and stderr are pipes (capture_output): a log, read at 80
    args = _args(tmp_path, tmp_path / "out", "--max-steps", "2", "--save-steps", "1")
    r = h.run_train(args, fakes=False, nproc=0)
    assert r.returncode == 0, r.stderr
    resumed = h.run_train([*args[:-4], "--max-steps", "3", "--resume"], fakes=False, nproc=0)
    assert resumed.returncode == 0, resumed.stderr
    for run, last in ((r, "step 2/2: loss"), (resumed, "step 3/3: loss")):
        output = run.stdout + run.stderr
        assert "\r" not in output
        # A line may pass 80 columns only when it is one word that cannot be broken (a path, a URL).
        assert [line for line in output.splitlines() if len(line) > 80 and " " in line.strip()] == []
        joined = " ".join(line.strip() for line in output.splitlines())  # undo the wrapping
        assert joined.count(ALLOWED) == 1, output
        assert "allowed fallback" not in output and "allowed slow path `" not in output
        assert f"kernelguard train: {last}" in joined and "train: 100%" not in output  # plain lines, no bar


def test_a_long_command_breaks_between_arguments_and_still_parses_the_same() -> None:
    command = ("kernelguard train --model /data/models/qwen3_5-27b/config.json --data 'chats with spaces.jsonl' "
               "--output-dir /scratch/runs/a-very-long-output-folder-name --max-steps 1000 --resume")
    lines = command_lines(command, 60)
    assert lines == [
        "kernelguard train --model \\",
        "    /data/models/qwen3_5-27b/config.json --data \\",
        "    'chats with spaces.jsonl' --output-dir \\",
        "    /scratch/runs/a-very-long-output-folder-name \\",
        "    --max-steps 1000 --resume",
    ]
    assert all(len(line) <= 60 for line in lines)
    assert shlex.split("\n".join(lines).replace("\\\n", " ")) == shlex.split(command)


def test_a_trailing_comment_and_a_wide_argument_stay_whole() -> None:
    command = "pip install 'causal-conv1d>=1.5' --no-build-isolation  # builds against your torch, ~10 min"
    assert command_lines(command, 50) == [
        "pip install 'causal-conv1d>=1.5' \\",
        "    --no-build-isolation \\",
        "    # builds against your torch, ~10 min",
    ]
    assert command_lines("kernelguard export /" + "x" * 90, 40) == ["kernelguard export \\", "    /" + "x" * 90]


def test_a_log_line_naming_its_program_is_prose_not_a_command() -> None:
    assert not is_command("kernelguard train: data: 40 rows -> 40 examples")
    assert not is_command("kernelguard: allowed slow paths")
    assert is_command("kernelguard train --resume") and is_command("  pip install x")
    line = "kernelguard train: grouped 40 examples (2906 tokens) into 12 padded batches of at most 256 real tokens"
    assert fit_line(line, 60) == [
        "kernelguard train: grouped 40 examples (2906 tokens) into 12",
        "  padded batches of at most 256 real tokens",
    ]


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_the_bar_is_drawn_on_a_terminal_only_and_a_log_gets_plain_lines_instead(
    tty: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import torch

    from kernelguard.train.common.ranks import DistInfo
    from kernelguard.train.output.reporting import plain_progress_steps, progress_bar
    from kernelguard.train.settings.config import TrainConfig

    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    cfg = TrainConfig.from_flags(model="m", data="d", output_dir=tmp_path)
    bar = progress_bar(cfg, DistInfo(0, 1, 0, torch.device("cpu")), total=40, initial=0)
    assert (bar is not None) is tty
    if bar is not None:
        bar.update(1)
        bar.close()
        assert "\r" in stream.text  # a terminal redraws its bar in place
    assert [plain_progress_steps(n) for n in (1, 9, 40, 1000)] == [1, 1, 4, 100]
