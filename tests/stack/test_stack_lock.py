"""kernelguard.lock: written from a passing check, refused on a node that drifted, one line per difference.

The image and the node are made-up facts (the probes are the check's own tests' business); each drift kind is
one fact changed between the two: a version, the bytes of a .so, the GPU, a Hub revision, a missing package, the
allow items, fla's backend. The refusal text is asserted exactly.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from check_helpers import cuda_so, make_env, make_ext, make_pkg

from kernelguard.errors import ConfigError, LockMismatch
from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.env import Fact
from kernelguard.resolution.facts import Facts, FlaBackend, HubKernelProbe
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.resolution.resolver import Target, resolve
from kernelguard.stack import stack_lock
from kernelguard.stack.compose import CheckOptions, CheckResult

WINDOW = ("0.18.2", "0.19.0")
CONV = "pip install setuptools wheel ninja packaging && pip install --no-build-isolation --no-cache-dir " \
    "--force-reinstall --no-deps 'causal-conv1d==1.7.0'"
FLA_PROVIDER = "fla (fla.ops.gated_delta_rule.chunk_gated_delta_rule)"
HEAD = ("this node's stack differs from {lock} (written for qwen3_5 training on sm 9.0): {n} difference(s), so the "
        "kernels the image verified are not the ones this job would run.")


def _backend(backward: str) -> FlaBackend:
    return FlaBackend("9.0", "triton", backward, (), "made up")


def _facts(tmp: Path, *, so: bytes | None = None, fla: str = "0.6.0", conv: str | None = "1.7.0",
           gpus: tuple[str, ...] = ("9.0",), backward: str = "tilelang", hub: HubKernelProbe | None = None,
           kernels: str = "0.18.2") -> Facts:
    so_path = tmp / "causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so"
    so_path.write_bytes(so if so is not None else cuda_so(sass=(80, 90)))
    ext = replace(make_ext(("sm_80", "sm_90")), path=str(so_path))
    packages = {
        "fla.ops.gated_delta_rule": make_pkg("fla", fla),
        "flash_attn": make_pkg("flash_attn", None, import_error="ModuleNotFoundError: No module named 'flash_attn'"),
    }
    installed = {"fla-core": fla, "flash-linear-attention": fla, "tilelang": "0.1.6", "z3-solver": "4.15.0"}
    if conv is not None:
        packages["causal_conv1d"] = make_pkg("causal_conv1d", conv, extensions=(ext,))
        installed["causal-conv1d"] = conv
    else:
        packages["causal_conv1d"] = make_pkg("causal_conv1d", None,
                                             import_error="ModuleNotFoundError: No module named 'causal_conv1d'")
    return Facts(
        env=make_env(gpus=gpus, packages=installed, kernels=kernels),
        packages=packages,
        hub={hub.repo_id: hub} if hub else {},
        kernels_window=WINDOW,
        transformers_min_versions={},
        torch_varlen_attention=True,
        fla_backends={"9.0": _backend(backward)},
    )


def _result(facts: Facts, options: CheckOptions) -> CheckResult:
    spec = discovery.resolve_model("qwen3_5", discovery.transformers_source())
    requirements = catalog.requirements(spec, options.mode, packed=True, transformers_version="5.23.0")
    target = Target(archs=options.archs, arch_source="--arch", allow=AllowPolicy.parse(options.allow),
                    use_hub=options.hub)
    return CheckResult(options, facts.env, resolve(facts, requirements, target), spec.origin, facts=facts)


def _lock(tmp_path: Path, image: Facts, *, allow: tuple[str, ...] = (), hub: bool = False) -> Path:
    result = _result(image, CheckOptions(archs=("9.0",), allow=allow, hub=hub))
    assert result.ok, result.resolution
    return stack_lock.write_lock(result, tmp_path / "kernelguard.lock")


def _refusal(monkeypatch: pytest.MonkeyPatch, lock: Path, node: Facts, **verify: Any) -> LockMismatch:
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(node, options))
    with pytest.raises(LockMismatch) as info:
        stack_lock.verify_lock(lock, **verify)
    assert info.value.message == HEAD.format(lock=lock, n=len(info.value.differences))
    return info.value


def test_the_lock_holds_what_decides_the_kernels_and_nothing_else(tmp_path: Path) -> None:
    lock = json.loads(_lock(tmp_path, _facts(tmp_path)).read_text())
    assert lock["kernelguard_lock"] == 1 and lock["verdict"] == "ok" and lock["target_archs"] == ["9.0"]
    assert lock["model"] == {"name": "qwen3_5", "family": "qwen3_5", "mode": "training", "packed": True, "hub": False}
    assert set(lock["stack"]) == {"python", "torch", "cuda", "cxx11_abi", "triton", "transformers", "kernelguard"}
    assert lock["stack"]["python"] == "3.11" and lock["stack"]["torch"] == "2.13.0+cu128"
    conv = lock["kernels"]["causal_conv1d_fn"]
    assert conv["distributions"] == {"causal-conv1d": "1.7.0"}  # not tilelang, z3-solver or kernels: no kernel needs them
    [ext] = conv["extensions"]
    assert ext["file"] == "causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so" and len(ext["sha256"]) == 64
    assert (ext["sass"], ext["ptx"]) == (["sm_80", "sm_90"], [])
    assert lock["kernels"]["chunk_gated_delta_rule"]["distributions"] == {"fla-core": "0.6.0",
                                                                          "flash-linear-attention": "0.6.0"}
    assert lock["fla_backend"] == {"9.0": {"forward": "triton", "backward": "tilelang"}}


def test_the_same_stack_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path), options))
    assert stack_lock.verify_lock(lock).ok


def test_a_python_patch_release_is_not_locked_a_minor_one_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/lock.md: the lock holds major.minor. A lock that carries a patch release (written by hand or another
    tool) is read the same way: 3.11.9 accepts this node's 3.11, 3.10.4 does not."""
    lock = _lock(tmp_path, _facts(tmp_path))
    data = json.loads(lock.read_text())
    for written, accepted in (("3.11.9", True), ("3.11.0", True), ("3.10.4", False)):
        data["stack"]["python"] = written
        lock.write_text(json.dumps(data))
        monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path), options))
        if accepted:
            assert stack_lock.verify_lock(lock).ok, written
        else:
            error = _refusal(monkeypatch, lock, _facts(tmp_path))
            assert error.differences == ("python: lock says 3.10, here 3.11; restore: run the job with Python 3.10, "
                                         "the image's",)


