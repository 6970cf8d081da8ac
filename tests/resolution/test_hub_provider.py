"""Offline Kernel Hub probe: variant choice and rejection reasons come from kernels' own resolver.

Repositories are built in tmp_path with the Hub layout (build/<variant>/ holding ``__init__.py`` and
``metadata.json``, what kernels needs to load a variant; choosing one only needs the folder name).
No network: HF_HUB_OFFLINE=1 and every cache lookup is local_files_only.

The same tests run against whichever kernels release is installed (0.16 through 0.19: CI installs the ones its
transformers stacks accept). Where the releases behave differently the test asks the installed kernels what it
offers or does, never a table of versions, and asserts that release's behaviour.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from kernelguard.resolution.providers import hub, kernels_release
from kernelguard.resolution.providers.hub import HubKernelProbe, HubTarget, probe_hub_kernel

REPO = "kernels-community/demo"
CPU_213 = HubTarget(torch_version="2.13.0+cpu", cxx11_abi=True, cpu="x86_64", os="linux")
CUDA_212 = HubTarget(torch_version="2.12", cuda_version="12.8", gpu_capability=(9, 0))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    # An empty cache of our own, so a developer's real HF cache can never leak into a test.
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "empty-cache"))


pytest.importorskip("kernels", reason="the Hub tests need the hub extra: pip install -e '.[dev]'")
KERNELS_VERSION = metadata.version("kernels")
# Private modules a kernels release may lack (0.16 has none of the 0.17 ones and vice versa), where 0.16-0.18 keep
# them and where 0.19 does (under kernels._internals, names unchanged).
_PRIVATE_NAMES = ("_rust", "_versions", "load", "utils", "validate", "minver", "archs")
OLD_LAYOUT = tuple(f"kernels.{name}" for name in _PRIVATE_NAMES)
PRIVATE_MODULES = OLD_LAYOUT + tuple(f"kernels._internals.{name}" for name in _PRIVATE_NAMES)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package (kernels._internals before 0.19) does not exist
        return False


def _variants_module() -> Any:
    """The installed kernels' variants module, found as the probe finds it (0.19: kernels._internals.variants)."""
    return kernels_release.import_kernels().variants


def _resolver_parameters() -> set[str]:
    return set(inspect.signature(_variants_module()._resolve_variant_for_system).parameters)


def _kernels_refuses_a_too_new_minver(tmp_path: Path) -> bool:
    """Whether the installed kernels' own loader refuses a variant needing a newer kernels (0.16 only warns)."""
    import kernels

    _add_variant(tmp_path / "minver" / "build", "torch-universal", extra={"kernels-minver": "99.1.2"})
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            kernels.get_local_kernel(tmp_path / "minver")
        except RuntimeError as exc:
            assert "requires kernels>=99.1.2" in str(exc)
            return True
    assert any("requires kernels>=99.1.2" in str(w.message) for w in warned), "kernels neither refused nor warned"
    return False


def _add_variant(
    build: Path,
    name: str,
    *,
    backend: str = "cpu",
    archs: list[str] | None = None,
    extra: dict[str, object] | None = None,
) -> None:
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
        **(extra or {}),
    }
    (folder / "metadata.json").write_text(json.dumps(metadata))


# A `layers` module offering the GDN ops as kernels-community/fla does (check --hub has the installed kernels load
# and validate it): torch layers whose forward matches transformers 5.17-5.24's torch reference in parameter count
# and kinds, as kernels requires.
_FLA_LAYERS = """
import torch


class chunk_gated_delta_rule(torch.nn.Module):
    def forward(self, q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        pass


class recurrent_gated_delta_rule(torch.nn.Module):
    def forward(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        pass
"""


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


