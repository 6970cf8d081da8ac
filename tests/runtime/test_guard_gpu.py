"""The guard on a CUDA model with the REAL fla and causal-conv1d (the H200 run; skipped elsewhere).

Each case runs in a fresh interpreter: whether transformers picked fla is decided when its modeling module
is imported, so "fla hidden" must be set before that import. The printed reports are quoted in
bench/RESULTS.md (run with -s).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("fla") is None or importlib.util.find_spec("causal_conv1d") is None,
        reason="needs the real fla and causal-conv1d installed",
    ),
]

SCRIPT = textwrap.dedent(
    """
    import sys
    if {hide!r}:
        sys.modules["fla"] = None  # the interpreter's own "not importable" marker
    sys.path.insert(0, {tests!r})
    import torch
    import kernelguard
    from kernelguard.errors import KernelFallbackError
    from tiny_models import tiny_model

    model = tiny_model("qwen3_5").to("cuda", torch.bfloat16)
    try:
        report = kernelguard.guard(model, mode="training", packed=False)
    except KernelFallbackError as exc:
        print("REFUSED AT GUARD TIME")
        print(exc)
        sys.exit(3)
    print(report.render())
    with report, torch.no_grad():
        out = model(input_ids=torch.randint(0, 100, (1, 64), device="cuda"))
    print("forward ok", tuple(out.logits.shape))
    """
)


def _run(hide_fla: bool) -> subprocess.CompletedProcess[str]:
    code = SCRIPT.format(hide=hide_fla, tests=str(REPO / "tests"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False)
    print(result.stdout, result.stderr[-3000:], sep="\n")
    return result


def test_real_fla_and_causal_conv1d_pass_the_guard_on_cuda() -> None:
    result = _run(hide_fla=False)
    assert result.returncode == 0
    assert re.search(r"chunk_gated_delta_rule\b.*\bfla\b", result.stdout), "no fla row for the GDN op"
    assert re.search(r"causal_conv1d_fn\b.*causal.conv1d", result.stdout), "no causal-conv1d row for the conv"
    assert "forward ok" in result.stdout


def test_hidden_fla_fails_at_guard_time_naming_the_layer() -> None:
    result = _run(hide_fla=True)
    assert result.returncode == 3
    assert "REFUSED AT GUARD TIME" in result.stdout
    assert "model.layers.0.linear_attn" in result.stdout
    assert "chunk_gated_delta_rule" in result.stdout


PLUGIN_CONFTEST = textwrap.dedent(
    """
    import sys
    if {hide!r}:
        sys.modules["fla"] = None  # before any transformers modeling module is imported
    sys.path.insert(0, {tests!r})
    """
)

PLUGIN_TEST = textwrap.dedent(
    """
    import torch
    from tiny_models import tiny_model

    def test_cuda_forward():
        model = tiny_model("qwen3_5").to("cuda", torch.bfloat16)
        with torch.no_grad():
            model(input_ids=torch.randint(0, 100, (1, 64), device="cuda"))
    """
)


def _plugin_args() -> list[str]:
    """The plugin loads through its pytest11 entry point when kernelguard is installed; from a plain checkout on
    PYTHONPATH (the GPU machine) there is no distribution metadata, so name the module."""
    from importlib.metadata import entry_points

    installed = any(ep.value == "kernelguard.integrations.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "kernelguard.integrations.pytest_plugin"]


def _run_plugin(tmp_path: Path, hide_fla: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(PLUGIN_CONFTEST.format(hide=hide_fla, tests=str(REPO / "tests")))
    (tmp_path / "test_cuda_forward.py").write_text(PLUGIN_TEST)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(), "--kernelguard",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )
    print(result.stdout[-6000:], result.stderr[-3000:], sep="\n")
    return result


def test_plugin_passes_with_real_kernels_on_cuda(tmp_path: Path) -> None:
    result = _run_plugin(tmp_path, hide_fla=False)
    assert result.returncode == 0
    assert "1 passed" in result.stdout


def test_plugin_on_cuda_without_fla_names_the_layer_and_installs_first(tmp_path: Path) -> None:
    result = _run_plugin(tmp_path, hide_fla=True)
    assert result.returncode == 1
    assert "the torch reference path of chunk_gated_delta_rule ran during setup or the test call" in result.stdout
    assert "model.layers.0.linear_attn -> transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule" in (
        result.stdout)
    assert "Fix: install the fast kernels:" in result.stdout
    assert "pip install 'flash-linear-attention>=0.6.0,<1'" in result.stdout
    assert "no CUDA device" not in result.stdout