def test_a_version_drift_names_the_lock_the_node_and_the_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, conv="1.6.0"))
    assert error.differences == (f"causal_conv1d_fn: causal-conv1d: lock says 1.7.0, here 1.6.0; restore: {CONV}",)


def test_a_swapped_build_of_the_same_version_is_caught_by_its_hash(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    image_hash = json.loads(lock.read_text())["kernels"]["causal_conv1d_fn"]["extensions"][0]["sha256"]
    other = cuda_so(sass=(80,))
    node = _facts(tmp_path, so=other)
    node = replace(node, packages={**node.packages, "causal_conv1d": make_pkg(
        "causal_conv1d", "1.7.0", extensions=(replace(make_ext(("sm_80",)), path=str(
            tmp_path / "causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so")),))})
    import hashlib

    error = _refusal(monkeypatch, lock, node, allow=None)
    # the node's build lacks sm_90: the check itself would reject it too, but the lock says why first
    assert error.differences == ((
        f"causal_conv1d_fn: causal_conv1d_cuda.cpython-312-x86_64-linux-gnu.so sha256: lock says sha256 "
        f"{image_hash[:12]}, here sha256 {hashlib.sha256(other).hexdigest()[:12]} (sm_80, sm_90 -> sm_80); "
        f"restore: {CONV} (the lock's build; a different build of the same version has other GPU code)"
    ),)


def test_a_gpu_of_another_arch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, gpus=("8.0",)))
    assert error.differences == ((
        "GPU 0 (GPU sm 8.0) arch: lock says 9.0, here 8.0; restore: run on a GPU the lock targets, or write a lock "
        "for this one where the image is built: kernelguard lock --model qwen3_5 --arch 8.0"
    ),)