def test_a_mapping_that_turns_the_arch_check_off_is_said_to_load_a_build_that_may_crash(tmp_path: Path) -> None:
    """kernels 0.19's LayerRepository(check_arch=False): the build whose archs miss the GPU is loaded, not refused."""
    from kernelguard.resolution.discovery import _hub_mapping

    repo = _repo(tmp_path / "repo", ["torch212-cxx11-cu128-x86_64-linux"], backend="cuda", archs=["8.0", "9.0a"])
    blackwell = HubTarget(torch_version="2.12", cuda_version="12.8", gpu_capability=(12, 0))
    probe = probe_hub_kernel(REPO, target=blackwell, local_path=str(repo), check_arch=False)
    assert probe.note == (
        "Variant torch212-cxx11-cu128-x86_64-linux declares CUDA archs 8.0, 9.0a, which do not cover compute "
        "capability 12.0; transformers' kernel mapping passes check_arch=False, so kernels loads it anyway and it "
        "may fail or crash the process at run time on this GPU.")
    hopper = HubTarget(torch_version="2.12", cuda_version="12.8", gpu_capability=(9, 0))  # the control: covered
    assert probe_hub_kernel(REPO, target=hopper, local_path=str(repo), check_arch=False).note is None
    # read from transformers' mapping source, per kernel
    root = tmp_path / "transformers"
    (root / "integrations").mkdir(parents=True)
    (root / "integrations" / "hub_kernels.py").write_text(
        '_KERNEL_MAPPING = {\n'
        '    "selective_scan_fn": {\n        "cuda": {\n            Mode.TRAINING: LayerRepository(\n'
        '                repo_id="kernels-community/mamba-ssm",\n                layer_name="selective_scan_fn",\n'
        '                version=5,\n                check_arch=False,\n            ),\n        },\n    },\n'
        '    "causal_conv1d_fn": {\n        "cuda": {\n            Mode.TRAINING: LayerRepository(\n'
        '                repo_id="kernels-community/causal-conv1d",\n                layer_name="causal_conv1d_fn",\n'
        '                version=1,\n            ),\n        },\n    },\n}\n')
    mapping = _hub_mapping(str(root))
    assert mapping["selective_scan_fn"].check_arch is False
    assert mapping["causal_conv1d_fn"].check_arch is True and mapping["causal_conv1d_fn"].version == 1


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
    cache = tmp_path / "empty-cache"
    assert f"`hf download {REPO} --repo-type kernel --revision main --cache-dir {cache}`" in probe.note
    assert "LOCAL_KERNELS" in probe.note
    # the version transformers' mapping asks for is the branch kernels resolves it through: exactly that one
    pinned = probe_hub_kernel(REPO, target=CPU_213, version=3)
    assert f"`hf download {REPO} --repo-type kernel --revision v3 --cache-dir {cache}`" in str(pinned.note)


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
    variants = _variants_module()
    monkeypatch.delattr(variants, "_resolve_variant_for_system")
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))

    assert probe.note == (
        f"kernels failed while resolving {REPO}: LookupError('kernels {KERNELS_VERSION} has no "
        f"{variants.__name__}._resolve_variant_for_system, so only this machine (no --arch or other made-up "
        "target) can be resolved')."
    )


def test_bad_target_backend_degrades_to_note(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])
    probe = probe_hub_kernel(REPO, target=HubTarget("2.13", backend="quantum1"), local_path=str(repo))
    assert probe.chosen_variant is None
    # kernels' own ValueError: "Unknown backend variant string: 'quantum1'" (0.16-0.18), "... parts: ['quantum1']"
    # (0.19, which parses a variant name's parts)
    assert probe.note is not None and "Unknown backend variant" in probe.note and "'quantum1'" in probe.note


def test_live_system_target(tmp_path: Path) -> None:
    # Whatever this machine is, a universal noarch build is always acceptable to kernels.
    repo = _repo(tmp_path / "repo", ["torch-universal", "torch10-cxx11-cpu-riscv-plan9"])
    probe = probe_hub_kernel(REPO, local_path=str(repo))
    assert probe.note is None, probe.note
    assert probe.chosen_variant == "torch-universal"
    assert not _by_name(probe)["torch10-cxx11-cpu-riscv-plan9"].accepted


