"""Every CLI text fits the terminal: `COLUMNS` when set, 100 columns when not a terminal. The one exception is a
shell command (a `fix:` / `Fix:` / `or:` line, a usage example): it is never wrapped, so it pastes as one
command. `kernelguard check`'s own text is covered by tests/stack/test_golden_output.py."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

import pytest

from kernelguard.stack.report import terminal_width, wrap_message

COMMAND_LINE = re.compile(r"^\s*(fix:|Fix:|or:)\s")


def _too_wide(text: str, width: int) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width and not COMMAND_LINE.match(line)]


def _kernelguard(*argv: str) -> Callable[[], object]:
    from kernelguard.cli import main

    return lambda: main(list(argv))


def _run(fn: Callable[[], object], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        fn()
    except SystemExit:
        pass
    out = capsys.readouterr()
    return out.out + out.err


@pytest.mark.parametrize("width", [80, 100, 132])
@pytest.mark.parametrize(
    "argv",
    [("--help",), ("check", "--help"), ("issues",), ("train", "--help"), ("export", "--help")],
    ids=lambda a: " ".join(a),
)
def test_help_and_issues_fit_columns(
    argv: tuple[str, ...], width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(width))
    text = _run(_kernelguard(*argv), capsys)
    assert text.strip() and _too_wide(text, width) == []
    # the width is used, not just respected: some line comes close to it
    assert max(len(line) for line in text.splitlines()) > width - 25, argv


def test_without_a_terminal_the_width_is_100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "__stdout__", None)  # no terminal to ask
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(80, 24): __import__("os").terminal_size(fallback))
    assert terminal_width() == 100


def test_a_refusal_wraps_its_prose_and_breaks_the_command_so_it_still_pastes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    command = "pip install setuptools wheel ninja packaging && pip install --no-build-isolation 'causal-conv1d'"
    text = wrap_message(
        "kernelguard train: error: " + "the packed run would feed the torch reference path, which mixes examples. " * 3
        + f"\nFix: {command}  (compiles against the installed torch; several minutes)"
    )
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Fix: "))
    assert _too_wide(text, 80) == [] and lines[at:at + 2] == [
        "Fix: pip install setuptools wheel ninja packaging && pip install \\",
        "         --no-build-isolation 'causal-conv1d'",
    ]
    assert lines[-1].strip() == "compiles against the installed torch; several minutes"


def test_a_lock_difference_keeps_its_restore_command_pasteable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A line that ends in a command after a colon (a lock difference's restore): prose wrapped, the command on
    lines of its own joined by a trailing backslash (it was wrapped as prose and broke when pasted)."""
    monkeypatch.setenv("COLUMNS", "80")
    command = "pip install 'torch==2.11.0' --index-url https://download.pytorch.org/whl/cu130"
    text = wrap_message(f"kernelguard: differs\n  - torch: lock says 2.11.0+cu130, here 2.13.0+cpu; restore: {command}")
    lines = text.splitlines()
    assert _too_wide(text, 80) == [] and lines[1:] == [
        "  - torch: lock says 2.11.0+cu130, here 2.13.0+cpu; restore:",
        "      pip install 'torch==2.11.0' --index-url \\",
        "          https://download.pytorch.org/whl/cu130",
    ]
    pasted = " ".join(part.strip().removesuffix("\\").strip() for part in lines[2:])
    assert pasted == command


def test_a_train_refusal_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    from kernelguard.train.__main__ import main

    monkeypatch.setenv("COLUMNS", "72")
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["--model", "m", "--data", "d", "--output-dir", str(tmp_path), "--report-to", "wandb"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) >= 3 and _too_wide(err, 72) == []
    assert "Fix: pip install 'kernelguard-gdn[wandb]'" in err.splitlines()