def test_a_missing_package_is_refused_with_its_exact_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, conv=None))
    assert error.differences == (f"causal_conv1d_fn: causal-conv1d: lock says 1.7.0, here not installed; restore: {CONV}",)


def test_allow_items_must_be_the_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path), allow=("attention",))
    error = _refusal(monkeypatch, lock, _facts(tmp_path), allow=["attention", "fla-640-wrong-grads"])
    assert error.differences == ((
        "allow items: lock says [attention], here [attention, fla-640-wrong-grads]; restore: pass exactly the "
        "lock's: --allow attention"
    ),)
    python = _refusal(monkeypatch, lock, _facts(tmp_path), allow=[], syntax="python")
    assert python.differences == (
        "allow items: lock says [attention], here none; restore: pass exactly the lock's: allow=['attention']",)


def test_fla_choosing_another_backend_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))  # the image had tilelang + nvcc: fla's TileLang backward
    error = _refusal(monkeypatch, lock, _facts(tmp_path, backward="triton"))
    assert error.differences == ((
        "fla GDN backward backend on sm 9.0: lock says tilelang, here triton; restore: pip install tilelang "
        "z3-solver (and put nvcc on PATH: fla's TileLang backend compiles with it); unset FLA_TILELANG=0"
    ),)


def test_a_moved_hub_revision_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = discovery.resolve_model("qwen3_5", discovery.transformers_source())
    repo = next(k.hub.repo_id for k in spec.family.kernels if k.hub is not None and k.kernel == "chunk_gated_delta_rule")

    def probe(revision: str) -> HubKernelProbe:
        return HubKernelProbe(repo, "offline cache", "/cache", revision, "torch213-cxx11-cu128-x86_64-linux", (),
                              True, None)

    lock = _lock(tmp_path, _facts(tmp_path, hub=probe("aaaa1111")), hub=True)
    assert json.loads(lock.read_text())["kernels"]["chunk_gated_delta_rule"]["revision"] == "aaaa1111"
    error = _refusal(monkeypatch, lock, _facts(tmp_path, hub=probe("bbbb2222")))
    assert error.differences == ((
        f"chunk_gated_delta_rule: Hub revision: lock says aaaa1111, here bbbb2222; restore: python -c \"from kernels "
        f"import get_kernel; get_kernel('{repo}', revision='aaaa1111')\" with HF_HUB_OFFLINE unset, then run "
        "offline again"
    ),)


def test_every_difference_is_one_line_and_the_error_pickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    lock = _lock(tmp_path, _facts(tmp_path))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, conv="1.6.0", fla="0.5.2", backward="triton"))
    assert [d.split(":")[0] for d in error.differences] == ["causal_conv1d_fn", "chunk_gated_delta_rule",
                                                            "chunk_gated_delta_rule", "fla GDN backward backend on sm 9.0"]
    assert str(error).splitlines()[1:5] == [f"  - {d}" for d in error.differences]
    again = pickle.loads(pickle.dumps(error))
    assert again.differences == error.differences and str(again) == str(error)


def test_a_file_that_is_not_a_lock_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "kernelguard.lock"
    path.write_text(json.dumps({"kernelguard_lock": 99}))
    here = stack_lock.kernelguard_version()
    with pytest.raises(ConfigError, match=rf"has lock schema 99; this kernelguard \({here}\) reads schema 1\.") as info:
        stack_lock.read_lock(path)
    assert info.value.fix == "pip install --upgrade kernelguard"  # newer, writer unknown: never rewrite the lock
    with pytest.raises(ConfigError, match=r"--lock .*missing\.lock: no such file\."):
        stack_lock.read_lock(tmp_path / "missing.lock")


