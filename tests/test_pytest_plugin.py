"""The pytest plugin, driven through pytester (in-process runs: pytester restores sys.modules after each)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# In-process pytester runs drop modules first imported inside them, and torch's C extension must never be
# imported twice in one process: import both before any inner run.
import torch
import transformers  # noqa: F401

pytest_plugins = ["pytester"]
# The outer run must not arm tripwires around the inner runs.
pytestmark = pytest.mark.kernelguard(False)

TESTS_DIR = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
"""

SWALLOWING_TEST = """
import torch
import tiny_models
from kernelguard.errors import KernelFallbackError

def test_swallows():
    model = tiny_models.tiny_model("qwen3_5")
    try:
        model(torch.randint(0, 256, (1, 8)))
    except KernelFallbackError:
        pass  # a test that catches the error must still fail
"""

GUARDED_TEST = """
import torch
import tiny_models
import kernelguard

def test_guarded_forward():
    model = tiny_models.tiny_model("qwen3_5")
    with kernelguard.guard(model, strict=False):
        model(torch.randint(0, 256, (1, 8)))
"""

ALLOWED_TEST = """
import pytest
import torch
import tiny_models

@pytest.mark.kernelguard(allow=["chunk_gated_delta_rule", "causal_conv1d_fn"])
def test_allowed():
    tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))

@pytest.mark.kernelguard(False)
def test_opted_out():
    tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))

def test_not_allowed():
    tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))
"""

FIXTURE_TEST = """
import pytest
import torch
import tiny_models

@pytest.fixture
def warmed():
    model = tiny_models.tiny_model("qwen3_5")
    try:
        model(torch.randint(0, 256, (1, 8)))
    except Exception:
        pass
    return model

def test_uses_fixture(warmed):
    assert warmed is not None
"""


@pytest.fixture(scope="module")
def _warm_imports() -> None:
    """Load every module a tiny forward pulls in (torch submodules included) before the in-process runs."""
    import tiny_models

    tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))


@pytest.fixture
def inner(pytester: pytest.Pytester, _warm_imports: None) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    return pytester


def test_disabled_by_default_lets_a_fallback_pass(inner: pytest.Pytester) -> None:
    inner.makepyfile(SWALLOWING_TEST)
    result = inner.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("kernelguard:*")


def test_swallowed_fallback_fails_the_test_with_layer_kernel_and_fix(inner: pytest.Pytester) -> None:
    inner.makepyfile(SWALLOWING_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        ("*KernelFallbackError: kernelguard: the torch reference path of causal_conv1d_fn, chunk_gated_delta_rule "
         "ran during setup or the test call (2 kernel(s), 6 call site(s), 6 call(s))"),
        "*causal_conv1d_fn: `import causal_conv1d` failed: ModuleNotFoundError: No module named 'causal_conv1d'",
        "*model.layers.0.linear_attn -> transformers.models.qwen3_5.modeling_qwen3_5.causal_conv1d_fn (1 call)",
        "*chunk_gated_delta_rule: `import fla.ops.gated_delta_rule` failed: *No module named 'fla'",
        "*even if it caught the error*",
        "*pip install causal-conv1d --no-build-isolation*",
    ])


def test_guarded_model_error_names_the_layer_path(inner: pytest.Pytester) -> None:
    inner.makepyfile(GUARDED_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*model.layers.0.linear_attn entered the torch reference path*"])


def test_allow_marker_opt_out_marker_and_default(inner: pytest.Pytester) -> None:
    inner.makepyfile(ALLOWED_TEST)
    result = inner.runpytest("--kernelguard", "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_allowed PASSED*", "*test_opted_out PASSED*", "*test_not_allowed FAILED*"])


def test_ini_options_enable_and_allow(inner: pytest.Pytester) -> None:
    inner.makepyfile(ALLOWED_TEST)
    inner.makeini("[pytest]\nkernelguard = true\nkernelguard_allow =\n    chunk_gated_delta_rule\n"
                  "    causal_conv1d_fn\n")
    result = inner.runpytest()
    result.assert_outcomes(passed=3)


def test_marker_alone_enables_for_that_test(inner: pytest.Pytester) -> None:
    inner.makepyfile(SWALLOWING_TEST.replace("def test_swallows", "@pytest.mark.kernelguard\ndef test_swallows")
                     .replace("import torch", "import pytest\nimport torch", 1))
    inner.runpytest().assert_outcomes(failed=1)


def test_fallback_in_a_fixture_fails_the_test(inner: pytest.Pytester) -> None:
    inner.makepyfile(FIXTURE_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kernelguard: the torch reference path of * ran during setup or the test call*"])


def test_report_header_shows_resolved_providers(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_nothing():\n    pass\n")
    result = inner.runpytest("--kernelguard", "--kernelguard-allow", "attention")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "kernelguard: enabled (allow: attention)",
        "kernelguard providers: *",
    ])


def test_plugin_import_is_cheap() -> None:
    code = (
        "import sys, kernelguard.pytest_plugin, kernelguard.guard\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
