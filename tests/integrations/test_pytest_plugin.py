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
from check_helpers import COMMANDS

pytest_plugins = ["pytester"]
# The outer run must not arm tripwires around the inner runs.
pytestmark = pytest.mark.kernelguard(False)

TESTS_DIR = Path(__file__).resolve().parents[1]

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


def _failures_section(result: pytest.RunResult) -> str:
    """The FAILURES section only: the short summary after it repeats each failure's title line."""
    return result.stdout.str().split("short test summary info", 1)[0]


def _summary_lines(result: pytest.RunResult) -> list[str]:
    """The short test summary's lines, without its header and the final counts."""
    return [line for line in result.stdout.str().split("short test summary info", 1)[1].splitlines()[1:-1] if line]


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
        f"*{COMMANDS['causal_conv1d']}*",
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
        "import sys, kernelguard.integrations.pytest_plugin, kernelguard.runtime.model_guard\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------------------- suite scale (issue 14) ---
SCAN_COUNTING_TEST = """
import pytest
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401
from kernelguard.runtime.registry import REGISTRY

SCANS = []

@pytest.mark.parametrize("i", range(50))
def test_many(i):
    SCANS.append(REGISTRY.scan.scans)
    if i % 2:
        pytest.skip("half of them skip, like transformers' CPU runs")

def test_zz_counts():
    # Every module was scanned in the first test's setup; the 49 after it re-armed from the cache.
    assert len(SCANS) == 50 and len(set(SCANS)) == 1, SCANS
"""

TWO_FORWARDS_TEST = """
import torch
import tiny_models

def test_two_forwards():
    model = tiny_models.tiny_model("qwen3_5")
    for _ in range(2):
        model(torch.randint(0, 256, (1, 8)))
"""

SKIP_AFTER_FORWARD_TEST = """
import unittest
import pytest
import torch
import tiny_models

class GdnTest(unittest.TestCase):
    def test_forward_then_skip_test(self):
        tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))
        self.skipTest("not on CPU")

def test_forward_then_pytest_skip():
    tiny_models.tiny_model("qwen3_5")(torch.randint(0, 256, (1, 8)))
    pytest.skip("not on CPU")

class PlainTest(unittest.TestCase):
    def test_skip_first(self):
        self.skipTest("skipped before any forward")
"""


def test_scan_cache_scans_each_module_once_across_50_tests(inner: pytest.Pytester) -> None:
    from kernelguard.runtime.registry import REGISTRY

    REGISTRY.reset()  # a cold cache, as in a fresh pytest process
    inner.makepyfile(SCAN_COUNTING_TEST)
    before = REGISTRY.scan.scans
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(passed=26, skipped=25)
    modeling = [n for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n]
    assert REGISTRY.scan.scans - before == len(modeling), "each loaded modeling module is scanned exactly once"
    rerun = REGISTRY.scan.scans
    inner.runpytest("--kernelguard").assert_outcomes(passed=26, skipped=25)
    assert REGISTRY.scan.scans == rerun, "a second session in this process re-scans nothing"


def test_one_message_names_every_kernel_each_site_once_with_counts(inner: pytest.Pytester) -> None:
    inner.makepyfile(TWO_FORWARDS_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        ("*the torch reference path of causal_conv1d_fn, chunk_gated_delta_rule ran during setup or the test call "
         "(2 kernel(s), 6 call site(s), 12 call(s))"),
        "*  causal_conv1d_fn: `import causal_conv1d` failed*",
        "*    model.layers.0.linear_attn -> transformers.models.qwen3_5.modeling_qwen3_5.causal_conv1d_fn (2 calls)",
        "*    model.layers.1.linear_attn -> *causal_conv1d_fn (2 calls)",
        "*    model.layers.2.linear_attn -> *causal_conv1d_fn (2 calls)",
        "*  chunk_gated_delta_rule: `import fla.ops.gated_delta_rule` failed*",
        "*    model.layers.2.linear_attn -> *torch_chunk_gated_delta_rule (2 calls)",
    ])
    site_lines = [line.strip() for line in _failures_section(result).splitlines() if " -> transformers.models." in line]
    assert len(site_lines) == 6 and len(set(site_lines)) == 6, "each distinct call site exactly once"
    assert not [line for line in result.outlines if "Qwen3_5GatedDeltaNet" in line], "paths, not class names"