@pytest.mark.parametrize(("schema", "fix"), [
    (2, "pip install --force-reinstall --no-deps 'kernelguard==0.9.1'"),  # newer: the image's lock stays, the job gets the writer's release
    (0, "write it again where the image is built: kernelguard lock --output kernelguard.lock"),  # older: rewrite
])
def test_a_lock_of_another_schema_names_its_writer_and_the_right_fix(tmp_path: Path, schema: int, fix: str) -> None:
    path = tmp_path / "kernelguard.lock"
    path.write_text(json.dumps({"kernelguard_lock": schema, "stack": {"kernelguard": "0.9.1"}}))
    with pytest.raises(ConfigError, match=rf"has lock schema {schema}, written by kernelguard 0\.9\.1;") as info:
        stack_lock.read_lock(path)
    assert info.value.fix == fix


def test_kernelguard_lock_env_names_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELGUARD_LOCK", "/image/kernelguard.lock")
    assert stack_lock.lock_path(None) == "/image/kernelguard.lock"
    assert stack_lock.lock_path("own.lock") == "own.lock"
    monkeypatch.setenv("KERNELGUARD_LOCK", " ")
    assert stack_lock.lock_path(None) is None


def test_a_bad_kernelguard_lock_names_the_variable_not_an_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kernelguard
    from kernelguard.runtime.gate import check_lock

    monkeypatch.setenv("KERNELGUARD_LOCK", str(tmp_path / "missing.lock"))
    for call in (kernelguard.require, lambda: check_lock(None)):
        with pytest.raises(ConfigError) as info:
            call()
        assert info.value.message == f"KERNELGUARD_LOCK={tmp_path / 'missing.lock'}: no such file."
        assert info.value.fix == "point KERNELGUARD_LOCK at the image's lock file, or unset it"
    monkeypatch.setenv("KERNELGUARD_LOCK", str(tmp_path))
    with pytest.raises(ConfigError) as info:  # a folder without a lock in it: no path that does not exist
        check_lock(None)
    assert info.value.message == f"KERNELGUARD_LOCK={tmp_path} is a directory, not a lock file."
    assert info.value.fix == "point KERNELGUARD_LOCK at the image's lock file, or unset it"
    with pytest.raises(ConfigError) as info:
        check_lock(str(tmp_path))
    assert info.value.fix == ("pass the lock file itself; write it again where the image is built: kernelguard lock "
                              "--output kernelguard.lock")
    (tmp_path / "kernelguard.lock").write_text("{}")  # the folder holds the lock: the fix names it
    with pytest.raises(ConfigError) as info:
        check_lock(None)
    assert info.value.fix == f"export KERNELGUARD_LOCK={tmp_path / 'kernelguard.lock'}"
    with pytest.raises(ConfigError) as info:  # an argument given is named as the argument
        check_lock(str(tmp_path))
    assert (info.value.message, info.value.fix) == (
        f"--lock {tmp_path} is a directory, not a lock file.", f"--lock {tmp_path / 'kernelguard.lock'}")
    with pytest.raises(ConfigError, match=r"^lock= .* is a directory, not a lock file\.") as info:
        kernelguard.require(lock=str(tmp_path))
    assert info.value.fix == f"lock={str(tmp_path / 'kernelguard.lock')!r}"


def test_lock_output_that_is_a_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelguard.cli import main

    assert main(["lock", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"kernelguard: error: --output {tmp_path} is a directory; the lock is written to a file." in err
    assert f"Fix: --output {tmp_path / 'kernelguard.lock'}" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_require_enforces_a_lock_in_python_terms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernelguard

    lock = _lock(tmp_path, _facts(tmp_path))
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path), options))
    assert kernelguard.require(lock=lock).ok
    monkeypatch.setenv("KERNELGUARD_LOCK", str(lock))
    monkeypatch.setenv("KERNELGUARD_ALLOW", "attention")
    with pytest.raises(LockMismatch) as info:
        kernelguard.require()
    assert info.value.differences == (
        "allow items: lock says none, here [attention]; restore: pass no allow items",)


