"""Checkpoint manifests: a damaged newest checkpoint is named and skipped, none valid is a clear refusal,
retention keeps the N newest and never the one just saved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import CheckpointError, ConfigError
from kernelguard.train.output import checkpoint as ckpt

SHARD = "__0_0.distcp"


def _make(output: Path, step: int, *, payload: bytes = b"") -> Path:
    """A sealed checkpoint folder with a shard, DCP metadata and a trainer state (no torch needed)."""
    folder = ckpt.checkpoint_root(output) / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / SHARD).write_bytes(payload or bytes(range(256)) * 64 + bytes([step]))
    (folder / ".metadata").write_bytes(b"meta" * 10)
    (folder / ckpt.TRAINER_STATE).write_text(json.dumps({"step": step, "scheduler": {}}))
    ckpt.write_manifest(folder, step)
    return folder


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_manifest_records_every_file_and_the_marker_seals_it(tmp_path: Path) -> None:
    folder = _make(tmp_path, 2)
    manifest = json.loads((folder / ckpt.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", SHARD, ckpt.TRAINER_STATE]
    assert manifest["files"][SHARD]["size"] == (folder / SHARD).stat().st_size
    assert len(manifest["files"][SHARD]["sha256"]) == 64
    assert (folder / ckpt.MARKER).read_text().startswith("step 2\nmanifest sha256 ")
    assert ckpt.verify_checkpoint(folder) is None


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda f: _truncate(f / SHARD), f"{SHARD} has 16285 bytes; the manifest says 16385 (truncated"),
        (lambda f: _flip_byte(f / SHARD), f"{SHARD} does not match its sha256 in the manifest (corrupted)"),
        (lambda f: (f / ckpt.MANIFEST).unlink(), f"{ckpt.MANIFEST} is missing"),
        (lambda f: (f / SHARD).unlink(), f"{SHARD} is missing"),
        (lambda f: _flip_byte(f / ckpt.MANIFEST), f"{ckpt.MANIFEST} does not match the checksum sealed in"),
        (lambda f: _flip_byte(f / ckpt.TRAINER_STATE), f"{ckpt.TRAINER_STATE} does not match its sha256"),
    ],
    ids=["truncated-shard", "flipped-byte", "no-manifest", "no-shard", "edited-manifest", "edited-state"],
)
def test_damaged_newest_checkpoint_falls_back_naming_the_file(tmp_path: Path, damage, expected: str) -> None:
    older = _make(tmp_path, 2)
    newest = _make(tmp_path, 4)
    damage(newest)
    problem = ckpt.verify_checkpoint(newest)
    assert problem is not None and expected in problem and str(newest) in problem, problem
    path, problems = ckpt.find_resumable(tmp_path)
    assert path == older
    assert problems == [f"checkpoint step_4 is unusable: {problem}"]


def test_no_valid_checkpoint_is_a_refusal_with_the_fix(tmp_path: Path) -> None:
    for step in (2, 4):
        _flip_byte(_make(tmp_path, step) / SHARD)
    with pytest.raises(CheckpointError) as info:
        ckpt.find_resumable(tmp_path)
    err = info.value
    assert isinstance(err, ConfigError)  # exit 2 through the CLI
    assert "--resume found no valid checkpoint" in err.message
    assert "checkpoint step_4 is unusable" in err.message and "checkpoint step_2 is unusable" in err.message
    assert err.fix is not None and "--overwrite" in err.fix


def test_nothing_to_resume_is_not_an_error(tmp_path: Path) -> None:
    assert ckpt.find_resumable(tmp_path) == (None, [])


def test_a_checkpoint_from_before_manifests_is_accepted_unverified(tmp_path: Path) -> None:
    folder = ckpt.checkpoint_root(tmp_path) / "step_3"
    folder.mkdir(parents=True)
    (folder / ckpt.MARKER).write_text("step 3\n")
    assert ckpt.verify_checkpoint(folder) is None
    assert ckpt.find_resumable(tmp_path) == (folder, [])


def test_unreadable_trainer_state_is_a_checkpoint_error(tmp_path: Path) -> None:
    folder = _make(tmp_path, 2)
    (folder / ckpt.TRAINER_STATE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"trainer\.json cannot be read"):
        ckpt.read_trainer_state(folder)
    (folder / ckpt.TRAINER_STATE).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a kernelguard trainer state"):
        ckpt.read_trainer_state(folder)


def test_retention_keeps_the_newest_n_and_never_the_one_just_saved(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _make(tmp_path, step)
    removed = ckpt.prune_checkpoints(tmp_path, keep=2, newest=4)
    assert [p.name for p in removed] == ["step_1", "step_2"]
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 4]
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep=1, newest=4)] == ["step_3"]
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [4]


def test_retention_leaves_later_checkpoints_of_a_resumed_run_alone(tmp_path: Path) -> None:
    # Resumed from step_2 because step_6 is damaged; saving step_3 with keep=1 keeps step_3 (newest saved)
    # and leaves step_6 for the run to overwrite when it gets there.
    for step in (2, 3, 6):
        _make(tmp_path, step)
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep=1, newest=3)] == ["step_2"]
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [3, 6]


def _model_and_optimizer(seed: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_real_save_is_sealed_loads_back_and_old_unverified_damage_is_a_checkpoint_error(
    tmp_path: Path, gloo_one_rank: None
) -> None:
    import torch

    model, opt = _model_and_optimizer(0)
    state = {"step": 1, "scheduler": {}}
    folder = ckpt.save_checkpoint(
        tmp_path, step=1, model=model, optimizer=opt, trainer_state=state, is_main=True
    )
    assert ckpt.verify_checkpoint(folder) is None
    assert {".metadata", "rng_rank0.pt", ckpt.TRAINER_STATE} <= set(
        json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    )

    other, other_opt = _model_and_optimizer(1)
    assert ckpt.load_checkpoint(folder, model=other, optimizer=other_opt) == state
    assert torch.equal(other.weight, model.weight)

    # A checkpoint written before manifests cannot be verified first: damage must still be one clear error.
    (folder / ckpt.MANIFEST).unlink()
    (folder / ckpt.MARKER).write_text("step 1\n")
    for shard in folder.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"checkpoint {folder} cannot be loaded: ") as info:
        ckpt.load_checkpoint(folder, model=other, optimizer=other_opt)
    assert f"delete {folder}" in (info.value.fix or "")


def test_retention_that_cannot_delete_warns_and_keeps_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    for step in (1, 2, 3):
        _make(tmp_path, step)
    real = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "step_1":
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert [p.name for p in ckpt.prune_checkpoints(tmp_path, keep=1, newest=3)] == ["step_2"]
    err = capsys.readouterr().err
    assert f"could not delete old checkpoint {ckpt.checkpoint_root(tmp_path) / 'step_1'}: [Errno 13]" in err


@pytest.mark.parametrize("has_generation_config", [True, False])
def test_export_keeps_the_source_folders_generation_config(
    tmp_path: Path, gloo_one_rank: Any, has_generation_config: bool
) -> None:
    import tiny_models
    import torch

    source = tmp_path / "source"
    source.mkdir()
    generation = {"eos_token_id": [3, 7], "temperature": 0.6, "do_sample": True}
    if has_generation_config:
        (source / "generation_config.json").write_text(json.dumps(generation))
    from kernelguard.train.common.ranks import DistInfo
    from kernelguard.train.model.build import BuiltModel
    from kernelguard.train.output.export import export_run

    model = tiny_models.tiny_model("qwen3_5")
    built = BuiltModel(model, model.config, None, "sdpa")
    final = export_run(
        tmp_path / "out", model=model, built=built, tokenizer=None, dtype=torch.float32,
        info=DistInfo(0, 1, 0, torch.device("cpu")), source=source,
    )
    assert (final / "model.safetensors").is_file() and (final / "config.json").is_file()
    kept = final / "generation_config.json"
    # Its stop tokens and sampling defaults are what generate() uses with the exported model.
    assert (json.loads(kept.read_text()) if kept.exists() else None) == (generation if has_generation_config else None)
