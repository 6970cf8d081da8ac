"""Known issue flash-qla-wrong-grads: fla hands its whole GDN op to any importable flash_qla, and flash-qla before
0.1.3 computes wrong A_log / dt_bias gradients (QwenLM/FlashQLA PR #28). Shown in `check`, `env` and the lock.

The installed flash-qla is read from its distribution metadata (a fake dist-info 0.1.2 / 0.1.3 here, made the way
pip leaves one); fla's choice of backend is the probed FlaBackend (made up: FlashQLA needs a Hopper GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from check_helpers import BASE, CHUNK, H200, TRAIN, find, make_env, qwen, write_distribution

from kernelguard.cli.env_report import from_result, render_env
from kernelguard.resolution.decisions import ACCEPTED, REJECTED, SELECTED
from kernelguard.resolution.facts import FlaBackend
from kernelguard.resolution.known_issues import by_id
from kernelguard.resolution.resolver import Target, resolve
from kernelguard.stack.compose import CheckOptions, CheckResult
from kernelguard.stack.stack_lock import build_lock, compare

ROW = "flash-qla-wrong-grads"
REPO = Path(__file__).resolve().parents[2]
QLA = FlaBackend("9.0", "flash_qla", "flash_qla", ("flash_qla: taken",), "made up")
QLA_OFF = FlaBackend("9.0", "triton", "triton", ("flash_qla: passed over (FLA_FLASH_QLA=0)",), "made up")
FIX = "pip install 'flash-qla>=0.1.3'; or export FLA_FLASH_QLA=0 (fla then runs its own Triton/TileLang op)"


def _facts(qla: str | None, backend: FlaBackend = QLA):  # type: ignore[no-untyped-def]
    packages = {"fla-core": "0.6.0", "flash-qla": qla} if qla else {"fla-core": "0.6.0"}
    return replace(BASE, env=make_env(gpus=("9.0",), packages=packages), fla_backends={"9.0": backend})


def test_flash_qla_before_0_1_3_serving_training_rejects_fla() -> None:
    res = resolve(_facts("0.1.2"), TRAIN, H200)
    fla = find(res, CHUNK, "package")
    issue = by_id(ROW)
    assert issue is not None
    assert (fla.status, fla.issues, fla.fix) == (REJECTED, (ROW,), FIX)
    assert fla.reason == f"known issue {ROW} ({issue.source}): {issue.effect}; rejected"
    assert not res.ok


@pytest.mark.parametrize(
    ("qla", "backend", "mode", "why"),
    [
        ("0.1.3", QLA, "training", "the fixed release"),
        ("0.1.2", QLA_OFF, "training", "FLA_FLASH_QLA=0: fla runs its own op"),
        ("0.1.2", QLA, "inference", "no backward runs"),
        (None, QLA_OFF, "training", "no flash-qla at all"),
    ],
)
def test_flash_qla_row_does_not_match(qla: str | None, backend: FlaBackend, mode: str, why: str) -> None:
    res = resolve(_facts(qla, backend), qwen(mode), H200)
    fla = find(res, CHUNK, "package")
    assert fla.status in (SELECTED, ACCEPTED) and ROW not in fla.issues, why


def test_allowing_the_row_is_shown() -> None:
    res = resolve(_facts("0.1.2"), TRAIN, replace(H200, allow=frozenset({ROW})))
    fla = find(res, CHUNK, "package")
    assert fla.status == SELECTED and fla.issues == (ROW,) and "allowed by --allow" in fla.reason


def _result(qla: str | None) -> CheckResult:
    facts = _facts(qla)
    res = resolve(facts, TRAIN, Target(archs=("9.0",), arch_source="made up", allow=frozenset({"attention"})))
    return CheckResult(CheckOptions(archs=("9.0",)), facts.env, res, "family name", facts=facts)


def test_env_block_names_flash_qla_and_the_matched_row() -> None:
    text = render_env(from_result(_result("0.1.2"), variables={}, kernelguard="0.2.0"))
    assert "- fla: fla-core 0.6.0, flash-linear-attention not installed, flash-qla 0.1.2; GDN backend sm 9.0: " in text
    assert f"- known issues matched: {ROW} (kernelguard issues explains each)" in text
    clean = render_env(from_result(_result("0.1.3"), variables={}, kernelguard="0.2.0"))
    assert "flash-qla 0.1.3" in clean and "known issues matched" not in clean


def test_lock_records_flash_qla_and_a_node_with_another_release_differs() -> None:
    locked, here = build_lock(_result("0.1.3")), build_lock(_result("0.1.2"))
    assert locked["stack"]["flash-qla"] == "0.1.3"
    line = next(d for d in compare(locked, here) if d.what == "flash-qla")
    assert (line.locked, line.here) == ("0.1.3", "0.1.2")
    assert "flash-qla==0.1.3" in line.fix


@pytest.mark.parametrize("version", ["0.1.2", "0.1.3"])
def test_the_probe_reads_the_installed_flash_qla(tmp_path: Path, version: str) -> None:
    site = tmp_path / "site"
    write_distribution(site, "flash-qla", version, {"flash_qla/__init__.py": f"__version__ = {version!r}\n"})
    code = ("import json; from kernelguard.resolution.env import probe; "
            "print(json.dumps(probe(read_gpus=False).version_of('flash-qla')))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(out.stdout) == version


# ---- the Hub path: a build that vendors fla's dispatcher hands the op to flash_qla too (issue 53, item 4) -------
def _variant(tmp_path: Path, code: str, *, zipped: bool = False) -> Path:
    """A Hub build variant whose package holds ``code`` (in a ZIP build: inside ``<id>.zip``, read in place)."""
    import zipfile

    folder = tmp_path / "torch213-cxx11-cu128-x86_64-linux"
    folder.mkdir(parents=True, exist_ok=True)
    if zipped:
        with zipfile.ZipFile(folder / "fla_abc.zip", "w") as z:
            z.writestr("fla/__init__.py", "")
            z.writestr("fla/backends.py", code)
    else:
        (folder / "fla").mkdir(exist_ok=True)
        (folder / "fla" / "__init__.py").write_text("")
        (folder / "fla" / "backends.py").write_text(code)
    return folder


DISPATCHER = "import importlib.util\n\ndef available():\n    return importlib.util.find_spec('flash_qla') is not None\n"


@pytest.mark.parametrize("zipped", [False, True])
def test_a_hub_build_that_imports_flash_qla_is_read_as_handing_it_the_op(tmp_path: Path, zipped: bool) -> None:
    from kernelguard.resolution.providers.hub_layers import hands_to

    assert hands_to(_variant(tmp_path / "a", DISPATCHER, zipped=zipped)) == ("flash_qla",)
    assert hands_to(_variant(tmp_path / "b", "try:\n    from flash_qla.ops import gdn\nexcept ImportError:\n    gdn = None\n",
                             zipped=zipped)) == ("flash_qla",)
    # the control: a build of its own Triton op only (a name in a comment or a longer name is not an import)
    assert hands_to(_variant(tmp_path / "c", "# flash_qla is not used here\nimport flash_qla_extras_x\n",
                             zipped=zipped)) == ()


def _hub_facts(qla: str | None, hands: tuple[str, ...]):  # type: ignore[no-untyped-def]
    from kernelguard.resolution.facts import HubKernelProbe, HubLayerCheck

    repo = next(k.hub.repo_id for k in TRAIN.kernels if k.hub is not None and k.kernel == CHUNK)
    probe = HubKernelProbe(repo, "offline cache", "/cache/build", "abc", "torch213-cxx11-cu128-x86_64-linux", (),
                           True, None)
    layer = HubLayerCheck(CHUNK, repo, CHUNK, probe.chosen_variant or "", "chunk_gated_delta_rule(...)", None,
                          judged_by="kernels 0.18.3", hands_to=hands)
    # fla itself runs its own Triton op here: only the Hub build's hand-off can bring flash-qla in
    return replace(_facts(qla, QLA_OFF), hub={repo: probe}, hub_layers={CHUNK: layer})


def test_flash_qla_before_0_1_3_rejects_a_hub_build_that_hands_it_the_op() -> None:
    target = replace(H200, use_hub=True)
    hub = find(resolve(_hub_facts("0.1.2", ("flash_qla",)), TRAIN, target), CHUNK, "hub")
    issue = by_id(ROW)
    assert issue is not None
    assert (hub.status, hub.issues, hub.fix) == (REJECTED, (ROW,), FIX)
    assert hub.reason == (
        "build variant torch213-cxx11-cu128-x86_64-linux from offline cache; kernels 0.18.3 accepts its "
        f"`{CHUNK}` layer; it hands the op to flash_qla when that imports: known issue {ROW} ({issue.source}): "
        f"{issue.effect}; rejected.")
    allowed = find(resolve(_hub_facts("0.1.2", ("flash_qla",)), TRAIN, replace(target, allow=frozenset({ROW}))),
                   CHUNK, "hub")
    assert allowed.status == SELECTED and allowed.issues == (ROW,) and "allowed by --allow" in allowed.reason
    # the controls: a build of its own op, the fixed release, no flash-qla installed, no backward run
    for facts, mode in ((_hub_facts("0.1.2", ()), "training"), (_hub_facts("0.1.3", ("flash_qla",)), "training"),
                        (_hub_facts(None, ("flash_qla",)), "training"), (_hub_facts("0.1.2", ("flash_qla",)), "inference")):
        control = find(resolve(facts, qwen(mode), target), CHUNK, "hub")
        assert control.status == SELECTED and control.issues == (), (facts.env.version_of("flash-qla"), mode)