# ------------------------------------------------------------------------------ both ways, and the caller's words ---
def test_a_lock_without_a_kernels_entry_does_not_accept_another_build_of_it(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: the image had causal-conv1d 1.6.0, the lock lost its entry, the node has 1.5.0."""
    lock = _lock(tmp_path, _facts(tmp_path, conv="1.6.0"))
    data = json.loads(lock.read_text())
    del data["kernels"]["causal_conv1d_fn"]
    lock.write_text(json.dumps(data))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, conv="1.5.0"))
    assert error.differences == (
        "causal_conv1d_fn: lock says no entry for it, here causal_conv1d (causal_conv1d.causal_conv1d_fn) "
        "(causal-conv1d 1.5.0); restore: write the lock again where the image is built (kernelguard lock --output "
        "FILE): a lock without this kernel's entry cannot say which build of it the image verified",)


def test_require_refuses_an_argument_that_contradicts_the_lock_as_the_cli_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernelguard

    lock = _lock(tmp_path, _facts(tmp_path))
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path), options))
    with pytest.raises(ConfigError) as info:
        kernelguard.require(lock=lock, mode="inference")
    assert info.value.message == ("lock= checks the model, mode, target and Hub use the lock was written for: "
                                  "mode='inference' contradicts it (the lock's mode is training).")
    assert info.value.fix == ("drop mode='inference', or write a new lock with them: kernelguard lock --mode "
                              "inference --output FILE")
    with pytest.raises(ConfigError) as info:
        kernelguard.require(lock=lock, model="qwen3_next", arch=["8.0"], packed=False, hub=True)
    assert info.value.message == (
        "lock= checks the model, mode, target and Hub use the lock was written for: model='qwen3_next' contradicts "
        "it (the lock's model is qwen3_5); arch=['8.0'] contradicts it (the lock's arch is 9.0); packed=False "
        "contradicts it (the lock's packed is True); hub=True contradicts it (the lock's hub is False).")
    # Repeating exactly what the lock holds is no contradiction.
    assert kernelguard.require(lock=lock, model="qwen3_5", mode="training", arch=9.0, packed=True, hub=False).ok


def test_check_lock_refuses_only_the_flags_that_contradict_the_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.cli import check as cli_check

    lock = _lock(tmp_path, _facts(tmp_path))
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path), options))
    same = ["--lock", str(lock), "--model", "qwen3_5", "--mode", "training", "--arch", "9.0", "--packed"]
    assert cli_check.main(same) == 0
    capsys.readouterr()
    assert cli_check.main(["--lock", str(lock), "--mode", "inference", "--arch", "9.0"]) == 2
    err = capsys.readouterr().err
    assert ("--lock checks the model, mode, target and Hub use the lock was written for: --mode inference "
            "contradicts it (the lock's mode is training).") in " ".join(err.split())
    assert "--arch 9.0 contradicts" not in err


# ------------------------------------------------------------------------------------- the rebuild command ---
def test_the_rebuild_command_carries_the_locks_model_mode_packing_archs_and_allow_items(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: `kernelguard lock --output drift.lock` alone checked the defaults (packed, no allow items) and
    exited 1; the command to paste is the lock's own."""
    lock = _lock(tmp_path, _facts(tmp_path), allow=("attention",))
    data = json.loads(lock.read_text())
    data["model"]["packed"] = False
    lock.write_text(json.dumps(data))
    error = _refusal(monkeypatch, lock, _facts(tmp_path, conv="1.6.0"), allow=["attention"])
    assert error.fix == ("run each restore above; or rebuild the image and its lock: kernelguard lock --model qwen3_5 "
                         f"--mode training --no-packed --arch 9.0 --allow attention --output {lock}")


def test_a_lock_without_target_archs_is_not_said_to_be_on_sm_question_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = _lock(tmp_path, _facts(tmp_path))
    data = json.loads(lock.read_text())
    data["target_archs"] = []
    lock.write_text(json.dumps(data))
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_facts(tmp_path, conv="1.6.0"), options))
    with pytest.raises(LockMismatch) as info:
        stack_lock.verify_lock(lock)
    assert info.value.message.startswith(
        f"this node's stack differs from {lock} (written for qwen3_5 training with no target arch (written without "
        "--arch or a GPU)): ")
    assert info.value.fix.endswith(f": kernelguard lock --model qwen3_5 --mode training --packed --output {lock}")


