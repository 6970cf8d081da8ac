"""Inputs of a format kernelguard does not read are named, not misread (kernelguard.resolution.file_kinds): a GGUF file to
`check --model` and `train --model`, a datasets save_to_disk folder and a JSON object file to --data, a model
type transformers does not know, a dangling symbolic link."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kernelguard.cli import main as cli
from kernelguard.errors import ConfigError, DataError
from kernelguard.train.inputs.sources import iter_rows, resolve_files
from kernelguard.train.model.parallel import model_source


def test_a_gguf_file_is_named_by_check_and_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    assert cli(["check", "--model", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert f"{gguf} is a GGUF file (llama.cpp's format, not a transformers config or model folder)." in err
    with pytest.raises(ConfigError, match=r"--model .*model.gguf is a GGUF file") as info:
        model_source(str(gguf))
    assert info.value.fix and "convert GGUF to a transformers folder first" in info.value.fix


def test_a_model_type_transformers_does_not_know_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen99_next"}))
    assert cli(["check", "--model", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err
    assert "model_type 'qwen99_next' in" in err and "does not know this model type (a newer release, or a typo)" in err


def test_a_dangling_symlink_is_named_everywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    said = f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    assert cli(["check", "--model", str(link)]) == 2
    assert said in capsys.readouterr().err
    for call in (lambda: model_source(str(link)), lambda: resolve_files(str(link))):
        with pytest.raises(ConfigError, match="is a symbolic link to"):
            call()


def test_a_saved_dataset_folder_is_named_with_a_conversion(tmp_path: Path) -> None:
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ConfigError) as info:
        resolve_files(str(tmp_path))
    assert info.value.message == (f"--data {tmp_path} is a datasets save_to_disk folder; kernelguard train reads "
                                  "JSON lines, JSON or Parquet files.")
    assert info.value.fix and f"datasets.load_from_disk('{tmp_path}')" in info.value.fix


@pytest.mark.parametrize("text", ['{"a": {"messages": []}, "b": {"messages": []}}\n', '{\n "x": 1,\n "y": 2\n}\n'],
                         ids=["rows-keyed-by-id", "pretty-printed-object"])
def test_a_json_object_file_is_named(tmp_path: Path, text: str) -> None:
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(DataError, match=r"this file is one JSON object \(keys '.*'\), not rows"):
        list(iter_rows(str(tmp_path / "d.json"), skipped=Counter(), skip_bad=False))


def test_a_one_row_json_lines_file_is_still_a_row(tmp_path: Path) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "x"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert [r.value for r in iter_rows(str(tmp_path / "d.jsonl"), skipped=Counter(), skip_bad=False)] == [row]
