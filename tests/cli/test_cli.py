"""`kernelguard check` / `kernelguard issues` through the real entry points, in subprocesses.

Every run happens in a fresh tmp cwd (so `[tool.kernelguard]` of this repository never leaks in) with no GPU
visible (CUDA_VISIBLE_DEVICES=""). "This machine" means the CI machine: CPU torch, no fla, no causal-conv1d,
no flash-attn; tests that depend on that skip elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from check_helpers import ALLOW_ALL, kg, kg_json, write_distribution

from kernelguard.resolution import discovery
from kernelguard.resolution.install import DISTRIBUTION
from kernelguard.resolution.known_issues import KNOWN_ISSUES
from kernelguard.stack.report import fix_lines

FAKE_PROVIDERS = Path(__file__).resolve().parents[1] / "fake_providers"
TRANSFORMERS = metadata.version("transformers")
TORCH = metadata.version("torch")
try:  # the GPU machine has no `kernels`: its tests skip there, and the module must still collect
    KERNELS: str | None = metadata.version("kernels")
except metadata.PackageNotFoundError:
    KERNELS = None
STATUSES = {"selected", "accepted", "rejected", "skipped", "fallback"}


def _is_cpu_ci_machine() -> bool:
    if any(importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d", "flash_attn")):
        return False
    import torch

    return torch.version.cuda is None


no_fast_packages = pytest.mark.skipif(
    not _is_cpu_ci_machine(),
    reason="expectations for the CPU CI machine (CPU torch; no fla, causal-conv1d or flash-attn installed)",
)


def kernel(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(k for k in data["kernels"] if k["kernel"] == name)


def candidate(data: dict[str, Any], name: str, kind: str) -> dict[str, Any]:
    return next(c for c in kernel(data, name)["candidates"] if c["kind"] == kind)


def _fla_fix() -> tuple[str, str | None]:
    """kernelguard.resolution.install's advice for fla on this machine's torch (CI: a CPU build, which gets a caveat): the
    command and the note JSON gives beside it."""
    torch_version = metadata.version("torch")
    note = None if "+cpu" not in torch_version else (
        f"torch {torch_version} is a build without CUDA: fla installs, but its Triton kernels need a CUDA "
        "(or XPU) build of torch to run."
    )
    return "pip install 'flash-linear-attention>=0.6.0,<1'", note


FLA_FIX, FLA_NOTE = _fla_fix()


def kernels_note() -> str | None:
    window = discovery.kernels_version_window()
    if window is None or KERNELS is None or (window[0] <= KERNELS < window[1]):  # plain string compare is fine for 0.x.y here
        return None
    return (
        f"known issue kernels-version: kernels {KERNELS} is outside [{window[0]}, {window[1]}), the range this "
        f"transformers accepts, so is_kernels_available() is False and from_pretrained(use_kernels=True) raises "
        f"ValueError: Kernels are not available; "
        f"fix: {kernels_fix(window)}"
    )


def kernels_fix(window: tuple[str, str]) -> str:
    """Each installed transformers' window holds a kernels release (5.17: 0.16.x, 5.23/5.24: 0.18.3), so the fix is
    the window itself."""
    return f"pip install 'kernels>={window[0]},<{window[1]}'"


def write_config(folder: Path, key_dim: int = 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen3_5_text",
                "linear_key_head_dim": key_dim,
                "linear_value_head_dim": 128,
                "hidden_size": 1024,
            }
        )
    )
    return path


# ------------------------------------------------------------------------------------------- human text


@no_fast_packages
def test_default_check_fails_with_the_whole_trace(tmp_path: Path) -> None:
    proc = kg("check", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert (
        lines[0]
        == f"kernelguard check: qwen3_5 (family name), training, packed sequences, transformers {TRANSFORMERS}"
    )
    assert lines[1] == "target: GPU arch unknown (no GPU visible, no --arch)"  # once, not "unknown (unknown ..."
    assert re.match(rf"torch {re.escape(TORCH)} \(no CUDA, (pre-)?cxx11 ABI\) \| Triton ", lines[2]), lines[2]
    assert " ".join(line.strip() for line in lines[2:4]).endswith("| no GPU visible")  # wrapped at 100
    for name in ("causal_conv1d_fn", "chunk_gated_delta_rule", "varlen_attention"):
        assert f"{name:<34} FAIL  no fast provider: the torch reference path would run" in lines
    text = proc.stdout
    assert "  [-] rejected  fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)" in lines
    assert "fix: pip install 'flash-linear-attention>=0.6.0,<1'" in text
    assert "pip install --no-build-isolation --no-cache-dir 'causal-conv1d==1.7.0'" in " ".join(
        line.strip().removesuffix(" \\") for line in lines  # a command broken with ` \` to fit, joined again
    )
    assert f"torch {TORCH} is a build without CUDA; varlen_attn runs only on CUDA GPUs." in " ".join(
        line.strip() for line in lines
    )
    assert "  [!] fallback  torch reference" in lines
    assert _verdict(proc.stdout) == (
        "verdict: FAIL - 3 of 3 required kernels would run a slow fallback: causal_conv1d_fn, "
        "chunk_gated_delta_rule, varlen_attention (exit 1)"
    )
    assert "not checked here:" in lines


@no_fast_packages
def test_allowed_fallbacks_exit_0_for_unpacked_training(tmp_path: Path) -> None:
    proc = kg("check", *ALLOW_ALL, "--no-packed", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"{'chunk_gated_delta_rule':<34} OK    torch reference, explicitly allowed" in lines
    assert _verdict(proc.stdout) == (
        "verdict: OK - all 2 required kernels are served; allowed fallbacks: causal_conv1d_fn, "
        "chunk_gated_delta_rule; 1 item(s) not checked here (see above) (exit 0)"
    )


@no_fast_packages
def test_allowing_gdn_fallbacks_cannot_pass_packed_training(tmp_path: Path) -> None:
    # transformers' torch references ignore cu_seqlens/seq_idx: packed rows would crash (>= 5.20) or mix.
    proc = kg("check", *ALLOW_ALL, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    text = " ".join(line.strip() for line in lines)
    assert f"{'varlen_attention':<34} OK    torch reference, explicitly allowed" in lines
    assert "the torch reference cannot keep packed examples apart" in text
    assert "fix: install a fast provider above, or check unpacked training with --no-packed" in text
    assert _verdict(proc.stdout) == (
        "verdict: FAIL - 2 of 3 required kernels would run a slow fallback: causal_conv1d_fn, "
        "chunk_gated_delta_rule (exit 1)"
    )


def _verdict(stdout: str) -> str:
    """The report's last paragraph, the verdict, unwrapped."""
    return "verdict: " + " ".join(line.strip() for line in stdout.split("\nverdict: ", 1)[1].splitlines())