def test_fix_is_in_pytest_terms_and_says_cpu_cannot_run_the_kernels(inner: pytest.Pytester) -> None:
    inner.makepyfile(TWO_FORWARDS_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*Fix: this machine has no CUDA device: these kernels cannot run here, the torch reference is the only path.",
        "*CPU CI: allow them in pytest.ini (or [[]tool.pytest.ini_options] in pyproject.toml; anything not listed*",
        "*kernelguard = true",
        "*kernelguard_allow =",
        "*    causal_conv1d_fn",
        "*    chunk_gated_delta_rule",
        ("*(or pytest --kernelguard --kernelguard-allow causal_conv1d_fn --kernelguard-allow chunk_gated_delta_rule, "
         "or @pytest.mark.kernelguard(allow=[[]'causal_conv1d_fn', 'chunk_gated_delta_rule']) on the test)"),
        "*GPU CI (strict: no allow list): install the fast kernels",
        f"*{COMMANDS['causal_conv1d']}*",
        f"*{COMMANDS['fla']}*",
    ])
    result.stdout.no_fnmatch_line("*kernelguard.guard(*")
    result.stdout.no_fnmatch_line("*allow=[[]'causal_conv1d_fn'[]]*")  # the guard() spelling of a single kernel


def test_fix_on_a_cuda_machine_installs_first() -> None:
    from kernelguard.integrations.pytest_plugin import fix_in_pytest_terms

    fix = fix_in_pytest_terms(["chunk_gated_delta_rule"], ["pip install flash-linear-attention"], cuda=True)
    assert fix.splitlines() == [
        "install the fast kernels:",
        "      pip install flash-linear-attention",
        ("  or accept these fallbacks: pytest --kernelguard-allow chunk_gated_delta_rule; or in pytest.ini / "
         "[tool.pytest.ini_options]:"),
        "      kernelguard_allow =",
        "          chunk_gated_delta_rule",
        "  or for this test only: @pytest.mark.kernelguard(allow=['chunk_gated_delta_rule'])",
    ]
    assert "no CUDA device" not in fix


def test_allow_list_recipe_from_the_message_makes_the_suite_pass(inner: pytest.Pytester) -> None:
    inner.makepyfile(TWO_FORWARDS_TEST)
    inner.makeini("[pytest]\nkernelguard = true\nkernelguard_allow =\n    causal_conv1d_fn\n"
                  "    chunk_gated_delta_rule\n")
    inner.runpytest().assert_outcomes(passed=1)


SKIP_CONTRACT = "but only after the torch reference had run: it fails, because the slow path ran"


def test_a_test_that_skips_after_a_forward_fails_by_contract(inner: pytest.Pytester) -> None:
    inner.makepyfile(SKIP_AFTER_FORWARD_TEST)
    result = inner.runpytest("--kernelguard", "-v")
    result.assert_outcomes(failed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "*test_forward_then_skip_test FAILED*",
        "*test_forward_then_pytest_skip FAILED*",
        "*test_skip_first SKIPPED*",
    ])
    assert _failures_section(result).count(SKIP_CONTRACT) == 2


def test_the_skip_message_gives_the_one_line_opt_out_for_both_kinds_of_skip(inner: pytest.Pytester) -> None:
    inner.makepyfile(SKIP_AFTER_FORWARD_TEST)
    failures = _failures_section(inner.runpytest("--kernelguard"))
    assert failures.count(
        "To let it skip, add one line above the test: @pytest.mark.kernelguard(skip_ok=True)") == 2
    assert failures.count("(for every test: kernelguard_skip_ok = true in pytest.ini)") == 2


def test_skip_ok_marker_lets_a_skip_after_a_fallback_stand_and_nothing_else(inner: pytest.Pytester) -> None:
    marked = SKIP_AFTER_FORWARD_TEST.replace("class GdnTest", "@pytest.mark.kernelguard(skip_ok=True)\nclass GdnTest")
    marked = marked.replace("def test_forward_then_pytest_skip", "@pytest.mark.kernelguard(skip_ok=True)\n"
                            "def test_forward_then_pytest_skip")
    marked += (
        "\n@pytest.mark.kernelguard(skip_ok=True)\ndef test_forward_without_skip():\n"
        "    tiny_models.tiny_model('qwen3_5')(torch.randint(0, 256, (1, 8)))\n"
    )
    inner.makepyfile(marked)
    result = inner.runpytest("--kernelguard", "-v")
    result.assert_outcomes(failed=1, skipped=3)
    result.stdout.fnmatch_lines(["*test_forward_then_skip_test SKIPPED*", "*test_forward_then_pytest_skip SKIPPED*",
                                 "*test_forward_without_skip FAILED*"])