def _hub_probe(revision: str) -> HubKernelProbe:
    spec = discovery.resolve_model("qwen3_5", discovery.transformers_source())
    repo = next(k.hub.repo_id for k in spec.family.kernels if k.hub is not None and k.kernel == "chunk_gated_delta_rule")
    return HubKernelProbe(repo, "offline cache", "/cache", revision, "torch213-cxx11-cu128-x86_64-linux", (), True, None)


def _all_latest(facts: Facts, value: str | None) -> Facts:
    """The same stack read with UNSTABLE_KERNELS_ALL_LATEST set as kernels 0.19 reads it (hub_load's own reading)."""
    from kernelguard.resolution.hub_load import probe_hub_load

    environ = {} if value is None else {"UNSTABLE_KERNELS_ALL_LATEST": value}
    return replace(facts, hub_load=probe_hub_load(Path("/nowhere"), "5.25.0", WINDOW, "0.19.1", environ=environ))


def test_a_lock_is_never_written_while_every_hub_pin_is_overridden(tmp_path: Path) -> None:
    """kernels 0.19's UNSTABLE_KERNELS_ALL_LATEST loads the newest version of every Hub kernel over any pin: a lock
    written then pins revisions the job does not load. Refused before any file is written; off ("0") it is not."""
    image = _facts(tmp_path, hub=_hub_probe("aaaa1111"))
    with pytest.raises(ConfigError) as info:
        _lock(tmp_path, _all_latest(image, "yes"), hub=True)
    assert info.value.message == (
        "UNSTABLE_KERNELS_ALL_LATEST=yes is set: kernels loads the newest version of every Hub kernel whatever a "
        "lock pins, so this lock would pin Hub revisions the job does not load.")
    assert info.value.fix == "unset UNSTABLE_KERNELS_ALL_LATEST and write the lock again (or lock the pip packages: --no-hub)"
    assert not (tmp_path / "kernelguard.lock").exists()
    assert "UNSTABLE_KERNELS_ALL_LATEST" not in json.loads(_lock(tmp_path, _all_latest(image, "0"), hub=True).read_text())["stack"]


def test_a_node_that_overrides_the_hub_pins_differs_from_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    image = _facts(tmp_path, hub=_hub_probe("aaaa1111"))
    lock = _lock(tmp_path, image, hub=True)
    error = _refusal(monkeypatch, lock, _all_latest(image, "1"))
    assert error.differences == (
        "UNSTABLE_KERNELS_ALL_LATEST: lock says unset, here 1; restore: unset UNSTABLE_KERNELS_ALL_LATEST (kernels "
        "then loads the Hub revisions the lock pins)",)


def test_a_package_the_node_adds_to_the_locked_stack_differs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-qla is locked whenever installed (fla hands it the whole GDN op): a node that adds it runs another
    kernel than the image verified. The comparison read only the lock's own names and let it through."""
    image = _facts(tmp_path)
    lock = _lock(tmp_path, image)
    node = replace(image, env=replace(image.env, packages={**image.env.packages, "flash-qla": Fact("0.1.3", "made up")}))
    error = _refusal(monkeypatch, lock, node)
    assert error.differences == ("flash-qla: lock says not installed, here 0.1.3; restore: pip uninstall -y flash-qla",)


def test_check_says_when_every_hub_pin_is_overridden_and_only_then(tmp_path: Path) -> None:
    image = _facts(tmp_path, hub=_hub_probe("aaaa1111"))
    note = ("UNSTABLE_KERNELS_ALL_LATEST=on: kernels loads the newest cached numbered version of every Hub kernel, "
            "whatever version transformers asks for or a lock pins (judged here on those versions); unset "
            "UNSTABLE_KERNELS_ALL_LATEST to load the versions transformers asks for")
    assert note in _result(_all_latest(image, "on"), CheckOptions(archs=("9.0",), hub=True)).resolution.notes
    for value, hub in (("on", False), ("off", True), (None, True)):  # pip kernels, or kernels reads it as off
        notes = _result(_all_latest(image, value), CheckOptions(archs=("9.0",), hub=hub)).resolution.notes
        assert not any("UNSTABLE_KERNELS_ALL_LATEST" in n for n in notes)