def _console_script() -> str | None:
    here = Path(sys.executable).parent
    return shutil.which("kernelguard") or shutil.which("kernelguard", path=str(here))


@no_fast_packages
@pytest.mark.skipif(_console_script() is None, reason="the kernelguard console script is not installed")
def test_console_script_is_the_same_command(tmp_path: Path) -> None:
    script = _console_script()
    assert script is not None
    ok = kg("check", *ALLOW_ALL, "--no-packed", "--arch", "9.0", cwd=tmp_path, command=(script,))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _verdict(ok.stdout) == (
        "verdict: OK - all 2 required kernels are served; allowed fallbacks: "
        "causal_conv1d_fn, chunk_gated_delta_rule (exit 0)"
    )
    bad = kg("check", "--model", "nope", cwd=tmp_path, command=(script,))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("kernelguard: error: unknown model 'nope'")
    assert kg("issues", cwd=tmp_path, command=(script,)).stdout.startswith(KNOWN_ISSUES[0].id + "\n")


# -------------------------------------------------------------------------------------------------- JSON


@no_fast_packages
def test_json_follows_the_documented_schema(tmp_path: Path) -> None:
    data = kg_json(cwd=tmp_path, rc=1)
    assert set(data) == {
        "schema_version",
        "ok",
        "model",
        "transformers",
        "target",
        "allow",
        "kernels",
        "notes",
        "unchecked",
        "load_error",
        "numerics",
        "environment",
        "fla_backend",
    }
    assert (data["schema_version"], data["ok"], data["numerics"], data["allow"]) == (2, False, None, [])
    assert data["fla_backend"] == {}  # fla does not serve here
    assert data["model"] == {
        "name": "qwen3_5",
        "family": "qwen3_5",
        "origin": "family name",
        "mode": "training",
        "packed": True,
        "key_head_dim": 128,
        "key_head_dim_source": "default of qwen3_5's config class",
    }
    assert data["transformers"] == TRANSFORMERS
    assert data["target"] == {"archs": [], "source": "no GPU visible, no --arch"}
    assert [k["kernel"] for k in data["kernels"]] == [
        "causal_conv1d_fn",
        "chunk_gated_delta_rule",
        "varlen_attention",
    ]
    for entry in data["kernels"]:
        assert set(entry) == {"kernel", "ok", "selected", "candidates"}
        assert (entry["ok"], entry["selected"]) == (False, None)
        for cand in entry["candidates"]:
            assert set(cand) == {"provider", "kind", "status", "reason", "fix", "fix_note", "known_issues"}
            assert cand["status"] in STATUSES and cand["kind"] in {"package", "hub", "torch", "reference"}
            assert isinstance(cand["known_issues"], list) and cand["reason"].endswith(".")
        assert entry["candidates"][-1]["status"] == "fallback"
    fla = candidate(data, "chunk_gated_delta_rule", "package")
    assert fla == {
        "provider": "fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)",
        "kind": "package",
        "status": "rejected",
        "reason": "fla-core / flash-linear-attention is not installed (import 'fla.ops.gated_delta_rule' "
        "failed).",
        "fix": FLA_FIX,
        "fix_note": FLA_NOTE,
        "known_issues": [],
    }
    assert candidate(data, "chunk_gated_delta_rule", "hub")["status"] == "skipped"
    assert data["notes"] == []  # no --hub: the kernels window is no note (kernels_note() is for --hub runs)
    assert data["unchecked"][0].startswith("no GPU visible and no --arch given")
    env = data["environment"]
    assert env["torch_version"] == {"value": TORCH, "source": "torch.__version__"}
    assert env["torch_error"] is None and env["gpus"] == []
    assert env["packages"]["transformers"] == {"value": TRANSFORMERS, "source": "importlib.metadata"}