def test_skip_ok_ini_option_applies_to_every_test(inner: pytest.Pytester) -> None:
    inner.makepyfile(SKIP_AFTER_FORWARD_TEST)
    inner.makeini("[pytest]\nkernelguard = true\nkernelguard_skip_ok = true\n")
    inner.runpytest().assert_outcomes(skipped=3)


def test_unknown_allow_item_is_a_usage_error_naming_the_nearest_valid_one(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_nothing():\n    pass\n")
    result = inner.runpytest("--kernelguard", "--kernelguard-allow", "chunk_gated_delta_rul")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        ("*--kernelguard-allow: 'chunk_gated_delta_rul' is not a known issue ID, kernel name or policy; "
         "did you mean chunk_gated_delta_rule*"),
    ])


def test_known_issue_id_in_the_ini_is_accepted(inner: pytest.Pytester) -> None:
    inner.makepyfile("def test_nothing():\n    pass\n")
    inner.makeini("[pytest]\nkernelguard = true\nkernelguard_allow =\n    extension-built-for-other-torch\n")
    result = inner.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["kernelguard: enabled (allow: extension-built-for-other-torch)"])


GENERATE_TEST = """
import torch
import tiny_models

def test_generate():
    model = tiny_models.tiny_model("qwen3_5", use_cache=True)
    model.generate(torch.randint(0, 256, (1, 8)), max_new_tokens=3, do_sample=False, pad_token_id=0)
"""


def test_generation_names_the_four_kernels_of_transformers_suite_in_one_message(inner: pytest.Pytester) -> None:
    inner.makepyfile(GENERATE_TEST)
    result = inner.runpytest("--kernelguard")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        ("*the torch reference path of causal_conv1d_fn, chunk_gated_delta_rule, causal_conv1d_update, "
         "fused_recurrent_gated_delta_rule ran during setup or the test call (4 kernel(s), 12 call site(s), *"),
    ])
    text = result.stdout.str()
    decode_site = "model.layers.1.linear_attn -> transformers.models.qwen3_5.modeling_qwen3_5.causal_conv1d_update"
    assert f"{decode_site} (2 calls)" in text
    assert _failures_section(result).count("KernelFallbackError: kernelguard:") == 1


@pytest.mark.parametrize("ci", ["", "true"], ids=["terminal", "ci"])
@pytest.mark.parametrize("source", [SWALLOWING_TEST, SKIP_AFTER_FORWARD_TEST], ids=["raised", "skipped"])
def test_short_summary_and_junit_get_the_title_line_only(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, source: str
) -> None:
    """pytest prints a failure's whole message in the short summary when CI is set (GitHub Actions, GitLab):
    the twenty-line explanation would show twice. The summary and junit's message get the title; the
    FAILURES section and junit's body keep everything."""
    monkeypatch.setenv("CI", ci)
    monkeypatch.delenv("BUILD_NUMBER", raising=False)
    inner.makepyfile(source)
    result = inner.runpytest("--kernelguard", "-rA", "--junitxml=junit.xml")
    summary = _summary_lines(result)
    assert all(line.startswith(("FAILED", "SKIPPED", "PASSED")) for line in summary), f"one line per test: {summary}"
    failed = [line for line in summary if line.startswith("FAILED")]
    assert failed, summary
    if ci:  # untruncated there; in a terminal pytest trims the line to the window width
        assert all(line.endswith(" call(s))") and "the torch reference path of causal_conv1d_fn" in line
                   for line in failed), failed
    assert "import causal_conv1d` failed" in _failures_section(result)
    junit = (inner.path / "junit.xml").read_text()
    assert 'message="kernelguard.errors.KernelFallbackError: kernelguard: the torch' in junit or (
        'message="KernelFallbackError: kernelguard: the torch' in junit), junit
    assert "import causal_conv1d` failed" in junit.split("<failure", 1)[1]


