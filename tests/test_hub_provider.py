"""Offline Kernel Hub probe: variant choice and rejection reasons come from kernels' own resolver.

Repositories are built in tmp_path with the Hub layout (build/<variant>/ holding ``__init__.py`` and
``metadata.json``, what kernels needs to load a variant; choosing one only needs the folder name).
No network: HF_HUB_OFFLINE=1 and every cache lookup is local_files_only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernelguard.providers import hub
from kernelguard.providers.hub import HubKernelProbe, HubTarget, probe_hub_kernel

REPO = "kernels-community/demo"
CPU_213 = HubTarget(torch_version="2.13.0+cpu", cxx11_abi=True, cpu="x86_64", os="linux")
CUDA_212 = HubTarget(torch_version="2.12", cuda_version="12.8", gpu_capability=(9, 0))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    # An empty cache of our own, so a developer's real HF cache can never leak into a test.
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "empty-cache"))


def _add_variant(build: Path, name: str, *, backend: str = "cpu", archs: list[str] | None = None) -> None:
    folder = build / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    backend_info: dict[str, object] = {"type": backend}
    if archs is not None:
        backend_info["archs"] = archs
    metadata = {
        "id": f"demo-{name}",
        "name": "demo",
        "version": 1,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": backend_info,
    }
    (folder / "metadata.json").write_text(json.dumps(metadata))


def _repo(root: Path, variants: list[str], *, backend: str = "cpu", archs: list[str] | None = None) -> Path:
    for name in variants:
        _add_variant(root / "build", name, backend=backend, archs=archs)
    return root


def _by_name(probe: HubKernelProbe) -> dict[str, hub.VariantVerdict]:
    return {v.variant: v for v in probe.variants}


def test_cpu_target_picks_exact_torch_build_and_explains_each_rejection(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path / "repo",
        [
            "torch213-cxx11-cpu-x86_64-linux",
            "torch212-cxx11-cpu-x86_64-linux",
            "torch213-cxx98-cpu-x86_64-linux",
            "torch213-cxx11-cu128-x86_64-linux",
            "torch213-cxx11-cpu-aarch64-linux",
            "torch213-cxx11-cpu-x86_64-windows",
            "torch-stable-abi214-cpu-x86_64-linux",
            "tvm-ffi01-cpu-x86_64-linux",
            "torch-cpu",
            "torch-cuda",
            "torch-universal",
        ],
    )
    (repo / "build" / "not-a-variant").mkdir()
    (repo / "build" / "__pycache__").mkdir()

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))

    assert probe.source == "local folder"
    assert probe.location == str(repo)
    assert probe.trusted
    assert probe.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"
    assert probe.note is None, probe.note
    verdicts = _by_name(probe)
    assert "__pycache__" not in verdicts
    assert probe.variants[0].variant == probe.chosen_variant  # kernels' preference order is kept
    assert {name for name, v in verdicts.items() if v.accepted} == {
        "torch213-cxx11-cpu-x86_64-linux",
        "torch-cpu",
        "torch-universal",
    }
    expected_reasons = {
        "torch212-cxx11-cpu-x86_64-linux": "Torch version (2.12) does not match environment Torch version (2.13)",
        "torch213-cxx98-cpu-x86_64-linux": "Torch CXX11 ABI (False) does not match environment Torch CXX11 ABI (True)",
        "torch213-cxx11-cu128-x86_64-linux": "backend (cu128) does not match selected backend (cpu)",
        "torch213-cxx11-cpu-aarch64-linux": "CPU (aarch64) does not match system CPU (x86_64)",
        "torch213-cxx11-cpu-x86_64-windows": "OS (windows) does not match system OS (linux)",
        "torch-stable-abi214-cpu-x86_64-linux": "Torch stable ABI version (2.14) is too new",
        "tvm-ffi01-cpu-x86_64-linux": "tvm-ffi version (0.1) does not match environment tvm-ffi version (None)",
        "torch-cuda": "backend (cuda) does not match system backend (cpu) and is not universal",
        "not-a-variant": "Unknown framework in variant string",
    }
    for name, fragment in expected_reasons.items():
        verdict = verdicts[name]
        assert not verdict.accepted, name
        assert fragment in verdict.reason, (name, verdict.reason)
        assert verdict.reason.endswith(".")
    assert "torch213-cxx11-cpu-x86_64-linux" in verdicts["torch-cpu"].reason  # says who won


def test_stable_abi_build_is_preferred_when_old_enough(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux", "torch-stable-abi210-cpu-x86_64-linux"]
    )
    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))
    assert probe.chosen_variant == "torch-stable-abi210-cpu-x86_64-linux"
    assert all(v.accepted for v in probe.variants)


def test_made_up_cuda_target_picks_highest_compatible_minor(tmp_path: Path) -> None:
    names = [f"torch212-cxx11-{cu}-x86_64-linux" for cu in ("cu126", "cu128", "cu129", "cu130")]
    repo = _repo(
        tmp_path / "repo", [*names, "torch213-cxx11-cu128-x86_64-linux"], backend="cuda", archs=["9.0"]
    )

    probe = probe_hub_kernel(REPO, target=CUDA_212, local_path=str(repo))

    assert probe.chosen_variant == "torch212-cxx11-cu128-x86_64-linux"
    assert probe.note is None, probe.note
    verdicts = _by_name(probe)
    assert verdicts["torch212-cxx11-cu126-x86_64-linux"].accepted
    assert "CUDA version (12.9) is not compatible with system CUDA version (12.8)" in (
        verdicts["torch212-cxx11-cu129-x86_64-linux"].reason
    )
    assert "CUDA version (13.0) is not compatible" in verdicts["torch212-cxx11-cu130-x86_64-linux"].reason
    assert "Torch version (2.13)" in verdicts["torch213-cxx11-cu128-x86_64-linux"].reason


def test_gpu_capability_is_checked_against_chosen_variant_archs(tmp_path: Path) -> None:
    repo = _repo(
        tmp_path / "repo", ["torch212-cxx11-cu128-x86_64-linux"], backend="cuda", archs=["8.0", "9.0a"]
    )
    blackwell = HubTarget(torch_version="2.12", cuda_version="12.8", gpu_capability=(12, 0))

    probe = probe_hub_kernel(REPO, target=blackwell, local_path=str(repo))

    assert probe.chosen_variant == "torch212-cxx11-cu128-x86_64-linux"
    assert probe.note is not None
    assert "do not cover compute capability 12.0" in probe.note
    assert "check_arch=False" in probe.note


def test_nothing_compatible_gives_no_choice_but_all_reasons(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch211-cxx11-cu130-x86_64-linux"])
    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))
    assert probe.chosen_variant is None
    assert [v.variant for v in probe.variants] == ["torch211-cxx11-cu130-x86_64-linux"]
    assert "Torch version (2.11)" in probe.variants[0].reason


def test_local_kernels_env_mapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "checkout", ["torch213-cxx11-cpu-x86_64-linux"])
    monkeypatch.setenv("LOCAL_KERNELS", f"kernels-community/other={tmp_path}:{REPO}={repo}")

    probe = probe_hub_kernel(REPO, target=CPU_213)

    assert probe.source == "LOCAL_KERNELS"
    assert probe.location == str(repo)
    assert probe.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"


def test_local_path_wins_over_local_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_repo = _repo(tmp_path / "env", ["torch212-cxx11-cpu-x86_64-linux"])
    arg_repo = _repo(tmp_path / "arg", ["torch213-cxx11-cpu-x86_64-linux"])
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={env_repo}")

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(arg_repo))

    assert probe.source == "local folder"
    assert probe.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"


def test_local_path_pointing_at_one_variant_folder(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])
    variant = repo / "build" / "torch213-cxx11-cpu-x86_64-linux"
    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(variant))
    assert probe.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"
    assert probe.variants[0].accepted


def test_malformed_local_kernels_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_KERNELS", "no-equals-sign")
    probe = probe_hub_kernel(REPO, target=CPU_213)
    assert probe.source == "not available offline"
    assert probe.note is not None and "Invalid LOCAL_KERNELS entry" in probe.note


def _cache_snapshot(cache: Path, ref: str, commit: str, variants: list[str]) -> None:
    storage = cache / f"kernels--{REPO.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    for name in variants:
        _add_variant(storage / "snapshots" / commit / "build", name)


def test_offline_cache_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    _cache_snapshot(cache, "v1", "a" * 40, ["torch212-cxx11-cpu-x86_64-linux"])
    _cache_snapshot(cache, "v2", "b" * 40, ["torch213-cxx11-cpu-x86_64-linux"])

    latest = probe_hub_kernel(REPO, target=CPU_213)
    pinned = probe_hub_kernel(REPO, target=CPU_213, version=1)

    assert latest.source == "offline cache"
    assert latest.revision == "b" * 40
    assert latest.location is not None and latest.location.endswith("build")
    assert latest.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"
    assert pinned.revision == "a" * 40
    assert pinned.chosen_variant is None
    assert "Torch version (2.12)" in pinned.variants[0].reason


def test_nothing_found_offline(tmp_path: Path) -> None:
    probe = probe_hub_kernel(REPO, target=CPU_213)
    assert probe.source == "not available offline"
    assert probe.location == str(tmp_path / "empty-cache")
    assert probe.chosen_variant is None and probe.variants == ()
    assert probe.note is not None
    assert f"hf download {REPO} --repo-type kernel" in probe.note
    assert "LOCAL_KERNELS" in probe.note


def test_untrusted_org_is_marked_and_not_resolved(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])
    probe = probe_hub_kernel("someone/fast-gdn", target=CPU_213, local_path=str(repo))
    assert not probe.trusted
    assert probe.chosen_variant is None and probe.variants == ()
    assert probe.note is not None
    assert "outside the trusted organisations (kernels-community)" in probe.note
    assert "pass --allow untrusted-hub-repo to accept it" in probe.note

    allowed = probe_hub_kernel("someone/fast-gdn", target=CPU_213, local_path=str(repo), allow_untrusted=True)
    assert allowed.trusted
    assert allowed.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"


def test_kernels_import_failure_degrades_to_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "kernels" or m.startswith("kernels.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "kernels", None)  # a None entry makes `import kernels` fail

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(tmp_path))

    assert probe.chosen_variant is None and probe.variants == ()
    assert probe.note is not None and probe.note.startswith("kernels could not be imported:")


def test_kernels_internals_drift_degrades_to_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.variants

    monkeypatch.delattr(kernels.variants, "_resolve_variant_for_system")
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))

    assert probe.note is not None and "kernels failed while resolving" in probe.note


def test_bad_target_backend_degrades_to_note(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])
    probe = probe_hub_kernel(REPO, target=HubTarget("2.13", backend="quantum1"), local_path=str(repo))
    assert probe.note is not None and "Unknown backend variant string" in probe.note


def test_live_system_target(tmp_path: Path) -> None:
    # Whatever this machine is, a universal noarch build is always acceptable to kernels.
    repo = _repo(tmp_path / "repo", ["torch-universal", "torch10-cxx11-cpu-riscv-plan9"])
    probe = probe_hub_kernel(REPO, local_path=str(repo))
    assert probe.note is None, probe.note
    assert probe.chosen_variant == "torch-universal"
    assert not _by_name(probe)["torch10-cxx11-cpu-riscv-plan9"].accepted