# --------------------------------------------------------------------------------------- model argument


@no_fast_packages
@pytest.mark.parametrize("as_folder", [False, True], ids=["config.json", "model-folder"])
def test_model_from_config_file_or_folder(tmp_path: Path, as_folder: bool) -> None:
    config = write_config(tmp_path / "my-model", key_dim=64)
    model = str(config.parent) if as_folder else str(config)
    data = kg_json("--model", model, *ALLOW_ALL, "--no-packed", cwd=tmp_path, rc=0)
    assert data["ok"] is True
    assert data["model"] == {
        "name": model,
        "family": "qwen3_5",
        "origin": str(config),
        "mode": "training",
        "packed": False,
        "key_head_dim": 64,
        "key_head_dim_source": f"linear_key_head_dim in {config}",
    }
    assert [k["selected"] for k in data["kernels"]] == [
        "torch reference",
        "torch reference",
    ]


# ------------------------------------------------------------------------------------------ pyproject


@no_fast_packages
def test_pyproject_defaults_are_read_from_cwd(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "job"\n\n[tool.kernelguard]\nmodel = "qwen3_next"\narch = "sm_90"\n'
        'allow = ["chunk_gated_delta_rule", "causal_conv1d_fn"]\npacked = false\n'
    )
    data = kg_json("--allow", "attention", cwd=tmp_path, rc=0)
    assert data["model"]["family"] == "qwen3_next"
    assert data["target"] == {"archs": ["9.0"], "source": "arch in [tool.kernelguard] of pyproject.toml"}
    assert data["allow"] == ["attention", "causal_conv1d_fn", "chunk_gated_delta_rule"]
    # Flags win over the table (arch, model, mode, packed); --allow adds to its allow list.
    overridden = kg_json(
        "--arch", "80", "--model", "qwen3_5", "--mode", "inference", "--no-packed", cwd=tmp_path, rc=1
    )
    assert overridden["target"] == {"archs": ["8.0"], "source": "--arch"}
    assert (overridden["model"]["family"], overridden["model"]["mode"], overridden["model"]["packed"]) == (
        "qwen3_5",
        "inference",
        False,
    )
    assert overridden["allow"] == ["causal_conv1d_fn", "chunk_gated_delta_rule"]
    assert [(k["kernel"], k["ok"]) for k in overridden["kernels"]] == [
        ("causal_conv1d_update", False),
        ("causal_conv1d_fn", True),
        ("chunk_gated_delta_rule", True),
        ("fused_recurrent_gated_delta_rule", False),
    ]