def test_resolves_without_any_private_kernels_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release lacking every private helper (as 0.16 lacks kernels._rust) still resolves variants."""
    for name in PRIVATE_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # `import` of a None entry raises ImportError
    repo = _repo(tmp_path / "repo", ["torch213-cxx11-cu128-x86_64-linux"], backend="cuda", archs=["9.0"])
    cuda_213 = HubTarget(torch_version="2.13", cuda_version="12.8", gpu_capability=(9, 0))

    probe = probe_hub_kernel(REPO, target=cuda_213, local_path=str(repo))

    assert probe.chosen_variant == "torch213-cxx11-cu128-x86_64-linux"
    assert probe.note == (
        f"kernels {KERNELS_VERSION} has no CUDA arch check kernelguard can reuse, so variant "
        "torch213-cxx11-cu128-x86_64-linux's declared archs (9.0) were not checked against compute capability 9.0."
    )

    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO}={repo}")
    from_env = probe_hub_kernel(REPO, target=cuda_213)
    assert from_env.note is not None
    assert from_env.note.startswith(
        f"kernels {KERNELS_VERSION} has no LOCAL_KERNELS parser kernelguard knows, so LOCAL_KERNELS is ignored."
    )


def test_each_release_uses_its_own_helpers() -> None:
    """Feature detection picks 0.17/0.18's kernels.load, 0.19's kernels._internals.load or 0.16's kernels.utils,
    never neither."""
    found = kernels_release.import_kernels()
    assert found.version == KERNELS_VERSION
    assert found.parse_local_kernels is not None
    assert found.minver_problem is not None
    assert found.supports_capability is not None
    assert found.versions is not None
    owner = found.parse_local_kernels.__module__
    homes = [m for m in ("kernels.load", "kernels._internals.load", "kernels.utils") if _importable(m)]
    assert owner == homes[0], homes  # the module the installed release parses LOCAL_KERNELS in
    assert sys.modules[owner]._parse_local_kernel_overrides is found.parse_local_kernels


def test_variant_needing_a_newer_kernels(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _add_variant(repo / "build", "torch213-cxx11-cpu-x86_64-linux", extra={"kernels-minver": "99.1.2"})

    probe = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))

    assert probe.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"
    assert probe.note is not None
    expected = (
        "Kernel 'demo' variant 'torch213-cxx11-cpu-x86_64-linux' requires kernels>=99.1.2, "
        f"but version {KERNELS_VERSION} is installed."
    )
    assert probe.note.startswith(expected), probe.note
    if _kernels_refuses_a_too_new_minver(tmp_path):  # kernels >= 0.17 refuses to load it
        assert "only warns" not in probe.note
    else:  # kernels 0.16 warns and loads it anyway
        assert probe.note.endswith("(this kernels release only warns and loads it anyway)")


def test_macos_version_is_passed_only_to_releases_that_take_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", ["torch213-cpu-aarch64-darwin", "torch-universal"])
    mac = HubTarget(torch_version="2.13", backend="metal", cxx11_abi=None, cpu="aarch64", os="darwin",
                    macos_version="15.0")

    probe = probe_hub_kernel(REPO, target=mac, local_path=str(repo))

    assert probe.chosen_variant is not None
    takes_macos = "macos_version" in _resolver_parameters()
    ignored = f"kernels {KERNELS_VERSION} does not consider the macOS version when choosing a variant."
    if takes_macos:
        assert probe.note is None or ignored not in probe.note
    else:
        assert probe.note is not None and ignored in probe.note


_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
_NEXT_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor + 1}"


def test_a_made_up_target_runs_under_this_python_unless_told(tmp_path: Path) -> None:
    """kernels 0.19 rejects a variant built for a newer Python, and for abi3 on free-threaded Python; left to
    itself its resolver assumes a GIL-enabled Python 3.15 and would choose a variant this Python cannot load."""
    if "python_version" not in _resolver_parameters():  # 0.16-0.18: variant names carry no Python version
        repo = _repo(tmp_path / "repo", ["torch213-cxx11-cpu-x86_64-linux"])
        told = probe_hub_kernel(REPO, target=dataclasses.replace(CPU_213, python_version=_NEXT_PYTHON),
                                local_path=str(repo))
        assert told.chosen_variant == "torch213-cxx11-cpu-x86_64-linux"
        assert told.note == f"kernels {KERNELS_VERSION} does not consider the Python version when choosing a variant."
        return
    older = "torch-2.13-cxx11-cpu-cpython-3.9-abi3-x86_64-linux"
    newer = f"torch-2.13-cxx11-cpu-cpython-{_NEXT_PYTHON}-abi3-x86_64-linux"
    repo = _repo(tmp_path / "repo", [older, newer])

    here = probe_hub_kernel(REPO, target=CPU_213, local_path=str(repo))
    later = probe_hub_kernel(REPO, target=dataclasses.replace(CPU_213, python_version=f"{_NEXT_PYTHON}.1"),
                             local_path=str(repo))
    free_threaded = probe_hub_kernel(REPO, target=dataclasses.replace(CPU_213, free_threaded=True),
                                     local_path=str(repo))

    assert (here.chosen_variant, here.note) == (older, None)
    assert _by_name(here)[newer].reason == (
        f"Rejected by kernels: Python {_NEXT_PYTHON} or later is required, system Python version is {_PYTHON}.")
    assert (later.chosen_variant, later.note) == (newer, None)  # kernels prefers the newest Python it can load
    assert free_threaded.chosen_variant is None
    assert "abi3 is not supported on free-threaded Python" in _by_name(free_threaded)[older].reason


def test_pinned_version_is_read_from_the_cache_without_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE")  # kernels 0.16 would list refs on the Hub unless offline
    import huggingface_hub.hf_api

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the probe asked the Hub")

    monkeypatch.setattr(huggingface_hub.hf_api.HfApi, "list_repo_refs", no_network)
    _cache_snapshot(cache, "v1", "a" * 40, ["torch213-cxx11-cpu-x86_64-linux"])

    pinned = probe_hub_kernel(REPO, target=CPU_213, version=1)
    missing = probe_hub_kernel(REPO, target=CPU_213, version=7)

    assert (pinned.revision, pinned.chosen_variant) == ("a" * 40, "torch213-cxx11-cpu-x86_64-linux")
    assert missing.source == "not available offline"
    assert missing.note is not None and "Version 7 not found" in missing.note


def test_hub_target_fields_match_kernels_resolver_arguments() -> None:
    """Every system fact the installed kernels' resolver takes has a HubTarget field (drift alarm): a fact
    without one would be left to kernels' default, which describes no real target."""
    field_of = {"selected_backend": ("cuda_version", "backend"), "cpu": ("cpu",), "os": ("os",),
                "torch_version": ("torch_version",), "torch_cxx11_abi": ("cxx11_abi",),
                "tvm_ffi_version": ("tvm_ffi_version",), "macos_version": ("macos_version",),
                "python_version": ("python_version",), "free_threaded": ("free_threaded",), "has_mlx": ("has_mlx",)}
    taken = _resolver_parameters() - {"variants"}
    assert taken <= set(field_of), taken - set(field_of)
    fields = {f.name for f in dataclasses.fields(HubTarget)}
    assert all(set(field_of[name]) <= fields for name in taken), fields