def _fetching(facts: Facts, **commits: str | None) -> Facts:
    """``facts`` whose Hub load fetches each repository named (as kernels-community/<name>) at v1, the local cache
    holding the commit given (None: not cached); a name ending in _v4 is fetched at v4."""
    from kernelguard.resolution.facts import FetchedHubRepo
    from kernelguard.resolution.hub_load import probe_hub_load

    fetched = tuple(FetchedHubRepo(f"kernels-community/{name.removesuffix('_v4')}", "v4" if name.endswith("_v4")
                                   else "v1", commit) for name, commit in commits.items())
    load = probe_hub_load(Path("/nowhere"), "5.25.0", WINDOW, "0.18.2", environ={})
    return replace(facts, hub_load=replace(load, fetched=fetched))


def test_the_lock_records_every_hub_repository_the_load_fetches_and_a_moved_commit_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels loads a version through its vN branch, which moves: a node whose cache holds another commit of the
    same v1 runs another build with every version the lock pins unchanged. Repositories no kernel verdict names
    (the activation kernels an eval-mode load fetches) are recorded too."""
    monkeypatch.setenv("KERNELS_CACHE", "/image/cache")
    image = _fetching(_facts(tmp_path, hub=_hub_probe("aaaa1111")), fla="a" * 40, activation="b" * 40)
    lock = _lock(tmp_path, image, hub=True)
    assert json.loads(lock.read_text())["hub_repos"] == [
        {"repo": "kernels-community/fla", "ref": "v1", "commit": "a" * 40},
        {"repo": "kernels-community/activation", "ref": "v1", "commit": "b" * 40}]
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(image, options))
    assert stack_lock.verify_lock(lock).ok  # the control: the same cache is accepted
    error = _refusal(monkeypatch, lock, _fetching(image, fla="a" * 40, activation="d" * 40))
    assert error.differences == (
        "Hub repository kernels-community/activation (v1) commit: lock says bbbbbbbbbbbb, here dddddddddddd; "
        "restore: copy the image's kernel cache (/image/cache) to this node: a download of v1 takes the build that "
        "branch holds now, not necessarily commit bbbbbbbbbbbb",)
    uncached = _refusal(monkeypatch, lock, _fetching(image, fla="a" * 40, activation=None))
    assert uncached.differences[0].startswith(
        "Hub repository kernels-community/activation (v1) commit: lock says bbbbbbbbbbbb, here not in the kernel cache;")


def test_a_node_whose_load_fetches_other_repositories_differs_with_the_transformers_pin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = _fetching(_facts(tmp_path, hub=_hub_probe("aaaa1111")), fla="a" * 40, activation=None)
    lock = _lock(tmp_path, image, hub=True)
    error = _refusal(monkeypatch, lock, _fetching(image, fla_v4="e" * 40))
    why = "(transformers' kernel mapping and the model's layers decide what the load fetches): pip install " \
        f"'transformers=={json.loads(lock.read_text())['stack']['transformers']}'"
    assert error.differences == (
        f"Hub repository kernels-community/activation: lock says fetched at v1, here not fetched; restore: {why}",
        f"Hub repository kernels-community/fla: lock says fetched at v1, here fetched at v4; restore: {why}")


def test_a_lock_without_the_hub_records_no_repositories_and_a_node_listing_them_is_not_refused_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = _facts(tmp_path)
    lock = _lock(tmp_path, plain)
    assert "hub_repos" not in json.loads(lock.read_text())
    monkeypatch.setattr(stack_lock, "run_check", lambda options: _result(_fetching(plain, fla="a" * 40), options))
    assert stack_lock.verify_lock(lock).ok
