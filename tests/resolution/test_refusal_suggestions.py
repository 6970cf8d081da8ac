"""Refusals of a mistyped input name the nearest valid name and give a command that pastes and works (the
whole command line, corrected), or no `Fix:` line at all: never prose dressed as a command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.resolution.terms import usage_suggestion


@pytest.fixture
def base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe: each sentence on one line, as a log keeps it
    assets = h.write_train_assets(tmp_path / "a", rows=4)
    return ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(tmp_path / "out")]


def _refusal(args: list[str]) -> list[str]:
    """The error line and its Fix: line, or the error line alone when it has none."""
    r = h.run_train(args, fakes=False, nproc=0, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    return lines[-2:] if lines[-1].startswith("Fix: ") else lines[-1:]


def test_a_mistyped_flag_names_the_flag_and_the_corrected_command(base: list[str]) -> None:
    assert _refusal([*base, "--packng", "none"]) == [
        "kernelguard train: error: unrecognized argument --packng; did you mean --packing?",
        f"Fix: kernelguard train {shlex.join([*base, '--packing', 'none'])}",
    ]
    assert _refusal([*base, "--packng=none"])[1] == f"Fix: kernelguard train {shlex.join([*base, '--packing=none'])}"


def test_a_mistyped_choice_names_the_valid_ones_and_the_nearest(base: list[str]) -> None:
    assert _refusal([*base, "--packing", "pakced"]) == [
        "kernelguard train: error: --packing: 'pakced' is not one of packed, none, leaky, naive; did you mean packed?",
        f"Fix: kernelguard train {shlex.join([*base, '--packing', 'packed'])}",
    ]


def test_a_mistyped_allow_item_names_up_to_three_nearest_not_every_name(base: list[str]) -> None:
    assert _refusal([*base, "--allow", "causal_conv1d", "attention"]) == [
        ("kernelguard train: error: --allow: 'causal_conv1d' is not a known issue ID, kernel name or policy; did you "
        "mean causal_conv1d_fn or causal_conv1d_update?"),
        f"Fix: kernelguard train {shlex.join([*base, '--allow', 'causal_conv1d_fn', 'attention'])}",
    ]


def test_a_name_near_nothing_keeps_the_full_list_and_a_command(base: list[str]) -> None:
    error, fix = _refusal([*base, "--allow", "zzzq"])
    assert error.startswith("kernelguard train: error: --allow: 'zzzq' is not a known issue ID, kernel name or "
                            "policy. Known issues: fla-640-wrong-grads")
    assert fix == "Fix: `kernelguard issues` lists every known issue with what allowing it means"
    assert _refusal([*base, "--zzzq"]) == [
        "kernelguard train: error: unrecognized arguments: --zzzq", "Fix: kernelguard train --help"]


def test_a_data_file_of_another_suffix_gets_the_rename_or_the_conversion(base: list[str], tmp_path: Path) -> None:
    typo = tmp_path / "chats.jsnol"
    typo.write_text("{}\n")
    fixed = tmp_path / "chats.jsonl"
    assert _refusal([*base, "--data", str(typo)]) == [
        (f"kernelguard train: error: data file {typo} has suffix '.jsnol'; expected .jsonl, .json or .parquet (or "
        f".jsonl.gz). Did you mean .jsonl? Rename it, then pass --data {fixed}."),
        f"Fix: mv {typo} {fixed}",
    ]
    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\nhi,there\n")
    assert _refusal([*base, "--data", str(csv)])[1] == (
        f"Fix: python -c \"import datasets; datasets.load_dataset('csv', data_files='{csv}')['train']"
        f".to_json('{tmp_path / 'rows.jsonl'}')\"")
    other = tmp_path / "notes.docx"
    other.write_text("x")
    assert _refusal([*base, "--data", str(other)]) == [
        (f"kernelguard train: error: data file {other} has suffix '.docx'; expected .jsonl, .json or .parquet (or "
        ".jsonl.gz): convert it to JSON lines (one JSON object per line) or Parquet.")]  # no Fix: line


def test_a_data_folder_without_data_files_says_what_it_holds_and_offers_no_prose_fix(
    base: list[str], tmp_path: Path
) -> None:
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    assert _refusal([*base, "--data", str(folder)]) == [
        (f"kernelguard train: error: data folder {folder} holds no .jsonl, .json or .parquet files (it holds "
        "notes.txt).")]


def test_argparse_messages_of_either_python_get_the_nearest_name() -> None:
    for message in ("argument --mode: invalid choice: 'train' (choose from 'training', 'inference')",
                    "argument --mode: invalid choice: 'train' (choose from training, inference)"):
        assert usage_suggestion(message, []) == (
            "--mode: 'train' is not one of training, inference; did you mean training?", ("train", "training"),
            "--mode")
    assert usage_suggestion("unrecognized arguments: --moed x", ["--mode", "--model", "--arch"])[0] == (
        "unrecognized argument --moed; did you mean --mode?")  # --model is two edits from it: not a slip
    assert usage_suggestion("the following arguments are required: --model", ["--model"])[1] is None


def test_a_flag_is_corrected_only_for_a_slip_never_into_another_job() -> None:
    """difflib finds --nnodes "close" to --nope: the printed fix was a 3-node launch. Only a few letters' slip is
    corrected into a command; anything further is argparse's own message and --help."""
    flags = ["--nnodes", "--nproc-per-node", "--learning-rate", "--max-length", "--arch", "--resume"]
    for typed in ("--nope 3", "--nope", "--node 2", "--res"):
        assert usage_suggestion(f"unrecognized arguments: {typed}", flags) == (
            f"unrecognized arguments: {typed}", None, None), typed
    for typed, meant in (("--learning-rat", "--learning-rate"), ("--max-lenght", "--max-length"),
                         ("--nnode", "--nnodes"), ("--archs", "--arch"), ("--reusme", "--resume")):
        said, replace, _ = usage_suggestion(f"unrecognized arguments: {typed} 1", flags)
        assert said == f"unrecognized argument {typed}; did you mean {meant}?" and replace == (typed, meant)
