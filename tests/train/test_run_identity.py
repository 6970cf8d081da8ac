"""Runs never mix and refuse early: run identity, --resume against a different run, --overwrite, and
preflight failures that leave the output folder exactly as it was (in process, no model build)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.errors import CheckpointError, ConfigError
from kernelguard.train.inputs.identity import RUN_FILE, differences, read_identity, write_identity
from kernelguard.train.output import checkpoint as ckpt
from kernelguard.train.settings.config import TrainConfig
from kernelguard.train.startup.preflight import StartPlan, claim_output, preflight


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity")
    return {
        "tok": h.write_tokenizer(root / "tok"),
        "model": h.write_model_config(root / "model"),
        "data": h.write_jsonl(root / "data.jsonl", h.copy_task_rows(20)),
    }


def _cfg(assets: dict[str, Path], output: Path, **overrides: Any) -> TrainConfig:
    values: dict[str, Any] = {
        "model": str(assets["model"]),
        "tokenizer": str(assets["tok"]),
        "data": str(assets["data"]),
        "output_dir": output,
        "max_length": 256,
        "learning_rate": 3e-3,
        "schedule_steps": 8,
    }
    return TrainConfig.from_flags(**{**values, **overrides})


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: equal snapshots = nothing created or changed."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _seal_run(output: Path, identity: dict[str, Any], step: int = 2) -> Path:
    """A finished-looking run: run.json, metrics and one sealed checkpoint recording ``identity``."""
    folder = ckpt.checkpoint_root(output) / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    state = {"step": step, "scheduler": {}, "identity": identity}
    (folder / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    ckpt.write_manifest(folder, step)
    write_identity(output, identity)
    (output / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return folder


def test_resuming_a_finished_run_is_refused_before_the_gate_and_the_data(assets: dict[str, Path], tmp_path: Path) -> None:
    """A run that reached its --max-steps and exported: --resume says so before the gate and the data (it once
    loaded them for 41 s first), and offers the export; one still to export resumes to export only."""
    from kernelguard.train.startup.preflight import check_something_left

    out = tmp_path / "out"
    folder = _seal_run(out, preflight(_cfg(assets, out, max_steps=2), world_size=2).identity, step=2)
    plan = preflight(_cfg(assets, out, resume=True, max_steps=2), world_size=2)
    check_something_left(_cfg(assets, out, resume=True, max_steps=2), plan.resume_from)  # the export is left
    (out / "final").mkdir()
    with pytest.raises(CheckpointError) as info:
        check_something_left(_cfg(assets, out, resume=True, max_steps=2), plan.resume_from)
    assert info.value.message == (f"--resume: {folder} is at step 2, and this run stops at step 2: there is nothing "
                                  "left to train.")
    assert info.value.fix == ("raise --max-steps above 2 to train further (with --schedule-steps to keep the LR "
                              f"schedule), or use {out / 'final'} (the exported model)")
    check_something_left(_cfg(assets, out, resume=True, max_steps=3), folder)  # a longer run: something left


def test_identity_fingerprints_inputs_and_settings(assets: dict[str, Path], tmp_path: Path) -> None:
    a = preflight(_cfg(assets, tmp_path / "a"), world_size=2).identity
    assert preflight(_cfg(assets, tmp_path / "b", max_steps=3, save_steps=1), world_size=2).identity == a
    assert a["world_size"] == 2 and a["max_length"] == 256 and a["seed"] == 0
    assert all(len(a[k]) == 64 for k in ("model_config_sha256", "tokenizer_sha256", "data_sha256"))
    other_data = h.write_jsonl(tmp_path / "d2.jsonl", h.copy_task_rows(20, seed=1))
    b = preflight(_cfg(assets, tmp_path / "a", data=str(other_data), seed=3), world_size=1).identity
    assert differences(a, b) == [
        f"data_sha256: was {a['data_sha256']!r}, now {b['data_sha256']!r}",
        "world_size: was 2, now 1",
        "seed: was 0, now 3",
    ]


def test_resume_refuses_a_different_run_naming_each_difference(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    folder = _seal_run(out, preflight(_cfg(assets, out), world_size=2).identity)
    before = _snapshot(out)
    changed = _cfg(assets, out, resume=True, learning_rate=1e-3, max_length=512, gradient_accumulation_steps=4)
    with pytest.raises(CheckpointError) as info:
        preflight(changed, world_size=1)
    message = info.value.message
    assert message.startswith(f"--resume: {folder} belongs to a different run; what differs:")
    for line in ("max_length: was 256, now 512", "world_size: was 2, now 1",
                 "gradient_accumulation_steps: was 2, now 4", "learning_rate: was 0.003, now 0.001"):  # fmt: skip
        assert f"\n  {line}" in message, message
    assert "--resume-anyway" in (info.value.fix or "")
    assert _snapshot(out) == before

    anyway = _cfg(assets, out, resume=True, resume_anyway=True, learning_rate=1e-3)
    plan = preflight(anyway, world_size=2)
    assert plan.resume_from == folder
    assert plan.warnings == (f"--resume-anyway: {folder} differs: learning_rate: was 0.003, now 0.001",)
    assert "random init" in plan.notices[0]  # the config file's notice: said at info level, not a warning


def test_resume_reads_an_old_run_json_by_the_new_setting_names(assets: dict[str, Path], tmp_path: Path) -> None:
    """A run.json written when the settings were called lr, block_size... resumes as the same run."""
    from kernelguard.train.settings.config import RENAMED

    out = tmp_path / "out"
    identity = preflight(_cfg(assets, out), world_size=2).identity
    old_names = {new: old for old, new in RENAMED.items()}
    old = {old_names.get(k, k): v for k, v in identity.items()}
    assert "lr" in old and "block_size" in old and "learning_rate" not in old
    folder = _seal_run(out, old)
    assert preflight(_cfg(assets, out, resume=True), world_size=2).resume_from == folder
    with pytest.raises(CheckpointError, match="was trained with --learning-rate 0.003; now --learning-rate 0.001"):
        preflight(_cfg(assets, out, resume=True, learning_rate=1e-3), world_size=2)


_V2_KEYS = ("packing", "param_dtype", "lr_scheduler_type", "warmup_ratio", "weight_decay", "adam_betas",
            "max_grad_norm", "harmless")  # fmt: skip


def test_resume_names_a_changed_param_dtype_or_packing_in_one_line(assets: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    identity = preflight(_cfg(assets, out), world_size=1).identity
    assert identity["version"] == 2 and identity["param_dtype"] == "bf16" and identity["packing"] == "packed"
    assert identity["harmless"] == {"loss": "chunked", "attention": "auto", "compile": None, "fused_norms": False}
    folder = _seal_run(out, identity)
    before = _snapshot(out)
    for overrides, message in (
        ({"packing": "leaky"}, "was trained with --packing packed; now --packing leaky."),
        ({"param_dtype": "fp16"}, "was trained with --param-dtype bf16; now --param-dtype fp16."),
        ({"assistant_only_loss": False},
         "was trained with --assistant-only-loss; now --no-assistant-only-loss."),
    ):  # fmt: skip
        with pytest.raises(CheckpointError) as info:
            preflight(_cfg(assets, out, resume=True, **overrides), world_size=1)
        assert info.value.message == f"--resume: {folder} {message}"
        assert info.value.fix.startswith("resume with " + message.split(" with ")[1].split(";")[0] + " (the")
    for anyway in (False, True):  # bf16 -> fp32 changes the optimizer's groups: not even --resume-anyway
        with pytest.raises(CheckpointError) as info:
            preflight(_cfg(assets, out, resume=True, resume_anyway=anyway, param_dtype="fp32"), world_size=1)
        assert info.value.message.startswith(
            f"--resume: {folder} was trained with --param-dtype bf16; now --param-dtype fp32: its optimizer state "
            "has other parameter groups"
        )
        assert info.value.fix.startswith("resume with --param-dtype bf16 (the checkpoint is intact: keep it)")
    assert _snapshot(out) == before
    plan = preflight(_cfg(assets, out, resume=True, resume_anyway=True, packing="none"), world_size=1)
    assert plan.warnings == (f"--resume-anyway: {folder} differs: packing: was 'packed', now 'none'",)


def test_resume_accepts_a_harmless_change_with_one_line(assets: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    folder = _seal_run(out, preflight(_cfg(assets, out), world_size=1).identity)
    plan = preflight(_cfg(assets, out, resume=True, loss="logits"), world_size=1)
    assert plan.resume_from == folder and plan.warnings == ()
    assert plan.notices[-1] == (
        f"--resume: {folder} was trained with --loss chunked, now --loss logits: accepted (the same math computed "
        "another way; the numbers differ by float rounding only)"
    )


def test_an_old_run_json_without_the_new_settings_resumes_as_their_old_defaults(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    identity = preflight(_cfg(assets, out), world_size=1).identity
    old = {k: v for k, v in identity.items() if k not in _V2_KEYS} | {"version": 1}
    folder = _seal_run(out, old)
    plan = preflight(_cfg(assets, out, resume=True), world_size=1)
    assert plan.resume_from == folder and plan.warnings == ()
    with pytest.raises(CheckpointError) as info:
        preflight(_cfg(assets, out, resume=True, packing="naive"), world_size=1)
    assert info.value.message == f"--resume: {folder} was trained with --packing packed; now --packing naive."


def test_resume_of_the_same_run_picks_the_verified_checkpoint(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    identity = preflight(_cfg(assets, out), world_size=2).identity
    good = _seal_run(out, identity, step=2)
    bad = ckpt.checkpoint_root(out) / "step_4"
    shutil.copytree(good, bad)
    (bad / "__0_0.distcp").write_bytes(b"y" * 100)  # same size, other content
    plan = preflight(_cfg(assets, out, resume=True, max_steps=9), world_size=2)
    assert plan.resume_from == good
    assert plan.warnings == (
        f"checkpoint step_4 is unusable: {bad / '__0_0.distcp'} does not match its sha256 in the manifest (corrupted)",
        ("falling back to step_2, the newest checkpoint that verifies; the unusable step_4 (all of its files, intact "
        "ones too) will be replaced when this run saves that step again: copy it away now to keep it"),
    )


def test_a_folder_holding_a_run_is_refused_without_overwrite(assets: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    _seal_run(out, preflight(_cfg(assets, out), world_size=1).identity)
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(CheckpointError) as info:
        preflight(_cfg(assets, out), world_size=1)
    assert info.value.message == (
        f"--output-dir {out} already holds a run (run.json, checkpoints, metrics.jsonl). The command below "
        "continues it; --overwrite instead deletes it and starts again; another --output-dir keeps it.")
    assert (info.value.fix or "").startswith("kernelguard train ") and (info.value.fix or "").endswith(" --resume")
    assert _snapshot(out) == before

    cfg = _cfg(assets, out, overwrite=True, seed=5)
    plan = preflight(cfg, world_size=1)
    assert _snapshot(out) == before  # preflight itself never writes
    assert claim_output(cfg, plan) == [RUN_FILE, "checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt",
        RUN_FILE,
        "train_config.json",
    ]  # user file kept
    assert read_identity(out / RUN_FILE) == plan.identity and plan.identity["seed"] == 5


def test_claim_writes_the_identity_into_a_new_folder(assets: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    cfg = _cfg(assets, out)
    plan = preflight(cfg, world_size=1)
    assert not (tmp_path / "new").exists()
    assert claim_output(cfg, plan) == []
    assert read_identity(out / RUN_FILE) == plan.identity
    saved = json.loads((out / "train_config.json").read_text())  # a --config file that repeats the run
    assert saved["data"] == str(assets["data"]) and "resume" not in saved
    assert sorted(p.name for p in out.iterdir()) == [RUN_FILE, "train_config.json"]


def _make_file(path: Path) -> Path:
    path.write_text("x")
    return path


PREFLIGHT_FAILURES: list[tuple[str, Callable[[dict[str, Path], Path], dict[str, Any]], str]] = [
    ("output-under-a-file", lambda a, t: {"output_dir": _make_file(t / "f") / "out"}, "is a file, not a folder"),
    ("no-tokenizer", lambda a, t: {"tokenizer": str(t / "none")}, "does not exist; expected a local tokenizer"),
    ("tokenizer-is-a-file", lambda a, t: {"tokenizer": str(a["model"])}, "is a config.json, which holds no tokenizer"),
    ("no-data", lambda a, t: {"data": str(t / "none.jsonl")}, "none.jsonl: no such file or folder"),
    ("no-eval-data", lambda a, t: {"eval_data": str(t / "e.jsonl")}, "e.jsonl: no such file or folder"),
    ("no-template", lambda a, t: {"chat_template": str(t / "x.jinja")}, "chat template file"),
    ("eval-every-alone", lambda a, t: {"eval_every": 5}, "--eval-every 5 needs an eval set"),
    ("no-model", lambda a, t: {"model": str(t / "m")}, "neither a model directory"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "expected"), [c[1:] for c in PREFLIGHT_FAILURES], ids=[c[0] for c in PREFLIGHT_FAILURES]
)
def test_preflight_failures_change_nothing(
    assets: dict[str, Path], tmp_path: Path, change: Any, expected: str
) -> None:
    out = tmp_path / "out"
    overrides = change(assets, tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError) as info:
        preflight(_cfg(assets, overrides.pop("output", out), **overrides), world_size=1)
    assert expected in info.value.message, info.value.message
    # a fix is a line that pastes: a missing path without a near name, or a folder under a file, has none (no
    # command could know what to put instead); every other has one
    assert bool(info.value.fix) is ("no such file or folder" not in expected and "is a file" not in expected)
    assert _snapshot(tmp_path) == before


def test_preflight_refuses_an_unwritable_or_full_output(
    assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(assets, tmp_path / "out")
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match=rf"{tmp_path} is not writable by this user \(uid \d+"):
        preflight(cfg, world_size=1)
    monkeypatch.undo()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1024))  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"0\.0 GiB free on its disk; one checkpoint needs about"):
        preflight(cfg, world_size=1)
    assert not (tmp_path / "out").exists()


def test_checkpoint_estimate_reads_safetensors_headers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from kernelguard.train.startup.preflight import checkpoint_bytes_estimate

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_bytes_estimate(None, tmp_path) == 12 * 17


def test_start_plan_defaults() -> None:
    assert StartPlan({"seed": 0}) == StartPlan({"seed": 0}, None, ())


def test_resume_refuses_a_checkpoint_trained_on_another_plan(tmp_path: Path) -> None:
    """Same inputs, but without --schedule-steps the LR schedule's length follows --max-steps: a longer
    schedule extends the run (HF users resume with a larger --max-steps); a shorter one cannot continue it."""
    from kernelguard.train.loop import check_resume_plan
    from kernelguard.train.step.plan import make_plan

    folder = _seal_run(tmp_path, {"seed": 0})
    state = json.loads((folder / ckpt.TRAINER_STATE).read_text())
    state.update(num_blocks=10, schedule_steps=30)  # a run extended to --max-steps 30 before
    (folder / ckpt.TRAINER_STATE).write_text(json.dumps(state))
    blocks = [[i] for i in range(10)]
    kw: dict[str, Any] = {
        "world_size": 1,
        "grad_accum": 1,
        "epochs": 1,
        "schedule_steps": None,
        "max_length": 8,
    }
    start = StartPlan({"seed": 0}, folder)
    cfg = TrainConfig.from_flags(model="m", data="d", output_dir=tmp_path, resume=True)
    assert check_resume_plan(cfg, start, make_plan(blocks, max_steps=30, **kw))["step"] == 2
    assert check_resume_plan(cfg, start, make_plan(blocks, max_steps=40, **kw))["step"] == 2  # extended
    with pytest.raises(CheckpointError) as info:
        check_resume_plan(cfg, start, make_plan(blocks, max_steps=20, **kw))
    assert info.value.message == (
        f"--resume: {folder} was trained on another plan; what differs:\n  schedule_steps: was 30, now 20"
    )
    with pytest.raises(CheckpointError, match="num_blocks: was 10, now 12"):
        check_resume_plan(cfg, start, make_plan([[i] for i in range(12)], max_steps=40, **kw))
    anyway = TrainConfig.from_flags(model="m", data="d", output_dir=tmp_path, resume=True, resume_anyway=True)
    assert check_resume_plan(anyway, start, make_plan(blocks, max_steps=20, **kw)) is not None
    assert check_resume_plan(cfg, StartPlan({}), make_plan(blocks, max_steps=20, **kw)) is None