@pytest.mark.slow
def test_check_cli_selects_a_local_hub_kernel_when_kernels_is_in_transformers_window(tmp_path: Path) -> None:
    """End to end on whichever stack is installed: transformers 5.17 + kernels 0.16.2 serves the Hub kernel
    (it failed with "cannot import name '_rust'" before); 5.24 + 0.17.2 is outside 5.24's window."""
    import os
    import subprocess

    from packaging.version import Version
    from transformers.utils import import_utils

    low, high = import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION
    repo = _repo(tmp_path / "fla", ["torch213-cxx11-cpu-x86_64-linux", "torch212-cxx11-cpu-x86_64-linux"])
    for variant in (repo / "build").iterdir():  # the layers transformers maps to kernels-community/fla
        (variant / "layers.py").write_text(_FLA_LAYERS)
        (variant / "__init__.py").write_text("from . import layers\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", KERNELS_CACHE=str(tmp_path / "cache"),
               LOCAL_KERNELS=f"kernels-community/fla={repo}")
    proc = subprocess.run(
        [sys.executable, "-m", "kernelguard", "check", "--model", "qwen3_5", "--hub", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    gdn = next(k for k in report["kernels"] if k["kernel"] == "chunk_gated_delta_rule")
    [hub_candidate] = [c for c in gdn["candidates"] if c["kind"] == "hub"]
    if Version(low) <= Version(KERNELS_VERSION) < Version(high):
        assert hub_candidate["status"] in ("selected", "accepted"), hub_candidate
        assert hub_candidate["reason"] == (
            f"build variant torch213-cxx11-cpu-x86_64-linux from LOCAL_KERNELS; kernels {KERNELS_VERSION} accepts "
            "its `chunk_gated_delta_rule` layer.")
    else:
        assert hub_candidate["status"] == "rejected"
        assert f"kernels {KERNELS_VERSION} is outside [{low}, {high})" in hub_candidate["reason"]


# ------------------------------------------ the layer, judged by the installed kernels (every window CI installs) ---
# Each class of variant the installed kernels itself refuses or accepts; kernelguard's verdict must be kernels' own,
# its reason kernels' message. check_hub_layer has kernels load the variant as kernelize() would.
_VARIANT = "torch213-cxx11-cpu-x86_64-linux"
_GDN_FORWARD = """
    def forward(self, q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs):
        pass
"""


def _judge(tmp_path: Path, layers: str, *, training: bool = True, extra: dict[str, object] | None = None) -> Any:
    from kernelguard.resolution.providers.hub_layers import check_hub_layer
    from kernelguard.resolution.transformers_calls import CallShape, Parameter

    _add_variant(tmp_path / "fla" / "build", _VARIANT, extra=extra)
    folder = tmp_path / "fla" / "build" / _VARIANT
    (folder / "__init__.py").write_text("from . import layers\n")
    (folder / "layers.py").write_text("import torch\n" + layers)
    names = ["query", "key", "value", "g", "beta", "chunk_size=", "initial_state=", "output_final_state=",
             "use_qk_l2norm_in_kernel="]
    reference = tuple(Parameter(n.rstrip("="), "POSITIONAL_OR_KEYWORD", n.endswith("=")) for n in names)
    reference += (Parameter("kwargs", "VAR_KEYWORD", False),)
    call = CallShape("torch_chunk_gated_delta_rule", 3, ("g", "beta", "initial_state"), spreads=True)
    return check_hub_layer("chunk_gated_delta_rule", "kernels-community/fla", "chunk_gated_delta_rule", folder,
                           call, packed=True, training=training, reference=reference)


def _refused(message: str, mode: str = "training") -> str:
    return f"check 1 (kernels accepts the layer) failed: kernels {KERNELS_VERSION} refuses it for {mode}: {message}"


def _fell_back(message: str, mode: str = "training") -> str:
    return (f"check 1 (kernels accepts the layer) failed: kernels {KERNELS_VERSION} does not use it for {mode}, so "
            f"kernelize() falls back to transformers' torch reference: {message}")


_REPO_NAMED = f"`kernels-community/fla` (variant {_VARIANT}), layer `chunk_gated_delta_rule`"


def _kernels_own_kernelize(tmp_path: Path, layers: str, mode: str) -> str:
    """What the installed kernels does with ``layers`` when its own ``kernelize`` loads them through its own
    ``LocalLayerRepository`` for ``mode``: "raises", "falls back" (keeps the original forward) or "uses it"."""
    import kernels
    import torch

    _add_variant(tmp_path / "own" / "build", "torch-universal")
    variant = tmp_path / "own" / "build" / "torch-universal"
    (variant / "__init__.py").write_text("from . import layers\n")
    (variant / "layers.py").write_text("import torch\n" + layers)

    @kernels.use_kernel_forward_from_hub("chunk_gated_delta_rule")
    class Reference(torch.nn.Module):
        def forward(self, query, key, value, g, beta, chunk_size=None, initial_state=None, output_final_state=None,
                    use_qk_l2norm_in_kernel=None, **kwargs):
            raise AssertionError("never called")

    model, kernels_mode = Reference(), getattr(kernels.Mode, mode)
    repo = kernels.LocalLayerRepository(repo_path=tmp_path / "own", layer_name="chunk_gated_delta_rule")
    with kernels.use_kernel_mapping({"chunk_gated_delta_rule": {"cpu": {kernels_mode: repo}}}, inherit_mapping=False):
        try:
            kernels.kernelize(model, mode=kernels_mode, device="cpu")
        except ValueError:
            return "raises"
    return "falls back" if getattr(model.forward, "__func__", None) is Reference.forward else "uses it"


def test_a_layer_without_backward_serves_inference_only(tmp_path: Path) -> None:
    """0.16-0.18 refuse such a layer in training; 0.19 keeps transformers' torch reference without an error, the
    slow path kernelguard exists to catch: either way the Hub kernel does not run in training."""
    layers = "class chunk_gated_delta_rule(torch.nn.Module):\n    has_backward = False\n" + _GDN_FORWARD
    training = _judge(tmp_path / "t", layers)
    inference = _judge(tmp_path / "i", layers, training=False)
    kernels_in_training = _kernels_own_kernelize(tmp_path / "kt", layers, "TRAINING")
    if kernels_in_training == "raises":
        assert training.problem == _refused(
            f"Function/layer from repo {_REPO_NAMED} does not support backward. Was registered for "
            "`chunk_gated_delta_rule` with mode `Mode.TRAINING`")
    else:
        assert kernels_in_training == "falls back"
        assert training.problem == _fell_back("Layer does not support backward, using fallback")
    assert _kernels_own_kernelize(tmp_path / "ki", layers, "INFERENCE") == "uses it"
    assert (inference.problem, inference.judged_by) == (None, f"kernels {KERNELS_VERSION}")


def test_kernels_minver_above_the_installed_kernels(tmp_path: Path) -> None:
    layers = "class chunk_gated_delta_rule(torch.nn.Module):\n" + _GDN_FORWARD
    result = _judge(tmp_path, layers, extra={"kernels-minver": "99.1.2"})
    message = (f"Kernel 'demo' variant '{_VARIANT}' requires kernels>=99.1.2, but version {KERNELS_VERSION} is "
               "installed. Upgrade with: pip install --upgrade kernels")
    if _kernels_refuses_a_too_new_minver(tmp_path):  # kernels >= 0.17 refuses to load it
        assert result.problem == _refused(message)
    else:  # kernels 0.16 warns and loads it anyway: so does our verdict (the probe's note quotes the warning)
        assert result.problem is None


def test_kernels_refuses_a_layer_that_overrides_the_module_constructor(tmp_path: Path) -> None:
    layers = ("class chunk_gated_delta_rule(torch.nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n" + _GDN_FORWARD)
    assert _judge(tmp_path, layers).problem == _refused(f"{_REPO_NAMED} must not override nn.Module constructor.")


def test_kernels_accepts_a_forward_inherited_from_a_base_class(tmp_path: Path) -> None:
    layers = "class Base(torch.nn.Module):\n" + _GDN_FORWARD + "\n\nclass chunk_gated_delta_rule(Base):\n    pass\n"
    result = _judge(tmp_path, layers)
    assert (result.problem, result.judged_by, result.note) == (None, f"kernels {KERNELS_VERSION}", None)


def test_kernels_accepts_a_module_level_alias_of_the_mapped_name(tmp_path: Path) -> None:
    layers = "class GatedDeltaRule(torch.nn.Module):\n" + _GDN_FORWARD + "\n\nchunk_gated_delta_rule = GatedDeltaRule\n"
    result = _judge(tmp_path, layers)
    assert (result.problem, result.judged_by, result.note) == (None, f"kernels {KERNELS_VERSION}", None)


def test_kernels_019_layout_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels 0.19 keeps every private module under kernels._internals with its name unchanged
    (kernels._internals._versions, kernels._internals.layer.layer) and kernels._rust where it was. Installed, that
    layout is checked as it is; otherwise a stand-in of it is built from the installed release, so every CI
    environment checks it: each private helper is still found, and nothing is imported unconditionally."""
    import importlib

    if _importable("kernels._internals"):  # the real layout: every helper comes from it
        found = kernels_release.import_kernels()
        helpers = (found.parse_local_kernels, found.supports_capability, found.get_kernel_layer)
        assert [h.__module__.startswith("kernels._internals.") for h in helpers] == [True] * 3
        assert found.versions is not None and found.versions.__name__ == "kernels._internals._versions"
        assert found.minver_problem is not None and found.minver_refuses
        return
    moved = {}
    for name in OLD_LAYOUT + ("kernels.layer.layer",):
        if name == "kernels._rust":  # 0.19 leaves the compiled extension in place
            continue
        module = sys.modules.get(name) or (importlib.import_module(name) if _importable(name) else None)
        if module is None:
            continue
        moved[f"kernels._internals.{name.removeprefix('kernels.')}"] = module
        monkeypatch.setitem(sys.modules, name, None)  # import of the old path now raises ImportError
    for name, module in moved.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "kernels._internals", sys.modules["kernels"])

    found = kernels_release.import_kernels()

    assert found.parse_local_kernels is not None and found.versions is not None
    assert found.get_kernel_layer is not None and found.minver_problem is not None
    assert found.minver_refuses == ("kernels._internals.validate" in moved)
