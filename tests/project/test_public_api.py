"""Every public name of ``kernelguard`` stays what it is, however often and in whatever order it is used."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kernelguard
from kernelguard.errors import ResolutionError
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.resolution.terms import allow_hint, in_terms, option_hint
from kernelguard.stack.report import render

ORDERS = {
    "require-then-check": ["require", "check", "require", "check"],
    "check-then-require": ["check", "require", "check", "require"],
    "submodule-import-first": ["import", "require", "check", "require"],
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_public_functions_stay_callable_in_any_order(order: str) -> None:
    # A fresh interpreter: the bug this guards against depends on which import happens first.
    steps = "\n".join(
        "import kernelguard.stack.api, kernelguard.stack.compose, kernelguard.runtime.model_guard, kernelguard.cli" if step == "import"
        else f"r = kernelguard.{step}('qwen3_5', mode='training', packed=False, arch='9.0', allow=['chunk_gated_delta_rule', "
        f"'causal_conv1d_fn', 'attention'])\nassert r.ok, r"
        for step in ORDERS[order]
    )
    code = textwrap.dedent(
        """
        import kernelguard
        """
    ) + steps + textwrap.dedent(
        """
        import types
        for name in kernelguard.__all__:
            assert not isinstance(getattr(kernelguard, name), types.ModuleType), name
        assert callable(kernelguard.guard) and callable(kernelguard.require) and callable(kernelguard.check)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_dir_lists_the_public_api_and_not_the_imports() -> None:
    import kernelguard

    names = dir(kernelguard)
    assert {"require", "guard", "inspect", "check", "KernelFallbackError", "__version__"} <= set(names)
    assert not {"sys", "types", "Any", "TYPE_CHECKING"} & set(names), names


def test_import_kernelguard_does_not_import_torch() -> None:
    code = "import sys, kernelguard; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, "False"), proc.stderr


# ------------------------------------------------------------------------------ the caller's terms ---
CLI_FLAG = re.compile(r"(?<![\w-])--(?:allow|arch|no-packed|packed|hub|model)\b")


def _outside_backticks(text: str) -> str:
    return "".join(text.split("`")[0::2])


def test_one_vocabulary_spelled_for_each_caller() -> None:
    assert allow_hint(["attention", "fla-640-refusal"], "cli") == "--allow attention --allow fla-640-refusal"
    assert allow_hint(["attention"], "python") == "allow=['attention']"
    assert allow_hint(["attention"], "pytest") == "@pytest.mark.kernelguard(allow=['attention'])"
    assert allow_hint(["attention"], "pytest-option") == "--kernelguard-allow attention"
    assert allow_hint(["a", "b"], "pytest-ini") == "kernelguard_allow =\n    a\n    b"
    assert option_hint("packed", False, "cli") == "--no-packed"
    assert option_hint("packed", False, "python") == "packed=False"
    assert option_hint("arch", "9.0", "python") == "arch='9.0'"
    cli = ("pass --arch, e.g. --arch 9.0; or check unpacked training with --no-packed; allowed by --allow "
           "attention. (exit 1); run `kernelguard check --run --allow fla-640-wrong-grads` first")
    assert in_terms(cli, "cli") == cli
    assert in_terms(cli, "python") == (
        "pass arch=, e.g. arch='9.0'; or check unpacked training with packed=False; allowed by allow=['attention']."
        "; run `kernelguard check --run --allow fla-640-wrong-grads` first"  # a quoted command stays a command
    )
    assert in_terms("accept with --allow attention.", "pytest") == "accept with --kernelguard-allow attention."


def test_varlen_attention_is_the_same_allow_item_as_attention() -> None:
    policy = AllowPolicy.parse(["varlen_attention"])
    assert policy.allows_attention() and policy.values() == ["attention"]
    assert AllowPolicy.parse(["attention"]) == policy


def test_comma_joined_allow_items_are_each_read_everywhere(tmp_path: Path) -> None:
    """--allow a,b (as KERNELGUARD_ALLOW is written) was one unknown item, and its fix dropped one kernel."""
    from kernelguard.train.settings.config_cli import parse_args

    joined = AllowPolicy.parse(["causal_conv1d_fn, chunk_gated_delta_rule", "attention"])
    assert joined == AllowPolicy.parse(["causal_conv1d_fn", "chunk_gated_delta_rule", "attention"])
    cfg = parse_args(["--model", "m", "--data", "d", "--output-dir", str(tmp_path),
                      "--allow", "causal_conv1d_fn,chunk_gated_delta_rule"])
    assert AllowPolicy.parse(cfg.runtime.allow, source="--allow") == AllowPolicy.parse(
        ["causal_conv1d_fn", "chunk_gated_delta_rule"])
    with pytest.raises(kernelguard.ConfigError, match="'chunk_gated_delta_rul' is not a known"):
        AllowPolicy.parse("causal_conv1d_fn,chunk_gated_delta_rul")  # each item still checked


def test_require_speaks_python_and_offers_allow_only_where_it_helps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELGUARD_ARCH", raising=False)
    monkeypatch.delenv("KERNELGUARD_ALLOW", raising=False)
    result = kernelguard.check("qwen3_5", mode="training")
    if result.ok or {v.kernel for v in result.resolution.verdicts if not v.ok} != {
        "causal_conv1d_fn", "chunk_gated_delta_rule", "varlen_attention"
    }:
        pytest.skip("needs a machine without fla, causal-conv1d and a varlen attention (CPU CI)")
    with pytest.raises(ResolutionError) as info:
        kernelguard.require("qwen3_5", mode="training", allow=["chunk_gated_delta_rule"])
    text = str(info.value)
    assert info.value.message.startswith("kernelguard.require('qwen3_5', mode='training', packed=True): FAIL")
    assert not CLI_FLAG.findall(_outside_backticks(text)), CLI_FLAG.findall(_outside_backticks(text))
    assert "(exit" not in text
    assert "unknown (unknown" not in text and "GPU arch unknown (no GPU visible, no arch= given)" in text
    # Packed training: the GDN torch references cannot be allowed; attention can; padded batches are offered.
    fix = info.value.fix or ""
    assert "allow=['attention']" in fix and "chunk_gated_delta_rule'" not in fix
    assert "packed=False" in fix
    assert "fix: install a fast provider above, or check unpacked training with packed=False" in text
    # The same check from the CLI keeps its own terms.
    assert "--arch 9.0" in render(result) and "(exit 1)" in render(result)
