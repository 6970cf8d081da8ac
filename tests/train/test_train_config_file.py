"""`kernelguard train` command line: --config files (file < CLI), their one-line errors, Hugging Face flag
names and the deprecated old ones, --help, the new TrainConfig fields and the saved train_config.json."""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import ConfigError
from kernelguard.train.__main__ import main
from kernelguard.train.common.run_folder import CONFIG_FILE
from kernelguard.train.settings.config import (
    INVOCATION_FIELDS,
    TrainConfig,
    config_dict,
    save_config,
)
from kernelguard.train.settings.config_cli import DEPRECATED_FLAGS, build_parser, parse_command

YAML = """\
model: m
data: d.jsonl
output_dir: {out}
learning_rate: 3e-4        # PyYAML reads this as a string: still a number here
max_length: 512
num_train_epochs: 2
allow: [attention]
report_to: none
assistant_only_loss: false
adam_betas: [0.9, 0.99]
"""
TOML = """\
model = "m"
data = "d.jsonl"
output_dir = "{out}"
learning_rate = 3e-4
max_length = 512
num_train_epochs = 2
allow = ["attention"]
report_to = "none"
assistant_only_loss = false
adam_betas = [0.9, 0.99]
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text.format(out=tmp_path / "out"))
    return path


def _base(tmp_path: Path) -> list[str]:
    return ["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "out")]


@pytest.mark.parametrize(("name", "text"), [("run.yaml", YAML), ("run.toml", TOML)])
def test_config_file_values_and_cli_precedence(tmp_path: Path, name: str, text: str) -> None:
    path = _write(tmp_path, name, text)
    cfg = parse_command(["--config", str(path)]).config
    assert (cfg.model.model, cfg.data.data, cfg.checkpoint.output_dir) == ("m", "d.jsonl", tmp_path / "out")
    assert (cfg.optimizer.learning_rate, cfg.packing.max_length, cfg.training.num_train_epochs, cfg.runtime.allow) == (3e-4, 512, 2, ("attention",))
    assert cfg.data.assistant_only_loss is False and cfg.optimizer.adam_betas == (0.9, 0.99) and cfg.metrics.report_to == ()
    # The command line wins over the file, for scalars, switches and lists alike (a list is replaced).
    cli = [
        "--config", str(path), "--learning-rate", "1e-3", "--block-size", "128",
        "--assistant-only-loss", "--allow", "chunk_gated_delta_rule",
    ]  # fmt: skip
    command = parse_command(cli)
    cfg = command.config
    assert (cfg.optimizer.learning_rate, cfg.packing.max_length, cfg.training.num_train_epochs) == (1e-3, 128, 2)
    assert cfg.data.assistant_only_loss is True and cfg.runtime.allow == ("chunk_gated_delta_rule",)
    # One warning per flag the command line really gave against the file, none for what only the file gives
    # (the file's output_dir, a path, once read as "overridden" by itself).
    assert all("output_dir" not in w for w in command.warnings), command.warnings
    assert parse_command(["--config", str(path)]).warnings == ()
    moved = parse_command(["--config", str(path), "--output-dir", str(tmp_path / "other")]).warnings
    assert moved == (f"--output-dir {str(tmp_path / 'other')!r} on the command line overrides output_dir: "
                     f"{str(tmp_path / 'out')!r} from {path}",)


def test_config_file_accepts_field_names_and_dashes(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "m", "data": "d", "output_dir": "o", "learning_rate": 0.5, "grad-accum": 4}))
    cfg = parse_command(["--config", str(path)]).config
    assert (cfg.optimizer.learning_rate, cfg.training.gradient_accumulation_steps, cfg.checkpoint.output_dir) == (0.5, 4, Path("o"))
    path.write_text(
        json.dumps({"model": "m", "data": "d", "output_dir": "o", "max_steps": None, "tokenizer": None})
    )
    cfg = parse_command(["--config", str(path)]).config  # null: an optional flag left unset
    assert cfg.training.max_steps is None and cfg.model.tokenizer == "m"


def test_unknown_key_is_one_line_naming_key_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('model = "m"\nlearning_rat = 1e-4\n')
    assert main(["--config", str(path), "--data", "d", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0]
        == f"kernelguard train: error: --config {path}: unknown key 'learning_rat' (did you mean 'learning_rate'?)."
    )
    assert err[1].startswith("Fix: keys are the flags of `kernelguard train --help`") and len(err) == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("num_train_epochs: two", "num_train_epochs is 'two' (str); expected an integer."),
        ("max_steps: true", "max_steps is True (bool); expected an integer."),
        ("save_steps: 2.5", "save_steps is 2.5 (float); expected an integer."),
        ("learning_rate: fast", "learning_rate is 'fast' (str); expected a number."),
        ("resume: 'yes'", "resume is 'yes' (str); expected true or false."),
        ("export: 1", "export is 1 (int); expected true or false."),
        ("allow: 3", "allow is 3 (int); expected a string or a list of strings."),
        ("param_dtype: int8", "param_dtype is 'int8' (str); expected one of bf16, fp32, fp16."),
        ("adam_betas: [0.9]", "adam_betas is [0.9] (list); expected a list of 2 numbers."),
        ("model: 5", "model is 5 (int); expected a string."),
        ("num_train_epochs: null", "num_train_epochs is None (NoneType); expected an integer."),
        (
            "report_to: [tensorboard, 7]",
            "report_to is ['tensorboard', 7] (list); expected a string or a list",
        ),
    ],
)
def test_wrong_types_name_key_value_and_expected_type(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError) as info:
        parse_command(["--config", str(path), *_base(tmp_path)])
    assert info.value.message.startswith(f"--config {path}: {expected}"), info.value.message


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("c.toml", "model = \n", "not valid TOML"),
        ("c.yaml", "model: [unclosed\n", "not valid YAML"),
        ("c.json", "{", "not valid JSON"),
        ("c.yaml", "- a\n- b\n", "the top level is a list; expected a mapping"),
        ("c.ini", "[x]\n", "unknown file type '.ini'"),
        ("c.yaml", "lr: 1\nlearning_rate: 2\n", "'lr' and 'learning_rate' set the same option"),
    ],
)
def test_malformed_config_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_command(["--config", str(path), *_base(tmp_path)])
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_command(["--config", str(tmp_path / "missing.yaml")])


def test_required_flags_may_come_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: m\n")
    with pytest.raises(ConfigError) as info:
        parse_command(["--config", str(path), "--data", "d"])
    assert info.value.message == "--output-dir is required."
    # the user's own command, completed: a run folder named after the model, never a placeholder kernelguard
    # could fill
    assert info.value.fix == f"kernelguard train --config {path} --data d --output-dir runs/m (or set output_dir in {path})"


@pytest.mark.parametrize(("old", "new"), sorted(DEPRECATED_FLAGS.items()))
def test_deprecated_flags_still_work_with_a_warning(tmp_path: Path, old: str, new: str) -> None:
    value = str(tmp_path / "x") if new == "--output-dir" else "3"
    base = ["--model", "m", "--data", "d"] if new == "--output-dir" else _base(tmp_path)
    a = parse_command([*base, old, value])
    b = parse_command([*base, new, value])
    assert a.config == b.config and b.warnings == ()
    assert a.warnings == (f"{old} is deprecated and will be removed in the next release; use {new}",)


def test_hf_spellings_and_aliases(tmp_path: Path) -> None:
    cfg = parse_command(
        ["--model", "m", "--data", "d", "--output_dir", str(tmp_path), "--learning_rate=0.01", "--max_length", "64",
         "--eval-steps", "5", "--overwrite-output-dir"]
    ).config  # fmt: skip
    assert (cfg.checkpoint.output_dir, cfg.optimizer.learning_rate, cfg.packing.max_length, cfg.evaluation.eval_every, cfg.checkpoint.overwrite) == (
        tmp_path,
        0.01,
        64,
        5,
        True,
    )
    assert parse_command([*_base(tmp_path), "--block-size", "64"]).config.packing.max_length == 64
    cfg = parse_command([*_base(tmp_path), "--adam_beta2", "0.99", "--no_gradient_checkpointing"]).config
    assert cfg.optimizer.adam_betas == (0.9, 0.99) and cfg.runtime.activation_checkpointing is False
    path = tmp_path / "c.yaml"
    path.write_text("adam_betas: [0.8, 0.9]\ngradient_checkpointing: false\n")
    cfg = parse_command(["--config", str(path), *_base(tmp_path), "--adam-beta1", "0.7"]).config
    assert cfg.optimizer.adam_betas == (0.7, 0.9) and cfg.runtime.activation_checkpointing is False
    with pytest.raises(ConfigError, match="unrecognized arguments: --learn"):
        parse_command([*_base(tmp_path), "--learn", "0.1"])  # no prefix matching


def test_help_has_a_line_and_default_for_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kernelguard train ")
    listed: set[str] = set()  # the flags each option line of --help starts with
    for line in out.splitlines():
        m = re.match(r"^ {2,8}(-\S.*?)(\s{2,}|$)", line)  # an option line (and its wrapped names)
        if m:
            listed.update(re.findall(r"(?<![\w-])--?[a-z][\w-]*", m.group(1)))
    shown = [a for a in build_parser()._actions if a.help != argparse.SUPPRESS]
    assert len(shown) > 50
    for action in shown:
        assert action.help, action.option_strings
        assert set(action.option_strings) <= listed, action.option_strings
    for old in DEPRECATED_FLAGS:  # hidden from the option list; named once in the epilog's rename table
        assert old not in listed and f"{old} -> {DEPRECATED_FLAGS[old]}" in " ".join(out.split())
    for text in ("--learning-rate LR", "(default: 1e-05)", "(default: 8192)", "(default: chunked)"):
        assert text in out
    flat = " ".join(out.split())
    assert "Exit codes: 0 ok; 2 usage" in flat and "Plain `torchrun` exits 1 whenever a rank fails" in flat


def test_kernelguard_cli_forwards_train_help(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main as cli_main

    assert cli_main(["train", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: kernelguard train ")


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ({"eval_fraction": 1.0}, "eval_fraction is 1.0; it must be in [0, 1)"),
        ({"eval_fraction": 0.1, "eval_data": "e.jsonl"}, "both given"),
        ({"eval_every": -1}, "eval_every is -1"),
        ({"save_total_limit": 0}, "save_total_limit is 0"),
        ({"dataset_format": "csv"}, "dataset_format is 'csv'"),
        ({"report_to": ("mlflow",)}, "report_to has 'mlflow'"),
        ({"report_to": "none,tensorboard"}, "'none' cannot be combined"),
        ({"resume_anyway": True}, "resume_anyway was given without resume"),
        ({"resume": True, "overwrite": True}, "overwrite and resume were both given"),
        ({"output_dir": ""}, "output_dir is empty; it must name a path (an unset shell variable gives an empty "
                             "argument)."),
        ({"model": " "}, "model is empty; it must name a path"),
        ({"learning_rate": float("inf")}, "learning_rate is inf; it must be a finite number."),
        ({"adam_betas": (0.9, float("nan"))}, "adam_betas is (0.9, nan); it must be a finite number."),
        ({"adam_betas": (0.9, 1.0)}, "adam_betas are (0.9, 1.0); each must be in [0, 1)."),
        ({"seed": -1}, "seed is -1; it must be in [0, 2**32)."),
        ({"weight_decay": -0.1}, "weight_decay is -0.1; it must be >= 0."),
        ({"learning_rate": float("nan")}, "learning_rate is nan; it must be a finite number."),
    ],
)
def test_new_fields_are_validated(tmp_path: Path, extra: dict[str, Any], text: str) -> None:
    values: dict[str, Any] = {"model": "m", "data": "d", "output_dir": tmp_path, **extra}
    with pytest.raises(ConfigError, match=re.escape(text)) as info:
        TrainConfig.from_flags(**values)
    assert info.value.fix


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("learning_rate", "1e-4", "learning_rate is '1e-4' (str); expected a number."),
        ("max_length", 2.0, "max_length is 2.0 (float); expected an integer."),
        ("max_steps", True, "max_steps is True (bool); expected an integer."),
        ("resume", "yes", "resume is 'yes' (str); expected true or false."),
        ("allow", [1], "allow is [1] (list); expected a string or a list of strings."),
        ("adam_betas", (0.9,), "adam_betas is (0.9,) (tuple); expected two numbers."),
        ("output_dir", 3, "output_dir is 3 (int); expected a path."),
    ],
)
def test_api_callers_get_the_same_type_errors(tmp_path: Path, field: str, value: Any, expected: str) -> None:
    values: dict[str, Any] = {"model": "m", "data": "d", "output_dir": tmp_path, field: value}
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_flags(**values)
    assert info.value.message == expected


def test_api_values_are_normalised(tmp_path: Path) -> None:
    values: dict[str, Any] = {"model": tmp_path / "m", "data": tmp_path / "d", "output_dir": str(tmp_path)}
    cfg = TrainConfig.from_flags(**values, learning_rate=1, allow="attention", adam_betas=[0, 0])  # type: ignore[arg-type]
    assert (cfg.model.model, cfg.data.data, cfg.checkpoint.output_dir) == (str(tmp_path / "m"), str(tmp_path / "d"), tmp_path)
    assert (cfg.optimizer.learning_rate, cfg.runtime.allow, cfg.optimizer.adam_betas) == (1.0, ("attention",), (0.0, 0.0)) and isinstance(cfg.optimizer.learning_rate, float)


def test_new_fields_from_flags(tmp_path: Path) -> None:
    cfg = parse_command(
        [*_base(tmp_path), "--chat-template", "t.jinja", "--dataset-format", "prompt-completion",
         "--eval-data", "e.jsonl", "--eval-every", "10", "--save-total-limit", "2", "--report-to", "none",
         "--resume", "--resume-anyway", "--dry-run"]
    ).config  # fmt: skip
    assert (cfg.model.chat_template, cfg.data.dataset_format, cfg.evaluation.eval_data, cfg.evaluation.eval_every) == (
        "t.jinja", "prompt-completion", "e.jsonl", 10,
    )  # fmt: skip
    assert (cfg.checkpoint.save_total_limit, cfg.metrics.report_to, cfg.checkpoint.resume_anyway, cfg.checkpoint.dry_run) == (2, (), True, True)
    assert parse_command([*_base(tmp_path), "--eval-fraction", "0.25"]).config.evaluation.eval_fraction == 0.25


def test_saved_config_is_a_config_file_that_repeats_the_run(tmp_path: Path) -> None:
    cfg = parse_command(
        [*_base(tmp_path), "--learning-rate", "0.002", "--allow", "attention", "--adam-betas", "0.8", "0.9",
         "--save-total-limit", "3", "--no-export", "--resume"]
    ).config  # fmt: skip
    written = save_config(cfg, tmp_path)
    assert written == tmp_path / CONFIG_FILE and not list(tmp_path.glob("*.tmp"))
    data = json.loads(written.read_text())
    assert data["learning_rate"] == 0.002 and data["adam_betas"] == [0.8, 0.9]
    assert data["output_dir"] == str(tmp_path / "out") and "lr" not in data and "betas" not in data
    assert not set(INVOCATION_FIELDS) & data.keys()
    again = parse_command(["--config", str(written)]).config
    assert config_dict(again) == config_dict(cfg) and again.checkpoint.resume is False


def test_launcher_flags_parse_and_need_nproc(tmp_path: Path) -> None:
    cmd = parse_command([*_base(tmp_path), "--nproc-per-node", "2", "--master-port", "29511"])
    assert cmd.launch is not None and (cmd.launch.nproc_per_node, cmd.launch.master_port) == ("2", 29511)
    assert parse_command(_base(tmp_path)).launch is None
    with pytest.raises(ConfigError, match="--nnodes given without --nproc-per-node"):
        parse_command([*_base(tmp_path), "--nnodes", "2"])


def test_dry_run_without_the_memory_module_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kernelguard.train.model.memory", None)  # import fails as if absent
    assert main([*_base(tmp_path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--dry-run needs the memory estimate (kernelguard.train.model.memory)" in err and "Traceback" not in err


def test_dry_run_prints_the_estimate_and_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[TrainConfig, int | None]] = []

    class Estimate:
        def render(self) -> str:
            return "peak per GPU: 12.3 GiB"

    def estimate(cfg: TrainConfig, *, world_size: int | None, model: object, progress: object) -> Estimate:
        assert model == "the meta model"  # built once, shared with the host-memory figures
        seen.append((cfg, world_size))
        return Estimate()

    class Host:
        def render(self) -> str:
            return "host memory per rank: 1.0 GiB"

    monkeypatch.setitem(sys.modules, "kernelguard.train.model.memory", types.SimpleNamespace(estimate=estimate))
    monkeypatch.setitem(sys.modules, "kernelguard.train.startup.host_memory",
                        types.SimpleNamespace(host_memory=lambda cfg, *, world_size, model, progress: Host()))
    monkeypatch.setitem(sys.modules, "kernelguard.train.model.memory_probe",
                        types.SimpleNamespace(build_probe_model=lambda config: "the meta model"))
    from kernelguard.train.model import parallel
    monkeypatch.setattr(parallel, "model_source", lambda model: (types.SimpleNamespace(model_type="qwen3_5"), None))
    assert main([*_base(tmp_path), "--dry-run", "--max-length", "128"]) == 0
    assert capsys.readouterr().out == "peak per GPU: 12.3 GiB\nhost memory per rank: 1.0 GiB\n"
    assert seen[0][0].packing.max_length == 128 and seen[0][1] is None and not (tmp_path / "out").exists()
    # With the launcher flags, the estimate is for the ranks they would start; nothing is launched.
    assert main([*_base(tmp_path), "--dry-run", "--nproc-per-node", "4", "--nnodes", "2:3"]) == 0
    assert seen[1][1] == 8 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("text", "expected"), [('"off"', False), ('"on"', True), ('"auto"', None), ("null", None),
                                                ("true", True), ("false", False)])
def test_activation_checkpointing_in_a_config_file(tmp_path: Path, text: str, expected: bool | None) -> None:
    from kernelguard.train.settings.config_cli import parse_args as parse

    config = tmp_path / "run.yaml"
    config.write_text(f"activation_checkpointing: {text}\n")
    cfg = parse(["--config", str(config), "--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o")])
    assert cfg.runtime.activation_checkpointing is expected


def test_activation_checkpointing_typo_in_a_config_file(tmp_path: Path) -> None:
    from kernelguard.train.settings.config_cli import parse_args as parse

    config = tmp_path / "run.yaml"
    config.write_text('activation_checkpointing: "maybe"\n')
    with pytest.raises(ConfigError, match="activation_checkpointing is 'maybe'; expected auto \\(the default\\), on or off"):
        parse(["--config", str(config), "--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o")])


def test_a_saved_config_with_the_old_setting_names_still_loads(tmp_path: Path) -> None:
    """train_config.json files written before the settings were named like their flags."""
    old = {"model": "m", "data": "d", "output": str(tmp_path / "o"), "lr": 0.002, "betas": [0.8, 0.9],
           "block_size": 64, "grad_accum": 2, "epochs": 3, "grad_clip": 0.5, "save_every": 7}  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    new = config_dict(parse_command(["--config", str(path)]).config)
    assert (new["learning_rate"], new["adam_betas"], new["max_length"], new["output_dir"]) == (
        0.002, [0.8, 0.9], 64, str(tmp_path / "o")
    )
    assert (new["gradient_accumulation_steps"], new["num_train_epochs"], new["max_grad_norm"], new["save_steps"]) == (
        2, 3, 0.5, 7
    )
    path.write_text(json.dumps({**old, "learning_rate": 0.1}))
    with pytest.raises(ConfigError, match="set the same option"):
        parse_command(["--config", str(path)])


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_launcher_counts_may_be_integers_in_a_config_file(tmp_path: Path, suffix: str) -> None:
    """``nproc_per_node: 8`` was refused as "expected a string" (the setting also takes gpu/auto): a number
    is what the command line's ``--nproc-per-node 8`` gives. Other strings still refuse an integer."""
    path = tmp_path / f"c{suffix}"
    sep = ": " if suffix == ".yaml" else " = "
    path.write_text("".join(f"{k}{sep}{v}\n" for k, v in (("nproc_per_node", 64), ("nnodes", 2), ("rdzv_id", 7))))
    cmd = parse_command(["--config", str(path), *_base(tmp_path)])
    assert cmd.launch is not None and (cmd.launch.nproc_per_node, cmd.launch.nnodes, cmd.launch.rdzv_id) == ("64", "2", "7")
    path.write_text(f"nproc_per_node{sep}true\n")
    with pytest.raises(ConfigError, match=r"nproc_per_node is True \(bool\); expected a string"):
        parse_command(["--config", str(path), *_base(tmp_path)])