def test_a_relative_model_in_pyproject_means_its_folder_from_any_working_directory(tmp_path: Path) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[2] / "bench" / "configs" / "qwen3_5_k64.json", tmp_path / "models" / "tiny" / "config.json")
    (tmp_path / "pyproject.toml").write_text('[tool.kernelguard]\nmodel = "models/tiny"\n')
    (work := tmp_path / "src" / "job").mkdir(parents=True)
    data = kg_json(*ALLOW_ALL, "--no-packed", cwd=work, rc=0)
    assert data["model"]["origin"].startswith(str(tmp_path / "models" / "tiny")), data["model"]
    # The control: the same words as --model are the working directory's, where there is no such folder.
    proc = kg("check", "--model", "./models/tiny", *ALLOW_ALL, cwd=work)
    assert proc.returncode == 2 and "unknown model './models/tiny'" in proc.stderr, proc.stderr


def test_a_missing_model_path_in_pyproject_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.kernelguard]\nmodel = "./models/tiny"\n')
    (work := tmp_path / "sub").mkdir()
    proc = kg("check", cwd=work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"kernelguard: error: model './models/tiny' in [tool.kernelguard] of {tmp_path / 'pyproject.toml'} is "
            f"{tmp_path / 'models' / 'tiny'} (paths there are relative to that file's folder)") in " ".join(
                proc.stderr.split()), proc.stderr


