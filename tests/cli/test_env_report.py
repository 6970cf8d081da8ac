"""`kernelguard env` (the bug-report block) and the `kernelguard lock` / `check --lock` commands end to end.

The block quoted in docs/lock.md is this module's rendering of made-up facts: the docs cannot drift from the code
(regenerate with KERNELGUARD_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from check_helpers import make_env, make_ext, make_pkg

from kernelguard.cli.env_report import from_result, render_env
from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.facts import Facts, FlaBackend
from kernelguard.resolution.resolver import Target, resolve
from kernelguard.stack.compose import CheckOptions, CheckResult

DOC = Path(__file__).resolve().parents[2] / "docs" / "lock.md"
MARKED = re.compile(r"(<!-- env-output -->\n)(.*?)(\n<!-- /env-output -->)", re.DOTALL)


def _example() -> str:
    facts = Facts(
        env=make_env(gpus=("9.0",), triton="3.6.0", torch="2.11.0", cuda="13.0", kernels="0.16.2",
                     packages={"fla-core": "0.6.0", "flash-linear-attention": "0.6.0", "causal-conv1d": "1.7.0",
                               "transformers": "5.17.0"}),
        packages={
            "fla.ops.gated_delta_rule": make_pkg("fla", "0.6.0"),
            "causal_conv1d": make_pkg("causal_conv1d", "1.7.0", extensions=(make_ext(("sm_80", "sm_90", "sm_100")),)),
            "flash_attn": make_pkg("flash_attn", None, import_error="ModuleNotFoundError: No module named 'flash_attn'"),
        },
        kernels_window=("0.16", "0.17"),
        torch_varlen_attention=True,
        fla_backends={"9.0": FlaBackend("9.0", "triton", "triton", (), "fla.backends")},
    )
    spec = discovery.resolve_model("qwen3_5", discovery.transformers_source())
    requirements = catalog.requirements(spec, "training", packed=True, transformers_version="5.17.0")
    target = Target(archs=("9.0",), arch_source="visible GPU", allow=("fla-640-refusal",))
    result = CheckResult(CheckOptions(archs=("9.0",)), facts.env, resolve(facts, requirements, target), spec.origin,
                         facts=facts)
    variables = {"FLA_FLASH_QLA": "0", "KERNELGUARD_LOCK": "/opt/kernelguard.lock", "TRITON_CACHE_DIR": "/cache/triton"}
    return render_env(from_result(result, variables=variables, kernelguard="0.2.0"))


def test_the_env_block_in_the_docs_is_what_kernelguard_env_prints() -> None:
    text = DOC.read_text(encoding="utf-8")
    actual = _example()
    if os.environ.get("KERNELGUARD_UPDATE_GOLDEN"):
        DOC.write_text(MARKED.sub(lambda m: m.group(1) + actual + m.group(3), text), encoding="utf-8")
        text = DOC.read_text(encoding="utf-8")
    found = MARKED.search(text)
    assert found is not None, "docs/lock.md lost its <!-- env-output --> block"
    assert found.group(2) == actual, "regenerate with KERNELGUARD_UPDATE_GOLDEN=1 pytest tests/cli/test_env_report.py"


def test_the_env_block_names_what_a_gdn_bug_report_needs() -> None:
    lines = _example().splitlines()
    assert lines[1] == "kernelguard 0.2.0 env" and lines[0] == "```text" and lines[-1] == "```"
    assert "- torch: 2.11.0+cu130 (CUDA 13.0, cxx11 ABI)" in lines
    assert "- transformers: 5.17.0 (uses kernels in [0.16, 0.17))" in lines
    assert "- fla: fla-core 0.6.0, flash-linear-attention 0.6.0; GDN backend sm 9.0: triton" in lines
    assert ("- causal-conv1d: 1.7.0 (causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so: sm_80, sm_90, sm_100)"
            in lines)
    assert ("- variables: FLA_FLASH_QLA=0, KERNELGUARD_LOCK=/opt/kernelguard.lock, TRITON_CACHE_DIR=/cache/triton"
            in lines)
    assert "    chunk_gated_delta_rule: fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)" in lines


def test_env_json_on_this_machine(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelguard.cli import main

    monkeypatch.setenv("FLA_TILELANG", "0")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["variables"] == {"FLA_TILELANG": "0"}
    assert set(data["providers"]) >= {"chunk_gated_delta_rule", "causal_conv1d_fn"}
    assert data["torch"]["version"] and data["python"]


def test_lock_then_check_lock_then_drift(fake_providers: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["lock", "--arch", "9.0", "--allow", "attention"]) == 0
    assert capsys.readouterr().out.startswith("kernelguard lock: wrote kernelguard.lock (3 kernels, target sm 9.0)")
    assert main(["check", "--lock", "kernelguard.lock"]) == 0
    assert main(["check", "--lock", "kernelguard.lock", "--arch", "8.0"]) == 2  # the lock's target, not another
    assert "--arch 8.0 contradicts it (the lock's arch is 9.0)" in " ".join(capsys.readouterr().err.split())
    assert main(["check", "--lock", "kernelguard.lock", "--arch", "9.0"]) == 0  # the lock's own value: accepted
    import transformers

    other = "5.17.0" if transformers.__version__ != "5.17.0" else "5.23.0"  # CI runs both
    lock = json.loads(Path("kernelguard.lock").read_text())
    lock["stack"]["transformers"] = other
    Path("kernelguard.lock").write_text(json.dumps(lock))
    assert main(["check", "--lock", "kernelguard.lock"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kernelguard: this node's stack differs from kernelguard.lock (written for qwen3_5 "
                             "training on sm 9.0): 1 difference(s)")
    assert err[1] == (f"  - transformers: lock says {other}, here {transformers.__version__}; restore: pip install "
                      f"--force-reinstall --no-deps 'transformers=={other}'")


def test_lock_refuses_to_write_a_failing_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if "fake_providers" not in p])
    assert main(["lock", "--arch", "9.0", "-o", "out.lock"]) == 1
    assert "kernelguard lock: the check fails, so out.lock was not written." in capsys.readouterr().err
    assert not (tmp_path / "out.lock").exists()
