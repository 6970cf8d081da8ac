"""`kernelguard export` never races or forgets (kernelguard.train.output.export, kernelguard.train.output.provenance): a
checkpoint carries its config and tokenizer and exports with the original folders gone; an existing --output
is refused unless --overwrite; a live run's folder is refused naming its pid; two exports to one --output at
once (real processes): one wins, the other is refused, nothing half-written is left; a checkpoint without its
own copy is compared with the run's record; a disk that fills ends in one line and no `.tmp` folder."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.cli.export import main
from kernelguard.train.output import checkpoint as ckpt
from kernelguard.train.output.export import check_destination, many_shards_warning

FAULT_HOOKS = h.TESTS_DIR / "fault_hooks"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (checkpoints step_1, step_2); tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("export")
    assets = h.write_train_assets(root, rows=40)
    out = root / "run"
    r = h.run_train(["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data",
                     str(assets["data"]), "--output-dir", str(out), "--max-steps", "2", "--save-steps", "1",
                     "--max-length", "128", "--no-plot", "--no-progress", "--no-export", "--allow", "attention"],
                    nproc=0, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def _copy(trained: Path, tmp_path: Path) -> Path:
    """The run and its inputs, at the same relative places (train_config.json names absolute paths)."""
    dest = tmp_path / "copy"
    shutil.copytree(trained, dest)
    saved = json.loads((dest / "run" / "train_config.json").read_text())
    for key in ("model", "tokenizer", "data"):
        saved[key] = str(saved[key]).replace(str(trained), str(dest))
    (dest / "run" / "train_config.json").write_text(json.dumps(saved))
    return dest


def _export(*args: str, fault: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(h.REPO), str(FAULT_HOOKS)])
    env.pop("KERNELGUARD_FAULT", None)
    if fault:
        env["KERNELGUARD_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "kernelguard", "export", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_checkpoint_carries_its_sources_and_exports_with_the_folders_gone(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(trained, tmp_path)
    step = run / "run" / "checkpoints" / "step_2"
    source = json.loads((step / "source" / "source.json").read_text())
    assert source["multimodal"] is False and source["carried"] == []
    assert (step / "source" / "config.json").is_file() and (step / "source" / "tokenizer" / "tokenizer.json").is_file()
    assert "source/source.json" in json.loads((step / ckpt.MANIFEST).read_text())["files"]  # sealed with the rest
    shutil.rmtree(run / "tok")
    (run / "model" / "config.json").unlink()
    assert main([str(step), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert not (tmp_path / "out.tmp").exists() and not list(tmp_path.glob(".*.lock"))


def test_an_existing_output_is_refused_unless_overwrite(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = trained / "run" / "checkpoints" / "step_1"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main([str(step), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"kernelguard export: error: --output {tmp_path / 'out'} already exists." in err
    assert f"pass --output {tmp_path / 'out-2'} (a new folder), or --overwrite to replace it" in err
    assert (tmp_path / "out" / "keep.txt").is_file()
    # Refused before torch loads (it took 3-5 s): a fresh interpreter never imports it.
    probe = ("import sys; from kernelguard.cli.export import main; rc = main(sys.argv[1:]); "
             "print(rc, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(step), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, check=False)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert main([str(step), "--output", str(tmp_path / "out"), "--overwrite"]) == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "config.json").is_file()


def test_a_live_run_is_refused_naming_its_pid(trained: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(trained, tmp_path) / "run"
    code = ("import sys, time; from pathlib import Path; from kernelguard.train.common.run_folder_lock import acquire\n"
            "lock = acquire(Path(sys.argv[1]), argv=['kernelguard', 'train', '...']); print('held', flush=True)\n"
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], env=dict(os.environ, PYTHONPATH=str(h.REPO)),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main([str(run / "checkpoints" / "step_2"), "--output", str(tmp_path / "out")]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert f"kernelguard export: error: {run} is in use (pid {holder.pid} on " in err
    assert ": kernelguard train ...): a live run writes its own final/" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


@pytest.mark.slow
def test_two_exports_to_one_output_at_once_one_wins_the_other_is_refused(trained: Path, tmp_path: Path) -> None:
    first, second = _copy(trained, tmp_path / "a"), _copy(trained, tmp_path / "b")
    out = tmp_path / "out"
    procs = [_export(str(r / "run" / "checkpoints" / "step_2"), "--output", str(out), "--max-shard-size", "150KB",
                     fault="export-slow") for r in (first, second)]
    results = [(p.wait(timeout=240), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "Traceback" not in loser
    assert ("another export is writing into" in loser and "pid " in loser) or "already exists" in loser, loser
    assert (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert all((out / f).is_file() for f in set(index["weight_map"].values()))
    assert not (tmp_path / "out.tmp").exists() and not list(tmp_path.glob(".out.*lock"))


def test_a_disk_that_fills_ends_in_one_line_and_leaves_nothing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from kernelguard.train.output import export
    def full_disk(path, tensors, fetch):  # type: ignore[no-untyped-def]
        with open(path, "wb") as f:  # the part that fitted, then what write(2) gives on a full disk
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(export, "write_safetensors", full_disk)
    assert main([str(trained / "run" / "checkpoints" / "step_2"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if not line.startswith(("kernelguard export: loading",
                                                                        "kernelguard export: reading",
                                                                        "kernelguard export: writing"))]
    assert len(said) == 2 and "Traceback" not in err, err  # past the progress lines: the error line and its fix
    assert "kernelguard export: error: exporting" in err and "No space left on device (ENOSPC)" in err
    assert "then run the same `kernelguard export` again" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def _without_sources(step: Path) -> None:
    """Make ``step`` a checkpoint of before ``source/`` (sealed again, as such a checkpoint was)."""
    shutil.rmtree(step / "source")
    (step / ckpt.MARKER).unlink()
    ckpt.write_manifest(step, int(step.name.split("_")[1]))


def test_an_old_checkpoint_is_compared_with_the_record_and_never_names_a_missing_flag(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy(trained, tmp_path)
    step = copy / "run" / "checkpoints" / "step_2"
    _without_sources(step)
    config = json.loads((copy / "tok" / "tokenizer_config.json").read_text())
    (copy / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 1 }}"}))
    assert main([str(step), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer files in {copy / 'tok'} changed since the run trained" in err
    assert "pass --accept-changed-tokenizer" in err and not (tmp_path / "out").exists()
    assert main([str(step), "--output", str(tmp_path / "out"), "--accept-changed-tokenizer"]) == 0
    (copy / "model" / "config.json").unlink()
    assert main([str(step), "--output", str(tmp_path / "out2"), "--accept-changed-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert f"the run's model {copy / 'model' / 'config.json'} (named in" in err and "is gone" in err
    assert "--model" not in err


def test_many_small_shards_are_said_and_a_read_only_destination_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert many_shards_warning(16, 1024) is None  # a tiny model at 1KB: a few files, nothing to say
    assert many_shards_warning(5000, 100 * 10**6) is None  # large shards: the model is large, not the count wrong
    assert many_shards_warning(45, 1024) == (
        "--max-shard-size 1,024 bytes splits the export into 45 files (more than 16 files under 100 MB each: a "
        "size in bytes or KB where MB or GB was meant?); file systems and the Hub handle fewer, larger files "
        "better: the default is 5GB"
    )
    real = os.statvfs

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what access(2) says on a read-only mount
    monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly() if str(path) == str(tmp_path) else real(path))
    from kernelguard.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--output .*/out/final: .* is on a read-only file system\."):
        check_destination(tmp_path / "out" / "final", overwrite=False)


def test_an_output_over_the_run_or_its_checkpoints_is_refused_even_with_overwrite(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = trained / "run"
    for output in (run, run / "checkpoints" / "step_1", trained):
        assert main([str(run / "checkpoints" / "step_2"), "--output", str(output), "--overwrite"]) == 2
        assert "would put the export over the run's own folder or its checkpoints" in capsys.readouterr().err
    assert (run / "checkpoints" / "step_1" / ckpt.MARKER).is_file()
    assert main([str(run / "checkpoints"), "--output", str(trained / "x")]) == 2
    assert f"Fix: kernelguard export {run / 'checkpoints' / 'step_2'} --output {trained / 'x'}" in (
        capsys.readouterr().err)


def test_a_run_that_would_export_many_small_files_is_told_at_its_start() -> None:
    import types

    import tiny_models
    import torch

    from kernelguard.train.model.parallel import build_meta_model
    from kernelguard.train.output.export import export_shards_warning

    config = tiny_models.tiny_config("qwen3_5", num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2)
    built = types.SimpleNamespace(config=config, model=build_meta_model(config, attn_implementation="sdpa"),
                                  weight_plan=None)
    line = export_shards_warning(built, dtype=torch.bfloat16, max_shard_size="1KB")
    assert line is not None and line.startswith("--max-shard-size 1,000 bytes splits the export into ")
    assert " files (more than 16 files under 100 MB each" in line
    assert export_shards_warning(built, dtype=torch.bfloat16, max_shard_size="5GB") is None


def test_a_step_that_does_not_exist_names_the_steps_that_do_and_the_command_with_the_nearest(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # captured stderr: each sentence on one line
    run, out = trained / "run", tmp_path / "x"
    assert main([str(run / "checkpoints" / "step_7"), "--output", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"kernelguard export: error: {run / 'checkpoints' / 'step_7'} does not exist. The complete checkpoints of "
         f"{run} are at steps 1, 2."),
        f"Fix: kernelguard export {run / 'checkpoints' / 'step_2'} --output {out}",
    ]
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("*.lock"))
    (copy / "checkpoints" / "step_1" / ckpt.MARKER).unlink()  # a save cut short: the folder is there, unsealed
    assert main([str(copy / "checkpoints" / "step_1")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"kernelguard export: error: {copy / 'checkpoints' / 'step_1'} has no COMPLETE marker (a save cut short, "
         f"or a partial copy). The complete checkpoints of {copy} are at step 2."),
        f"Fix: kernelguard export {copy / 'checkpoints' / 'step_2'}",
    ]
    assert not out.exists()
    # A save being written, inside its run (the complete steps named) and copied out alone (how to find one).
    (copy / "checkpoints" / "step_1").rename(unsealed := copy / "checkpoints" / "step_3.tmp")
    assert main([str(unsealed)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"kernelguard export: error: {unsealed} is a save still being written or cut short (a .tmp folder is never "
         f"a complete checkpoint). The complete checkpoints of {copy} are at step 2."),
        f"Fix: kernelguard export {copy / 'checkpoints' / 'step_2'}",
    ]
    alone = tmp_path / "elsewhere" / "step_4.tmp"
    shutil.copytree(unsealed, alone)
    assert main([str(alone)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"kernelguard export: error: {alone} is a save still being written or cut short (a .tmp folder is never a "
         f"complete checkpoint), and {alone.parent} has no complete checkpoint (a run saves one every --save-steps N "
         "steps and at its end)."),
        "Fix: pass a complete checkpoint: a run's OUTPUT/checkpoints/step_N folder holding a COMPLETE file",
    ]
    # The run has exported already: the corrected command writes beside final/, and it works when pasted.
    (copy / "final").mkdir()
    assert main([str(copy / "checkpoints" / "step_7")]) == 2
    fix = capsys.readouterr().err.splitlines()[-1]
    assert fix == (f"Fix: kernelguard export {copy / 'checkpoints' / 'step_2'} --output {copy / 'final-step_2'}")
    assert main(shlex.split(fix.removeprefix("Fix: kernelguard export "))) == 0
    assert (copy / "final-step_2" / "config.json").is_file()


def test_an_export_says_what_it_reads_and_writes_as_it_goes(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step, out = trained / "run" / "checkpoints" / "step_2", tmp_path / "exported"
    assert main([str(step), "--output", str(out)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == [f"kernelguard export: loading torch and transformers to export {step}",
                         f"kernelguard export: reading {step}: the model config and weight layout it carries"]
    assert lines[2].startswith("kernelguard export: writing 56 tensors (") and lines[2].endswith(
        f" MiB, bfloat16) in 1 safetensors file to {out}")
    assert lines[3:] == ["kernelguard export: adding the config, tokenizer, chat template and generation config",
                         f"kernelguard export: wrote {out}"]