def test_pyproject_arch_as_number_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.kernelguard]\narch = 9.0\n")
    proc = kg("check", cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    assert proc.returncode == 2


# ------------------------------------------------------------------------------------------- exit 2


def _bad_config(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text("{not json")
    return ["check", "--model", "config.json"]


def _no_model_type(tmp_path: Path) -> list[str]:
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    return ["check", "--model", "config.json"]


def _bad_pyproject(tmp_path: Path) -> list[str]:
    (tmp_path / "pyproject.toml").write_text('[tool.kernelguard]\nmodle = "qwen3_5"\n')
    return ["check"]


def _bad_toml(tmp_path: Path) -> list[str]:
    (tmp_path / "pyproject.toml").write_text("[tool.kernelguard\n")
    return ["check"]


USAGE_ERRORS = {
    "unknown-model": (
        lambda p: ["check", "--model", "nope"],
        (
            "kernelguard: error: unknown model 'nope': not a family with fallback kernels in "
            "transformers, and not a file. The families: "
        ),
        "qwen3_5, qwen3_5_moe, qwen3_next",  # nothing near: the names, no Fix line to guess with
    ),
    "unknown-model-names-every-kind": (  # not only the gated-delta families: every family check knows, by kind
        lambda p: ["check", "--model", "nope"],
        "kernelguard: error: unknown model 'nope': not a family with fallback kernels in transformers, and not a "
        "file. The families: gated delta net (fla): ",
        "; Mamba (mamba-ssm): bamba, falcon_h1, falcon_mamba, granitemoehybrid, jamba, mamba, mamba2, nemotron_h",
    ),
    "model-typo-of-another-kind": (  # the nearest name among every family, not only the gated-delta ones
        lambda p: ["check", "--model", "mamba_2", "--mode", "training"],
        "kernelguard: error: unknown model 'mamba_2': not a family with fallback kernels in transformers, and not "
        "a file; did you mean mamba2?",
        "Fix: kernelguard check --model mamba2 --mode training\n",
    ),
    "model-typo": (
        lambda p: ["check", "--model", "qwen3_55", "--mode", "training"],
        "kernelguard: error: unknown model 'qwen3_55': not a family with fallback kernels in transformers, and not "
        "a file; did you mean qwen3_5?",
        "Fix: kernelguard check --model qwen3_5 --mode training\n",
    ),
    "bad-arch": (
        lambda p: ["check", "--arch", "banana"],
        "kernelguard: error: --arch 'banana' is not a compute capability such as \"9.0\".",
        "Fix: use e.g. --arch 9.0; known values: 9.0 (H100/H200), 8.0 (A100)",
    ),
    "malformed-config": (
        _bad_config,
        (
            "kernelguard: error: could not read model config config.json: Expecting "
            "property name enclosed in double quotes"
        ),
        "Fix: pass a valid config.json",
    ),
    "config-without-model-type": (
        _no_model_type,
        ("kernelguard: error: config.json has no 'model_type', so the model family is unknown."),
        "Fix: pass the config.json of a ",
    ),
    "non-hybrid-model": (
        lambda p: ["check", "--model", "llama"],
        "kernelguard: error: unknown model 'llama'",
        "qwen3_5",
    ),
    "unknown-flag": (
        lambda p: ["check", "--bogus"],
        "kernelguard check: error: unrecognized arguments: --bogus",
        "(see `kernelguard check --help`)",
    ),
    "bad-mode": (
        lambda p: ["check", "--mode", "train"],
        "kernelguard check: error: --mode: 'train' is not one of training, inference; did you mean training?",
        "(see `kernelguard check --help`)",
    ),
    "no-command": (
        lambda p: [],
        "kernelguard: error: the following arguments are required: command",
        "(see `kernelguard --help`)",
    ),
    "run-without-gpu": (
        lambda p: ["check", "--run"],
        "kernelguard: error: --run executes the kernels on a GPU, and no CUDA GPU is visible here.",
        "Fix: run `kernelguard check --run` on a GPU node, or drop --run",
    ),
    "bad-pyproject-key": (
        _bad_pyproject,
        "kernelguard: error: unknown key(s) modle in [tool.kernelguard] of ",
        "Fix: use only: allow, arch, hub, mode, model, packed",
    ),
    "bad-toml": (_bad_toml, "kernelguard: error: could not read ", "Fix: fix the TOML syntax in "),
}


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
def test_usage_errors_exit_2_with_one_error_line_and_a_fix(tmp_path: Path, name: str) -> None:
    make_args, error, fix = USAGE_ERRORS[name]
    proc = kg(*make_args(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(error), proc.stderr
    assert fix in proc.stderr


# --------------------------------------------------------------------------------------------- issues


def test_issues_lists_every_known_issue_and_policy_allow(tmp_path: Path) -> None:
    proc = kg("issues", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines if not line.lstrip().startswith(("fix: ", "or: ")))
    for issue in KNOWN_ISSUES:
        at = lines.index(issue.id)
        block = " ".join(line.strip() for line in lines[at + 1 : lines.index("", at)])  # wrapped at 100 columns
        fix = " ".join(line.strip() for line in "\n".join(fix_lines(issue.fix, width=100, indent=2)).splitlines())
        expected = [issue.title, f"effect: {issue.effect}", fix, f"source: {issue.source}"]
        expected += [f"measured: {issue.evidence}"] if issue.evidence else []
        assert [part for part in expected if part not in block] == [], (issue.id, block)
    assert sum(line.startswith("  measured: ") for line in lines) == sum(bool(i.evidence) for i in KNOWN_ISSUES) == 2
    assert "other --allow values:" in lines
    assert any(line.startswith("  attention: ") for line in lines)
    assert any(line.startswith("  untrusted-hub-repo: ") for line in lines)


def test_version_flag_prints_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kernelguard {metadata.version(DISTRIBUTION)}\n"


def test_top_level_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog to the terminal width
    assert (
        "exit codes: 0 every required kernel is served well; 1 a requirement fails; 2 usage or configuration "
        "error; 3 kernelguard train refused to start (the guard found a slow fallback)"
    ) in text


def test_issues_json_has_every_known_issue_and_allow_item(capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import main
    from kernelguard.resolution.policy import POLICY_ITEMS

    assert main(["issues", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema_version"] == 2 and data["allow_items"] == POLICY_ITEMS
    assert [row["id"] for row in data["known_issues"]] == [issue.id for issue in KNOWN_ISSUES]
    fla = data["known_issues"][0]
    assert (fla["provider"], fla["archs"], fla["triton"]) == ("fla", ["9.0"], ">=3.4,<3.7.1")
    assert fla["fix"] is None and fla["source"] == KNOWN_ISSUES[0].source  # the table's fix is prose here
    assert fla["fix_note"] == KNOWN_ISSUES[0].fix
    z3 = next(row for row in data["known_issues"] if row["id"] == "tilelang-without-z3")
    assert (z3["fix"], z3["fix_note"]) == ("pip install z3-solver", "or pip uninstall tilelang")
    for row in data["known_issues"]:  # every fix is one command that bash parses
        assert row["fix"] is None or subprocess.run(["bash", "-n", "-c", row["fix"]], check=False).returncode == 0


# ------------------------------------------------------------------------------------- fake providers


def _fake_triton(tmp_path: Path, version: str) -> Path:
    site = tmp_path / "triton-site"
    write_distribution(site, "triton", version, {"triton/__init__.py": f'__version__ = "{version}"\n'})
    return site


def test_fake_providers_serve_the_kernels_until_fla_640_applies(tmp_path: Path) -> None:
    """Fake fla 0.6.0 on PYTHONPATH serves; a Triton 3.6.0 distribution next to it makes fla #640 apply."""
    paths = (FAKE_PROVIDERS, _fake_triton(tmp_path, "3.6.0"))
    refused = kg_json("--arch", "9.0", "--allow", "attention", cwd=tmp_path, rc=1, pythonpath=paths)
    assert refused["environment"]["packages"]["triton"]["value"] == "3.6.0"
    fla = candidate(refused, "chunk_gated_delta_rule", "package")
    assert (fla["status"], fla["known_issues"]) == ("rejected", ["fla-640-refusal"])
    assert fla["reason"].startswith("known issue fla-640-refusal (https://github.com/fla-org/")
    assert "--allow fla-640-refusal" in fla["fix_note"] and fla["fix"] == "pip install 'triton==3.7.1'"
    assert kernel(refused, "causal_conv1d_fn")["selected"] == "causal_conv1d (causal_conv1d.causal_conv1d_fn)"

    proc = kg(
        "check",
        "--arch",
        "9.0",
        "--allow",
        "attention",
        "--allow",
        "fla-640-refusal",
        cwd=tmp_path,
        pythonpath=paths,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "| Triton 3.6.0 |" in lines[2]
    # no terminal: 100 columns, except a fix's command, which is never wrapped
    assert all(len(line) <= 100 for line in lines if not line.lstrip().startswith(("fix: ", "or: "))), lines
    text = " ".join(line.strip() for line in lines)  # lines are wrapped at 100 columns
    assert f"{'chunk_gated_delta_rule':<34} OK    served by fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)" in text
    assert f"{'causal_conv1d_fn':<34} OK    served by causal_conv1d (causal_conv1d.causal_conv1d_fn)" in text
    assert (
        "fla 0.6.0+kernelguard.fake imports fla.ops.gated_delta_rule.chunk_gated_delta_rule. Note: known issue "
        "fla-640-refusal (" in text
    )
    assert "causal_conv1d 1.6.0+kernelguard.fake imports causal_conv1d.causal_conv1d_fn." in text
    assert _verdict(proc.stdout) == (
        "verdict: OK - all 3 required kernels are served; allowed fallbacks: varlen_attention (exit 0)"
    )

    config = write_config(tmp_path / "small", key_dim=64)
    wrong = kg_json(
        "--model",
        str(config),
        "--arch",
        "9.0",
        "--allow",
        "attention",
        "--allow",
        "fla-640-refusal",
        cwd=tmp_path,
        rc=1,
        pythonpath=paths,
    )
    fla = candidate(wrong, "chunk_gated_delta_rule", "package")
    assert (fla["status"], fla["known_issues"]) == ("rejected", ["fla-640-wrong-grads"])
    # This torch (2.13) requires triton==3.7.1 (its metadata, or kernelguard's table for a CPU build).
    assert fla["fix"] == "pip install 'triton==3.7.1'"
    assert fla["fix_note"].startswith(f"the Triton torch {TORCH} requires; ")


# ------------------------------------------------------------------------------------------ broken torch


@no_fast_packages
def test_check_runs_and_reports_when_torch_cannot_be_imported(tmp_path: Path) -> None:
    broken = tmp_path / "broken-torch"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text('raise ImportError("torch is broken on purpose")\n')
    proc = kg("check", cwd=tmp_path, pythonpath=(broken,))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(
        rf"^torch {re.escape(TORCH)} \(import fails\) \(no CUDA, ABI unknown\) \|", proc.stdout, re.MULTILINE
    )
    assert (
        "  - torch could not be imported: ImportError: torch is broken on purpose" in proc.stdout.splitlines()
    )
    data = kg_json(cwd=tmp_path, rc=1, pythonpath=(broken,))
    assert data["environment"]["torch_error"] == "ImportError: torch is broken on purpose"
    assert data["environment"]["cxx11_abi"] == {"value": None, "source": "import torch"}


def test_train_subcommand_passes_everything_through(tmp_path: Path) -> None:
    helped = kg("train", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "--block-size" in helped.stdout
    missing = kg("train", cwd=tmp_path)
    assert missing.returncode == 2
    assert "kernelguard train: error: --model is required." in missing.stderr
    assert "Traceback" not in missing.stderr
