"""Rows of other column names read as a conversation (issue 43): question/answer, Alpaca's
instruction/input/output and prompt/response detected, any other names by ``--columns``; the line that says
what was mapped, and the refusals with their exact text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.errors import ConfigError, DataError
from kernelguard.train.inputs.data import load_examples
from kernelguard.train.inputs.rows import Row, detect_format, row_item
from kernelguard.train.settings.config import TrainConfig


def _messages(value: dict[str, Any], fmt: str | None = None) -> list[dict[str, str]]:
    row = Row("d.jsonl", 1, value)
    item = row_item(row, fmt or detect_format(row), column="messages", assistant_only=True, eos=None)
    return item.messages  # type: ignore[union-attr]


def test_the_common_layouts_are_detected_and_mapped_to_a_conversation() -> None:
    user, answer = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    assert detect_format(Row("d", 1, {"question": "Q", "answer": "A"})) == "columns:user=question,assistant=answer"
    assert _messages({"question": "Q", "answer": "A"}) == [user, answer]
    assert _messages({"prompt": "Q", "response": "A"}) == [user, answer]
    assert _messages({"instruction": "Q", "input": "", "output": "A"}) == [user, answer]
    assert _messages({"instruction": "Q", "input": "in", "output": "A"}) == [
        {"role": "user", "content": "Q\n\nin"}, answer]
    assert _messages({"instruction": "Q", "output": "A"}) == [user, answer]
    assert _messages({"system": "S", "question": "Q", "answer": "A"}) == [
        {"role": "system", "content": "S"}, user, answer]


def test_sharegpt_rows_are_read_as_conversations() -> None:
    turns = [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]
    assert detect_format(Row("d", 1, {"conversations": turns, "id": "x"})) == "sharegpt"
    expected = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}]
    assert _messages({"conversations": turns}) == expected
    # The same turns under another column, named with --messages-column (it once said "unknown role None").
    row = Row("d.jsonl", 1, {"chat": turns})
    assert row_item(row, detect_format(row, "chat"), column="chat", assistant_only=True, eos=None).messages == expected  # type: ignore[union-attr]
    with pytest.raises(DataError, match=r"field 'conversations\[1\].from': unknown speaker 'alien'; expected one of human"):
        _messages({"conversations": [turns[0], {"from": "alien", "value": "Q"}]})


def test_the_known_formats_keep_their_meaning() -> None:
    """A `messages`, `prompt`/`completion` or `text` column wins over a layout's columns."""
    assert detect_format(Row("d", 1, {"prompt": "Q", "completion": "A", "response": "x"})) == "prompt-completion"
    assert detect_format(Row("d", 1, {"text": "t", "question": "Q", "answer": "A"})) == "text"
    assert detect_format(Row("d", 1, {"messages": [], "question": "Q", "answer": "A"})) == "messages"


def test_columns_maps_other_names_and_is_a_config_key(tmp_path: Path) -> None:
    fmt = "columns:user=query,assistant=reply,system=sys"
    assert _messages({"query": "Q", "reply": "A", "sys": "S"}, fmt) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    from kernelguard.train.settings.config_cli import parse_command

    config = tmp_path / "c.toml"
    config.write_text('columns = "user=query , assistant=reply"\n')
    cmd = parse_command(["--config", str(config), "--model", "m", "--data", "d.jsonl", "--output-dir", "o"])
    assert cmd.config.data.columns == "user=query , assistant=reply"
    flag = parse_command(["--columns", "user=a+b,assistant=c", "--model", "m", "--data", "d", "--output-dir", "o"])
    assert flag.config.data.columns == "user=a+b,assistant=c"


def test_a_bad_columns_value_is_refused_with_its_syntax() -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_flags(model="m", data="d", output_dir="o", columns="user=query")
    assert str(info.value) == (
        "columns is 'user=query'; expected ROLE=COLUMN pairs joined by commas, a user and an assistant column at "
        "least (roles: system, user, assistant; several columns of one role joined by +, e.g. "
        "user=instruction+input).\nFix: --columns user=question,assistant=answer")
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_flags(model="m", data="d", output_dir="o", columns="user=a,assistant=b",
                               dataset_format="text")
    assert str(info.value) == ("columns (user=a,assistant=b) maps the rows to a conversation, so dataset_format "
                               "text cannot apply.\nFix: drop --dataset-format, or drop --columns")


