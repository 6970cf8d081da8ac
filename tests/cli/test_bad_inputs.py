"""Every bad input through the real entry points is one clear error: exit code, one line, the fix — never a traceback.

Table-driven: each row is a class of mistake a new user makes. `kernelguard check` rows run ``kernelguard.cli.main``
in-process (the same function the console script calls) with the cwd set, plus a subprocess sample to prove
the console script agrees; API rows call the public functions. Training rows live next to the trainer's tests
(tests/test_train_*.py) because they need a tokenizer and data files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kernelguard
from kernelguard.cli import main

Setup = Callable[[Path], list[str]]


def _config(body: object) -> Setup:
    def make(folder: Path) -> list[str]:
        (folder / "config.json").write_text(json.dumps(body) if not isinstance(body, str) else body)
        return ["check", "--model", str(folder / "config.json"), "--arch", "9.0"]

    return make


def _pyproject(text: str) -> Setup:
    def make(folder: Path) -> list[str]:
        (folder / "pyproject.toml").write_text(text)
        return ["check"]

    return make


QWEN = {"model_type": "qwen3_5_text"}

# name -> (setup, first line of stderr, starts with)
CHECK_CASES: dict[str, tuple[Setup, str]] = {
    "arch-not-a-number": (lambda p: ["check", "--arch", "banana"],
                          "kernelguard: error: --arch 'banana' is not a compute capability"),
    "arch-no-gpu-has": (lambda p: ["check", "--arch", "9.5"],
                        "kernelguard: error: --arch '9.5' is not the compute capability of a real NVIDIA GPU."),
    "arch-absurd": (lambda p: ["check", "--arch", "900"],
                    "kernelguard: error: --arch '900' is not the compute capability of a real NVIDIA GPU."),
    "arch-suffix-too-old": (lambda p: ["check", "--arch", "sm_80a"],
                            "kernelguard: error: --arch 'sm_80a' is not a capability with an 'a' variant"),
    "allow-typo": (lambda p: ["check", "--allow", "fla640"],
                   "kernelguard: error: --allow: 'fla640' is not a known issue ID, kernel name or policy."),
    "allow-kernel-typo": (lambda p: ["check", "--allow", "chunk_gated_delta_rul"],
                          "kernelguard: error: --allow: 'chunk_gated_delta_rul' is not a known issue ID"),
    "model-unknown": (lambda p: ["check", "--model", "qwen9"], "kernelguard: error: unknown model 'qwen9'"),
    "model-empty": (lambda p: ["check", "--model", ""], "kernelguard: error: model must be a family name"),
    "model-dir-without-config": (lambda p: ["check", "--model", str(p)], "kernelguard: error: "),
    "config-not-json": (_config("{not json"), "kernelguard: error: could not read model config"),
    "config-a-list": (_config([1, 2]), "kernelguard: error: "),
    "config-binary": (_config("\udcff") if False else (lambda p: (p.joinpath("config.json").write_bytes(b"\xff\xfe\x00"),
                      ["check", "--model", str(p / "config.json")])[1]), "kernelguard: error: could not read model config"),
    "config-model-type-list": (_config({"model_type": ["qwen3_5"]}), "kernelguard: error: model_type in "),
    "config-model-type-unrelated": (_config({"model_type": "bert"}), "kernelguard: error: model_type 'bert' in "),
    "config-head-dim-string": (_config({**QWEN, "linear_key_head_dim": "128"}),
                               "kernelguard: error: linear_key_head_dim in "),
    "config-head-dim-negative": (_config({**QWEN, "linear_key_head_dim": -64}),
                                 "kernelguard: error: linear_key_head_dim in "),
    "config-head-dim-bool": (_config({**QWEN, "linear_key_head_dim": True}),
                             "kernelguard: error: linear_key_head_dim in "),
    "config-heads-absurd": (_config({**QWEN, "linear_num_value_heads": 10**9}),
                            "kernelguard: error: linear_num_value_heads in "),
    "config-text-config-not-object": (_config({"model_type": "qwen3_5", "text_config": "x"}),
                                      "kernelguard: error: text_config in "),
    "config-layer-types-string": (_config({**QWEN, "layer_types": "linear_attention"}),
                                  "kernelguard: error: layer_types in "),
    "pyproject-bad-toml": (_pyproject("[tool.kernelguard\n"), "kernelguard: error: could not read "),
    "pyproject-tool-not-table": (_pyproject("tool = 5\n"), "kernelguard: error: `tool` in "),
    "pyproject-section-not-table": (_pyproject("[tool]\nkernelguard = 3\n"),
                                    "kernelguard: error: [tool.kernelguard] in "),
    "pyproject-unknown-key": (_pyproject("[tool.kernelguard]\narchs = ['9.0']\n"),
                              "kernelguard: error: unknown key(s) archs in [tool.kernelguard]"),
    "pyproject-arch-number": (_pyproject("[tool.kernelguard]\narch = 9.0\n"),
                              "kernelguard: error: [tool.kernelguard] arch in "),
    "pyproject-arch-no-gpu": (_pyproject("[tool.kernelguard]\narch = ['7.7']\n"),
                              "kernelguard: error: arch of [tool.kernelguard] in "),
    "pyproject-allow-typo": (_pyproject("[tool.kernelguard]\nallow = ['atention']\n"),
                             "kernelguard: error: allow of [tool.kernelguard] in "),
    "pyproject-mode-typo": (_pyproject("[tool.kernelguard]\nmode = 'train'\n"),
                            "kernelguard: error: [tool.kernelguard] mode in "),
    "pyproject-packed-string": (_pyproject("[tool.kernelguard]\npacked = 'yes'\n"),
                                "kernelguard: error: [tool.kernelguard] packed in "),
    "flag-unknown": (lambda p: ["check", "--archs", "9.0"],
                     "kernelguard check: error: unrecognized argument --archs; did you mean --arch?"),
    "mode-unknown": (lambda p: ["check", "--mode", "train"], "kernelguard check: error: --mode: 'train' is not one"),
}


@pytest.mark.parametrize("name", list(CHECK_CASES))
def test_check_bad_input_is_one_clear_error(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    setup, first_line = CHECK_CASES[name]
    argv = setup(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(first_line), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("name", ["arch-no-gpu-has", "config-head-dim-negative", "pyproject-tool-not-table"])
def test_console_script_agrees(name: str, tmp_path: Path) -> None:
    setup, first_line = CHECK_CASES[name]
    argv = setup(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's kernelguard, not an install
    proc = subprocess.run([sys.executable, "-m", "kernelguard", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0].startswith(first_line), proc.stderr


API_CASES: dict[str, tuple[Callable[[], object], str]] = {
    "check-model-int": (lambda: kernelguard.check(5), "model must be a family name"),  # type: ignore[arg-type]
    "check-mode-typo": (lambda: kernelguard.check(mode="train"), "mode must be one of training, inference"),
    "check-packed-string": (lambda: kernelguard.check(packed="yes"), "packed must be True or False"),  # type: ignore[arg-type]
    "check-arch-object": (lambda: kernelguard.check(arch=object()), "arch= <object"),  # type: ignore[arg-type]
    "check-arch-no-gpu": (lambda: kernelguard.check(arch="9.5"), "arch= '9.5' is not the compute capability"),
    "check-allow-int": (lambda: kernelguard.check(allow=5), "allow=: a int (5) is not"),  # type: ignore[arg-type]
    "require-allow-typo": (lambda: kernelguard.require(allow=["fla640"]), "allow=: 'fla640' is not a known"),
    # "no" is truthy: require() once read it as hub=True and checked the Hub path
    "require-hub-string": (lambda: kernelguard.require(hub="no"), "hub must be True or False, found 'no'"),  # type: ignore[arg-type]
    "require-unknown-model": (lambda: kernelguard.require("zzzz"), "unknown model 'zzzz': not a family"),
    "guard-a-string": (lambda: kernelguard.guard("model"), "expected a torch.nn.Module"),  # type: ignore[arg-type]
    "guard-an-object": (lambda: kernelguard.guard(object()), "expected a torch.nn.Module"),
    "guard-plain-sequential": (lambda: kernelguard.guard(__import__("torch").nn.Sequential()),
                               "no gated-delta call sites found"),
    "guard-allow-typo": (lambda: kernelguard.guard(__import__("torch").nn.Sequential(), allow=["fla640"]),
                         "'fla640' is not a known issue ID"),
}


@pytest.mark.parametrize("name", list(API_CASES))
def test_api_bad_input_raises_config_error(name: str) -> None:
    call, contains = API_CASES[name]
    with pytest.raises(kernelguard.ConfigError) as info:
        call()
    assert contains in str(info.value)
    assert info.value.fix


def test_a_model_typo_is_fixed_in_python_terms_for_python_callers() -> None:
    for call in (kernelguard.check, kernelguard.require):
        with pytest.raises(kernelguard.ConfigError) as info:
            call("qwen3_55")
        assert info.value.fix == "model='qwen3_5'" and "--model" not in str(info.value), str(info.value)


def test_require_reads_kernelguard_allow_and_arch_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELGUARD_ARCH", "sm_90, 8.0")
    monkeypatch.setenv("KERNELGUARD_ALLOW", "chunk_gated_delta_rule,causal_conv1d_fn, attention")
    result = kernelguard.require("qwen3_5", packed=False)
    assert [str(a) for a in result.resolution.target.archs] == ["9.0", "8.0"]
    assert result.resolution.target.allow.values() == ["attention", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    # An explicit arch= wins over the environment.
    assert [str(a) for a in kernelguard.check("qwen3_5", arch="10.0").resolution.target.archs] == ["10.0"]


@pytest.mark.parametrize(("name", "value", "message"), [
    ("KERNELGUARD_ALLOW", "fla640", "KERNELGUARD_ALLOW: 'fla640' is not a known issue ID"),
    ("KERNELGUARD_ARCH", "9.5", "KERNELGUARD_ARCH '9.5' is not the compute capability of a real NVIDIA GPU."),
])
def test_bad_environment_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str,
                                                  message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(kernelguard.ConfigError) as info:
        kernelguard.require("qwen3_5")
    assert str(info.value).startswith(message)