def test_xdist_workers_send_the_one_line_summary_and_the_whole_explanation(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest-xdist ships each report from its worker; pytest's own report types travel intact, anything else
    as a string, which would put the whole explanation back into the summary line."""
    pytest.importorskip("xdist")
    monkeypatch.setenv("CI", "true")
    inner.makepyfile(test_raised=SWALLOWING_TEST, test_skipped=SKIP_AFTER_FORWARD_TEST)
    result = inner.runpytest("--kernelguard", "-n", "2", "-rA")
    result.assert_outcomes(failed=3, skipped=1)
    summary = _summary_lines(result)
    assert len(summary) == 4 and all(line.startswith(("FAILED", "SKIPPED")) for line in summary), summary
    failures = _failures_section(result)
    assert failures.count("import causal_conv1d` failed") == 3
    assert failures.count(SKIP_CONTRACT) == 2


def test_docs_quote_the_skip_after_fallback_message_as_the_plugin_prints_it() -> None:
    from pathlib import Path

    from kernelguard.integrations.pytest_plugin import _contract_line

    docs = (Path(__file__).resolve().parents[2] / "docs" / "pytest.md").read_text()
    for line in _contract_line(skipped=True).splitlines():
        assert line in docs, line


PACKED_ROW_TEST = """
import pytest
import torch
import tiny_models
from transformers import PreTrainedModel  # noqa: F401 - a suite that has transformers loaded at collection

GDN = ["chunk_gated_delta_rule", "causal_conv1d_fn"]
IDS, PACKED = torch.randint(0, 256, (1, 8)), torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])

@pytest.mark.kernelguard(allow=GDN)
def test_packed_row():
    tiny_models.tiny_model("qwen3_5")(IDS, position_ids=PACKED)

@pytest.mark.kernelguard(allow=[*GDN, "packed-without-boundaries"])
def test_packed_row_allowed():
    tiny_models.tiny_model("qwen3_5")(IDS, position_ids=PACKED)

@pytest.mark.kernelguard(allow=GDN)
def test_single_row():
    tiny_models.tiny_model("qwen3_5")(IDS, position_ids=torch.arange(8)[None])
"""


def test_packed_row_without_boundaries_fails_the_test_with_the_fix_in_pytest_terms(inner: pytest.Pytester) -> None:
    inner.makepyfile(PACKED_ROW_TEST)
    result = inner.runpytest("--kernelguard", "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*::test_packed_row FAILED*"])
    text = result.stdout.str()  # brackets in the fix would be fnmatch character classes
    assert ("PackedWithoutBoundariesError: kernelguard: model.layers.0.linear_attn (and 2 more GDN layers) got a "
            "packed row of 2 examples (by its position_ids) but its gated-delta kernels get no `cu_seqlens` (the "
            "batch has no `cu_seq_lens_q`) and its conv gets no `seq_idx` (the batch has no `seq_idx`): recurrent "
            "and conv state would carry from each example into the next.") in text
    assert ("Fix: DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True), or "
            "padding_free=False; or accept it explicitly with "
            "@pytest.mark.kernelguard(allow=['packed-without-boundaries']) or --kernelguard-allow "
            "packed-without-boundaries") in text
    assert " layers.0.linear_attn (and 2 more" not in text  # the outermost model call only: no base-model repeat
    from transformers import PreTrainedModel

    assert "__call__" not in PreTrainedModel.__dict__  # disarmed after each test


PROBED_ROW_TEST = """
import torch
import tiny_models
from transformers import DataCollatorWithFlattening

def test_bounded_row():
    features = [{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    with torch.no_grad():
        tiny_models.tiny_model("qwen3_5")(**{k: v for k, v in batch.items() if k != "labels"})
"""


def test_the_probe_option_fails_a_test_whose_kernel_ignores_its_boundaries(
    inner: pytest.Pytester, fake_providers: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kernelguard-probe (ini kernelguard_probe): a GDN kernel that takes cu_seqlens but does not honour it
    passes every static check; the probe runs the model's first packed row example by example and fails the test
    naming the layer. Without the option the same test passes (the control)."""
    import fla.ops.gated_delta_rule as fake
    import tiny_models

    tiny_models.tiny_model("qwen3_5")  # the modeling module imported with the stand-ins, before the inner runs
    varlen = fake._varlen
    monkeypatch.setattr(fake, "_varlen", lambda *a, **k: varlen(*a, **{**k, "cu_seqlens": None}))
    inner.makepyfile(PROBED_ROW_TEST)
    inner.runpytest("--kernelguard", "--kernelguard-allow", "attention").assert_outcomes(passed=1)
    result = inner.runpytest("--kernelguard", "--kernelguard-allow", "attention", "--kernelguard-probe")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*PackedWithoutBoundariesError: kernelguard: the first packed row, run example by "
                                 "example, differs from the packed run from model.layers.1 (linear attention) on*"])
    inner.makeini("[pytest]\nkernelguard_probe = true\n")
    inner.runpytest("--kernelguard", "--kernelguard-allow", "attention").assert_outcomes(failed=1)


