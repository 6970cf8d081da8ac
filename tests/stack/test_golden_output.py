"""`kernelguard check`'s text and JSON on made-up systems, compared byte for byte with tests/golden/.

A refactor must not change what users and their scripts read. The systems are built from facts (no probing), so
the output depends only on kernelguard and on the installed transformers' family table, whose version-specific
parts (its own version, the Hub repo version it pins) are normalised. A deliberate output change regenerates the
files with ``KERNELGUARD_UPDATE_GOLDEN=1 pytest tests/stack/test_golden_output.py`` and shows up in review as a diff.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from check_helpers import UNDEFINED_SYMBOL, make_env, make_ext, make_pkg

from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.facts import Facts
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.resolution.resolver import Target, resolve
from kernelguard.stack import report
from kernelguard.stack.compose import CheckOptions, CheckResult

GOLDEN = Path(__file__).parents[1] / "golden"
WINDOW = ("0.18.2", "0.19.0")
MIN_VERSIONS = {"fla": "0.2.2", "causal_conv1d": None, "mamba_ssm": None, "flash_attn": "2.3.3"}
MISSING_FLASH = make_pkg("flash_attn", None, import_error="ModuleNotFoundError: No module named 'flash_attn'")


def _facts(*, gpus: tuple[str, ...] = ("9.0",), fla: Any = "0.6.0", conv: Any = ("sm_90",), **env: Any) -> Facts:
    packages = {"flash_attn": MISSING_FLASH}
    if isinstance(fla, str):
        packages["fla.ops.gated_delta_rule"] = make_pkg("fla", fla)
    elif fla is not None:
        packages["fla.ops.gated_delta_rule"] = fla
    if isinstance(conv, tuple):
        packages["causal_conv1d"] = make_pkg("causal_conv1d", "1.6.0", extensions=(make_ext(conv),))
    elif conv is not None:
        packages["causal_conv1d"] = conv
    return Facts(
        env=make_env(gpus=gpus, **env),
        packages=packages,
        kernels_window=WINDOW,
        transformers_min_versions=MIN_VERSIONS,
        torch_varlen_attention=True,
    )


def _missing(module: str, name: str) -> Any:
    return make_pkg(name, None, import_error=f"ModuleNotFoundError: No module named '{module}'")


SCENARIOS: dict[str, tuple[Facts, str, bool, tuple[str, ...], tuple[str, ...]]] = {
    # name: (facts, mode, packed, archs, allow)
    "hopper_all_served": (_facts(), "training", True, ("9.0",), ()),
    "cpu_build_nothing_installed": (
        _facts(gpus=(), fla=_missing("fla", "fla"), conv=_missing("causal_conv1d", "causal_conv1d"), cuda=None),
        "training", True, (), (),
    ),
    "fla_640_triton_3_6": (_facts(triton="3.6.0"), "training", True, ("9.0",), ()),
    # torch 2.11 pins triton==3.6.0: the fix is a newer torch (or tilelang), never a Triton torch does not accept.
    "fla_640_torch_2_11": (_facts(torch="2.11.0", triton="3.6.0"), "training", True, ("9.0",), ()),
    "fla_640_allowed": (_facts(triton="3.6.0"), "training", True, ("9.0",), ("fla-640-refusal",)),
    "conv_without_sm_90": (_facts(conv=("sm_80",)), "training", True, ("9.0",), ()),
    "conv_undefined_symbol": (
        _facts(conv=make_pkg("causal_conv1d", "1.6.0", extensions=(make_ext(load_error=UNDEFINED_SYMBOL),))),
        "training", True, ("9.0",), (),
    ),
    "inference_fallbacks_allowed": (
        _facts(gpus=(), fla=_missing("fla", "fla"), conv=_missing("causal_conv1d", "causal_conv1d")),
        "inference", False, (), ("causal_conv1d_fn", "causal_conv1d_update", "chunk_gated_delta_rule",
                                 "fused_recurrent_gated_delta_rule"),
    ),
    "kernels_outside_window": (_facts(kernels="0.17.2"), "training", True, ("9.0",), ()),
}


def _result(name: str) -> CheckResult:
    facts, mode, packed, archs, allow = SCENARIOS[name]
    source = discovery.transformers_source()
    spec = discovery.resolve_model("qwen3_5", source)
    requirements = catalog.requirements(spec, mode, packed=packed, transformers_version="5.23.0")
    policy = AllowPolicy.parse(allow)
    target = Target(archs=archs, arch_source="--arch" if archs else "no GPU visible, no --arch", allow=policy)
    options = CheckOptions(mode=mode, archs=archs, allow=allow, packed=packed)
    return CheckResult(options, facts.env, resolve(facts, requirements, target), spec.origin)


def _normalise(text: str) -> str:
    # The only version-specific facts of the installed transformers that reach this output.
    return re.sub(r"\(version \d+\)", "(version N)", text)


def _compare(path: Path, actual: str) -> None:
    if os.environ.get("KERNELGUARD_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual, encoding="utf-8")
    expected = path.read_text(encoding="utf-8")
    assert actual == expected, f"{path.name} changed; if deliberate, regenerate with KERNELGUARD_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_text_is_unchanged(name: str) -> None:
    _compare(GOLDEN / f"{name}.txt", _normalise(report.render(_result(name), width=100)) + "\n")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_json_is_unchanged(name: str) -> None:
    data = json.loads(report.to_json(_result(name)))
    _compare(GOLDEN / f"{name}.json", _normalise(json.dumps(data, indent=2, sort_keys=True)) + "\n")


def test_scenarios_cover_pass_and_fail() -> None:
    verdicts = {name: _result(name).ok for name in SCENARIOS}
    assert verdicts["hopper_all_served"] and verdicts["fla_640_allowed"] and verdicts["inference_fallbacks_allowed"]
    assert not any(verdicts[n] for n in ("cpu_build_nothing_installed", "fla_640_triton_3_6", "fla_640_torch_2_11",
                                          "conv_without_sm_90",
                                          "conv_undefined_symbol"))


def _golden_fixes() -> list[str]:
    """Every fix command of every golden output: JSON ``fix`` values and the text's ``fix:`` / ``or:`` lines."""
    found: list[str] = []
    for path in sorted(GOLDEN.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        for kernel in data["kernels"]:
            for candidate in kernel["candidates"]:
                assert set(candidate) >= {"fix", "fix_note"}, path.name
                if candidate["fix"] is not None:
                    found.append(candidate["fix"])
    for path in sorted(GOLDEN.glob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            head, _, command = line.strip().partition(" ")
            if head in ("fix:", "or:") and re.match(r"(pip|python|uv|hf|[A-Z_]+=)", command):
                found.append(command)
    return found


def test_every_golden_fix_is_one_runnable_shell_command() -> None:
    fixes = _golden_fixes()
    assert len(fixes) > 20 and any("causal-conv1d" in f for f in fixes)
    for fix in dict.fromkeys(fixes):
        r = subprocess.run(["bash", "-n", "-c", fix], capture_output=True, text=True, check=False)
        assert r.returncode == 0, (fix, r.stderr)
        assert "  (" not in fix and "; or " not in fix and not fix.endswith((".", ")")), fix  # no prose left in


@pytest.mark.parametrize("width", [80, 100, 140])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_text_fits_the_width_commands_included(name: str, width: int) -> None:
    """A command wider than the width is broken between arguments with ` \\` (it still pastes); only one word
    that cannot be broken (a URL) may pass the width, alone on its line."""
    for line in report.render(_result(name), width=width).splitlines():
        assert len(line) <= width or " " not in line.strip(), line


def test_a_broken_fix_command_pastes_as_the_same_command() -> None:
    command = "pip install setuptools wheel ninja packaging && pip install --no-build-isolation 'causal-conv1d==1.7.0'"
    lines = report.fix_lines(command, width=60, indent=18)
    assert lines == [
        "                  fix: pip install setuptools wheel ninja \\",
        "                           packaging && pip install \\",
        "                           --no-build-isolation \\",
        "                           'causal-conv1d==1.7.0'",
    ]
    assert " ".join(line.strip().removesuffix("\\").strip() for line in lines) == "fix: " + command


def test_check_text_follows_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "72")
    narrow = report.render(_result("cpu_build_nothing_installed"))
    monkeypatch.delenv("COLUMNS")
    assert narrow == report.render(_result("cpu_build_nothing_installed"), width=72)


def test_docs_check_md_example_is_an_excerpt_of_the_golden_output() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "check.md").read_text(encoding="utf-8")
    section = doc.split("## Example (CPU machine, nothing installed)", 1)[1]
    quoted = re.split(r"\n\.\.\.\n|\n\n", section.split("```\n", 2)[1].rstrip("\n"))
    golden = (GOLDEN / "cpu_build_nothing_installed.txt").read_text(encoding="utf-8").replace(
        "(version N)", "(version 2)"
    )
    position = 0
    assert len(quoted) == 3
    for part in quoted:  # each block verbatim, in order
        position = golden.index(part, position) + len(part)