@pytest.mark.parametrize(("name", "text", "where"), [
    ("dup.yaml", "max_steps: 3\nlearning_rate: 1.0e-4\nmax_steps: 5\n", " (lines 1 and 3;"),
    ("dup.json", '{"max_steps": 3, "max_steps": 5}', " (only one"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path: Path, name: str, text: str, where: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_command(["--model", "m", "--data", "d", "--config", str(tmp_path / name)])
    assert f"not valid {name.split('.')[1].upper()}: the key 'max_steps' is given twice{where}" in info.value.message


def test_a_tilde_in_a_config_file_path_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "run.yaml").write_text("output_dir: ~/runs/a\ndata: ~/data.jsonl\nmodel: Qwen/x~y\n")
    cfg = parse_command(["--config", str(tmp_path / "run.yaml")]).config
    assert cfg.checkpoint.output_dir == tmp_path / "home" / "runs" / "a"
    assert cfg.data.data == str(tmp_path / "home" / "data.jsonl") and cfg.model.model == "Qwen/x~y"


def test_a_yaml_merge_key_is_accepted_and_a_repeated_key_still_refused(tmp_path: Path) -> None:
    """``<<:`` takes keys from another mapping, and a key beside it overrides the merged one (YAML's merge
    spec): neither is a repeated key."""
    path = _write(tmp_path, "merge.yaml", (
        "<<: &common\n  learning_rate: 3.0e-4\n  max_length: 256\n"
        "model: m\ndata: d\noutput_dir: {out}\nlearning_rate: 1.0e-3\n"
    ))  # fmt: skip
    cfg = parse_command(["--config", str(path)]).config
    assert (cfg.optimizer.learning_rate, cfg.packing.max_length) == (1e-3, 256)
    again = _write(tmp_path, "again.yaml", "model: m\nseed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match=re.escape("the key 'seed' is given twice (lines 2 and 3")):
        parse_command(["--config", str(again), *_base(tmp_path)])


@pytest.mark.parametrize(
    "flag", ["--output-dir", "--profile-trace", "--tokenizer", "--eval-data", "--chat-template", "--lock"]
)
def test_an_empty_path_flag_is_refused_not_taken_for_the_current_folder(tmp_path: Path, flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_command([*_base(tmp_path), flag, ""])
    name = flag[2:].replace("-", "_")
    assert info.value.message == (
        f"{name} is empty; it must name a path (an unset shell variable gives an empty argument)."
    )
    assert info.value.fix == f"pass {flag} with a path"
    with pytest.raises(ConfigError, match=re.escape("--config is empty; it must name a file")):
        parse_command([*_base(tmp_path), "--config", ""])