KDA_FAMILY_TEST = """
import pytest
import torch
import tiny_models

KDA = ["chunk_kda", "causal_conv1d_fn", "attention"]
IDS = torch.randint(0, 256, (1, 8))
BOUNDED = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
           "cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
           "cu_seq_lens_k": torch.tensor([0, 3, 8], dtype=torch.int32), "max_length_q": 5, "max_length_k": 5,
           "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)}

@pytest.mark.kernelguard(allow=KDA)
def test_kda_padded():
    tiny_models.tiny_model("kimi_linear")(IDS)

@pytest.mark.kernelguard(allow=KDA)
def test_kda_packed_with_every_boundary():
    tiny_models.tiny_model("kimi_linear")(IDS, **BOUNDED)
"""


def test_a_kda_family_packed_row_fails_with_the_layers_own_reason(inner: pytest.Pytester) -> None:
    """Kimi-Linear under the plugin: a padded forward passes; a packed row carrying every boundary keyword fails,
    because transformers' layer hands chunk_kda none of them (the same check as guard(), in pytest's terms)."""
    pytest.importorskip("transformers.models.kimi_linear")
    inner.makepyfile(KDA_FAMILY_TEST)
    result = inner.runpytest("--kernelguard", "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_kda_packed_with_every_boundary FAILED*"])
    text = result.stdout.str()
    assert ("its KDA kernels get no `cu_seqlens` (transformers' layer does not pass `cu_seqlens` to "
            "`chunk_kda`)") in text
    assert ("Fix: padded batches (padding_free=False, no DataCollatorWithFlattening): the model's own layer drops "
            "the boundary, which no collator can mend; or accept it explicitly with "
            "@pytest.mark.kernelguard(allow=['packed-without-boundaries'])") in text


MAMBA2_TEST = """
import torch
import tiny_models

IDS = torch.randint(3, 256, (1, 8))
BOUNDED = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
           "cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
           "cu_seq_lens_k": torch.tensor([0, 3, 8], dtype=torch.int32), "max_length_q": 5, "max_length_k": 5,
           "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)}

def test_mamba2_padded():
    tiny_models.tiny_model("mamba2").train()(IDS, use_cache=False)

def test_mamba2_packed_with_every_boundary():
    tiny_models.tiny_model("mamba2").train()(IDS, use_cache=False, **BOUNDED)
"""


def test_a_causal_lm_that_drops_the_boundaries_fails_its_packed_test(
    inner: pytest.Pytester, fake_mamba: Path, tiny: object
) -> None:
    """Mamba2ForCausalLM (transformers 5.24) with the Mamba-2 stand-in serving every scan: the plugin checks the
    outermost model call, where the row still carries its seq_idx; the backbone never gets it. The plugin let the
    row through (the kernels take seq_idx) and the examples mixed; now it fails the test with the cause. Where
    transformers passes the keywords on (5.25), the same test passes: the row is kept apart."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    from kernelguard.resolution.transformers_calls import dropped_keywords

    tiny.tiny_model("mamba2")  # type: ignore[attr-defined]  # imported with the stand-ins, before the inner run
    inner.makepyfile(MAMBA2_TEST)
    result = inner.runpytest("--kernelguard", "-v")
    dropped = dropped_keywords(modeling.__file__, "Mamba2ForCausalLM")
    if dropped is None:
        result.assert_outcomes(passed=2)
        return
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_mamba2_packed_with_every_boundary FAILED*"])
    text = " ".join(result.stdout.str().split())
    assert "(and 1 more Mamba-2 layer) got a packed row of 2 examples" in text
    assert f"its conv and Mamba-2 scan get no `seq_idx` (the model's own forward drops it: {dropped})" in text
    assert ("Fix: padded batches (padding_free=False, no DataCollatorWithFlattening): the model's own forward drops "
            "the boundary before its layers, which no collator can mend") in text
