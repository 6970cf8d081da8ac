"""A --data / --eval-data that looks like a local path and does not exist is refused at once, before the guard
and before torch, with the nearest existing name; a Hub dataset name while the Hub is off is one line, no
retries (issue 43: `--data chitchat.jsnol` waited 45 s on six network retries)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.errors import ConfigError
from kernelguard.train.inputs import sources
from kernelguard.train.inputs.sources import hub_offline_error, looks_local, missing_path_error, resolve_files


@pytest.mark.parametrize(("data", "local"), [
    ("chitchat.jsnol", True), ("chitchat.csv", True), ("./chitchat", True), ("/data/x", True), ("~/x", True),
    ("a/b/c", True), ("owner/name.jsnol", True), ("owner/name.parquet", True),
    ("HuggingFaceH4/ultrachat_200k", False), ("teknium/OpenHermes-2.5", False), ("squad", False),
    ("owner/data-v1.2", False),
])
def test_what_looks_like_a_local_path(data: str, local: bool) -> None:
    assert looks_local(data) is local


def test_a_missing_local_looking_path_names_the_nearest_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chitchat.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError) as info:
        resolve_files("chitchat.jsnol")
    assert str(info.value) == ("--data chitchat.jsnol: no such file or folder; did you mean chitchat.jsonl?\n"
                               "Fix: --data chitchat.jsonl")
    assert info.value.details["replace"] == ("chitchat.jsnol", "chitchat.jsonl")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    assert str(missing_path_error("data/trian.jsonl", flag="--eval-data")) == (
        "--eval-data data/trian.jsonl: no such file or folder; did you mean data/train.jsonl?\n"
        "Fix: --eval-data data/train.jsonl")
    assert str(missing_path_error("data/zzz", flag="--data")) == (
        "--data data/zzz: no such file or folder in data; a local path is never looked up on the Hugging Face Hub.")
    assert str(missing_path_error("nodir/x.jsonl", flag="--data")) == (
        "--data nodir/x.jsonl: no such file or folder (nodir does not exist either); a local path is never looked "
        "up on the Hugging Face Hub.")
    assert resolve_files("owner/dataset") is None  # a Hub name stays one


def test_a_hub_name_while_offline_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert str(hub_offline_error("someone/chitchat")) == (
        "--data someone/chitchat is no local file or folder, so it would be read from the Hugging Face Hub, but "
        "HF_HUB_OFFLINE=1 is set and the dataset is not in the local cache.\n"
        "Fix: hf download --repo-type dataset someone/chitchat   (with network; or pass a local file as --data)")
    (tmp_path / "hf" / "hub" / "datasets--someone--chitchat").mkdir(parents=True)
    assert hub_offline_error("someone/chitchat") is None  # cached: datasets reads it offline


def test_a_hub_name_without_network_is_one_line_and_a_cached_one_is_read_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "unreachable_hub", lambda: "huggingface.co does not resolve")
    assert hub_offline_error("someone/chitchat", flag="--eval-data").message == (
        "--eval-data someone/chitchat is no local file or folder, so it would be read from the Hugging Face Hub, "
        "but the Hub cannot be reached from this machine (huggingface.co does not resolve) and the dataset is not in "
        "the local cache.")
    (tmp_path / "hf" / "datasets" / "someone___chitchat").mkdir(parents=True)
    assert hub_offline_error("someone/chitchat") is None
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # so datasets reads the cache without retrying first


_EARLY = """
import json, sys
from kernelguard.train.__main__ import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted({"torch", "transformers", "datasets"} & set(sys.modules))}))
"""


def _train(cwd: Path, *args: str, **env: str) -> tuple[dict[str, Any], str]:
    r = subprocess.run([sys.executable, "-c", _EARLY, *args], capture_output=True, text=True, cwd=str(cwd),
                       timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(h.REPO), **env})
    return json.loads(r.stdout.splitlines()[-1]), r.stderr


def test_the_typo_is_refused_before_torch_with_the_command_to_paste(tmp_path: Path) -> None:
    assets = h.write_train_assets(tmp_path, rows=4)
    (tmp_path / "chitchat.jsonl").write_text((tmp_path / "data.jsonl").read_text())
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--output-dir", "out"]
    result, err = _train(tmp_path, *base, "--data", "chitchat.jsnol")
    assert result == {"code": 2, "imported": []}
    assert err == ("kernelguard train: error: --data chitchat.jsnol: no such file or folder; did you mean "
                   f"chitchat.jsonl?\nFix: kernelguard train --model {assets['model']} --tokenizer {assets['tok']} "
                   "--output-dir out --data chitchat.jsonl\n")
    result, err = _train(tmp_path, *base, "--data", "chitchat.jsonl", "--eval-data=chitchat.jsnol")
    assert result == {"code": 2, "imported": []}
    assert err.endswith("--data chitchat.jsonl --eval-data=chitchat.jsonl\n")
    result, err = _train(tmp_path, *base, "--data", "someone/chitchat", HF_HUB_OFFLINE="1",
                         HF_HOME=str(tmp_path / "hf"))
    assert result == {"code": 2, "imported": []}
    assert err.startswith("kernelguard train: error: --data someone/chitchat is no local file or folder")
    assert "Retrying" not in err


def test_a_name_sharing_only_the_extension_is_not_suggested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nocol.jsonl").write_text("{}\n")
    assert str(missing_path_error("nope.jsonl", flag="--data")) == (
        "--data nope.jsonl: no such file or folder in the current folder; a local path is never looked up on the Hugging Face Hub.")
    assert missing_path_error("nocl.jsonl", flag="--data").fix == "--data nocol.jsonl"


def test_a_folder_holding_a_run_is_refused_before_torch_with_the_resume_command(tmp_path: Path) -> None:
    """The most common output-folder refusal needs no model, tokenizer or torch: it came after torch loaded
    (seconds), now with the input refusals; its fix is this command with --resume, which pastes."""
    assets = h.write_train_assets(tmp_path, rows=4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text("{}")
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", "out"]
    result, err = _train(tmp_path, *base)
    assert result == {"code": 2, "imported": []}
    assert err == ("kernelguard train: error: --output-dir out already holds a run (run.json). The command below "
                   "continues it; --overwrite instead deletes it and starts again; another --output-dir keeps it.\n"
                   f"Fix: kernelguard train {' '.join(base)} --resume\n")
    (tmp_path / "out" / "run.json").unlink()  # control: an empty folder is taken (the run goes on, past torch)
    result, _ = _train(tmp_path, *base, "--dry-run")
    assert result["code"] == 0 and "torch" in result["imported"]


def test_a_fix_that_is_one_flag_s_value_becomes_the_whole_command(tmp_path: Path) -> None:
    """`--master-port 99999` is refused with the command that sets the port the fix names (the old value gone);
    a fix that says more than one flag's value (a choice in words) is printed as it is."""
    assets = h.write_train_assets(tmp_path, rows=4)
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", "out", "--nproc-per-node", "2"]
    result, err = _train(tmp_path, *base, "--master-port", "99999", "--max-steps", "2")
    assert result == {"code": 2, "imported": []}
    assert err.endswith(f"Fix: kernelguard train {' '.join(base)} --max-steps 2 --master-port 29500\n"), err
    _, err = _train(tmp_path, *base, "--master-port=99999")
    assert err.endswith(f"Fix: kernelguard train {' '.join(base)} --master-port 29500\n"), err
    _, err = _train(tmp_path, *base, "--profile-step", "9", "--max-steps", "2")  # control: a fix in words
    assert "Fix: --profile-step 2 (or any step up to 2), or leave the profiling flags out\n" in err, err


def test_a_typo_of_a_name_already_given_is_dropped_from_the_command_not_doubled(tmp_path: Path) -> None:
    assets = h.write_train_assets(tmp_path, rows=4)
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", "out", "--allow", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    result, err = _train(tmp_path, *base, "--allow", "causal_conv1d")
    assert result == {"code": 2, "imported": []}
    assert err.endswith(f"Fix: kernelguard train {' '.join(base)}\n"), err
    _, err = _train(tmp_path, *base[:-3], "--allow", "causal_conv1d")  # control: a name not given yet is put in
    assert err.endswith(f"Fix: kernelguard train {' '.join(base[:-3])} --allow causal_conv1d_fn\n"), err