def test_a_mapped_row_without_its_column_or_with_an_empty_answer_is_refused() -> None:
    with pytest.raises(DataError) as info:
        _messages({"question": "Q", "reply": "A"}, "columns:user=question,assistant=answer")
    assert str(info.value) == ("d.jsonl, row 1, field 'answer': column 'answer' (assistant) is missing (columns: "
                               "question, reply)\nFix: --columns user=question,assistant=reply")
    with pytest.raises(DataError) as info:
        _messages({"question": "Q", "answer": " "})
    assert info.value.message == ("d.jsonl, row 1, field 'answer': the assistant column is empty, so there is "
                                  "nothing to train on")
    with pytest.raises(DataError) as info:
        _messages({"question": ["Q"], "answer": "A"})
    assert info.value.message == ("d.jsonl, row 1, field 'question': expected a string for the user message, got "
                                  "list")


def test_the_data_counts_name_the_mapping(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(h.write_tokenizer(tmp_path / "tok")))
    data = h.write_jsonl(tmp_path / "qa.jsonl", [{"question": "ab", "answer": "cd"}] * 3)
    _, stats = load_examples(data=str(data), tokenizer=tokenizer, max_length=512)
    assert stats.format == "columns:user=question,assistant=answer"
    assert stats.render().startswith("a conversation mapped from columns (user=question, assistant=answer), chat "
                                     "template tokenizer: 3 rows -> 3 examples")
    other = h.write_jsonl(tmp_path / "other.jsonl", [{"q": "ab", "r": "cd"}] * 3)
    _, stats = load_examples(data=str(other), tokenizer=tokenizer, max_length=512, columns="user=q,assistant=r")
    assert stats.examples == 3 and stats.format == "columns:user=q,assistant=r"


_EARLY = """
import json, sys
from kernelguard.train.__main__ import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted({"torch", "transformers", "tokenizers"} & set(sys.modules))}))
"""


def _early(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`kernelguard train ARGS` in a subprocess that reports its exit code and whether torch was imported;
    stderr joined to one line (it is wrapped to the terminal)."""
    r = subprocess.run([sys.executable, "-c", _EARLY, *args], capture_output=True, text=True, cwd=str(tmp_path),
                       timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(h.REPO)})
    return json.loads(r.stdout.splitlines()[-1]), " ".join(r.stderr.split())


def test_the_command_line_says_what_was_mapped_and_pastes_the_columns_fix(tmp_path: Path) -> None:
    assets = h.write_train_assets(tmp_path, rows=4)
    h.write_jsonl(tmp_path / "qa.jsonl", [{"question": "ab", "answer": "cd"}] * 4)
    h.write_jsonl(tmp_path / "other.jsonl", [{"query": "ab", "reply": "cd"}] * 4)
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--output-dir", "out"]
    # the eval rows of another layout stop it after the training rows' line, before torch
    result, said = _early(tmp_path, *base, "--data", "qa.jsonl", "--eval-data", "other.jsonl")
    assert result == {"code": 2, "imported": []}
    assert said.startswith("kernelguard train: --data qa.jsonl: rows read as a conversation mapped from columns "
                           "(user=question, assistant=answer) (detected; other names: --columns ROLE=COLUMN,...) "
                           "kernelguard train: error: other.jsonl, row 1, field 'messages': no column")
    assert said.endswith("Fix: --columns user=query,assistant=reply")  # not a command: it would map qa.jsonl too
    result, said = _early(tmp_path, *base, "--data", "other.jsonl")
    assert result == {"code": 2, "imported": []}
    assert said.endswith(f"Fix: kernelguard train --model {assets['model']} --tokenizer {assets['tok']} --output-dir "
                         "out --data other.jsonl --columns user=query,assistant=reply")
    result, said = _early(tmp_path, *base, "--data", "other.jsonl", "--columns", "user=query,assistant=reply",
                          "--eval-data", "missing.jsonl")
    assert said.startswith("kernelguard train: error: --eval-data missing.jsonl: no such file or folder")
