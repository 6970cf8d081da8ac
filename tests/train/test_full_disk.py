"""A full disk at each write site of a run: one line naming the cause (ENOSPC), the folder and what is free; the
documented exit code; nothing earlier lost and nothing half-written left. The end-to-end walk over every write
site is in bench/cpu/bad_inputs_sweep.py (``enospc-file:NAME`` fault, CI runs it); these are the mechanisms, in
process, and one real size-limited disk where the machine lets a test mount one."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.errors import CheckpointError, exit_code_for
from kernelguard.train.common.atomic_file import write_text_atomically
from kernelguard.train.common.run_folder_lock import LOCK_FILE, acquire
from kernelguard.train.common.write_errors import write_failure
from kernelguard.train.output.metrics import MetricsLog

ENOSPC = os.strerror(errno.ENOSPC)


def test_metrics_jsonl_on_a_full_disk_is_one_error_and_close_says_nothing_more(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None)
    log.write({"step": 1, "loss": 2.0})
    log._file.close()
    log._file = open("/dev/full", "a")  # noqa: SIM115 - the kernel's own ENOSPC at the next flush
    with pytest.raises(CheckpointError) as info:
        log.write({"step": 2, "loss": 1.5})
    assert info.value.message.startswith(f"writing {tmp_path / 'metrics.jsonl'} failed: {ENOSPC} (ENOSPC)")
    assert info.value.fix.startswith(f"free disk space on the disk of {tmp_path}")
    assert exit_code_for(info.value) == 2
    log.close()  # the buffered line fails again on close: already said, not raised twice
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'  # what was written stays


def test_the_run_folder_lock_on_a_full_disk_leaves_no_lock_and_no_folder(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(os, "write", full)
    output = tmp_path / "new" / "run"
    with pytest.raises(CheckpointError) as info:
        acquire(output)
    assert info.value.message.startswith(f"--output-dir {output}: writing its lock file {output / LOCK_FILE} failed: "
                                         f"{ENOSPC} (ENOSPC)")
    assert info.value.fix.endswith("then run the same command again")
    assert not (tmp_path / "new").exists()  # the folders it made are gone again


def test_an_atomic_record_that_cannot_be_renamed_leaves_no_temporary_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: Path, target: Path) -> None:
        raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(OSError):
        write_text_atomically(tmp_path / "run.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_torchs_unexpected_pos_is_a_full_disk_when_the_disk_has_less_room_than_the_write(tmp_path: Path) -> None:
    said = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    free = shutil.disk_usage(tmp_path).free
    full = write_failure("writing checkpoint X", said, folder=tmp_path, need_bytes=free * 2)
    assert full.message.startswith(f"writing checkpoint X failed: {ENOSPC} (ENOSPC) (torch's writer said: [enforce "
                                   "fail at inline_container.cc:672] . unexpected pos 704 vs 598), about ")
    roomy = write_failure("writing checkpoint X", said, folder=tmp_path, need_bytes=1024)
    assert "ENOSPC" not in roomy.message and roomy.fix.startswith("fix the cause above")  # another cause: no guess


def _mount_small_disk(where: Path, size: str) -> bool:
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def test_a_real_disk_that_fills_during_a_checkpoint_says_so(tmp_path: Path) -> None:
    """Where the machine lets a test mount a 4 MB tmpfs (root, no sandbox): the tiny run's first checkpoint fits
    (2.9 MB) and the second does not; torch's writer reports it as "unexpected pos", the run says ENOSPC."""
    assets = h.write_train_assets(tmp_path / "assets", rows=60)
    disk = tmp_path / "disk"
    if not _mount_small_disk(disk, "4m"):
        pytest.skip("this machine does not let a test mount a size-limited tmpfs")
    try:
        r = h.run_train(["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data",
                         str(assets["data"]), "--block-size", "256", "--max-steps", "2", "--save-steps", "1",
                         "--no-progress", "--no-plot", "--allow", "attention", "--output-dir", str(disk / "run")],
                        nproc=0)
        assert r.returncode == 2, r.stderr
        error = next(line for line in r.stderr.splitlines() if "error:" in line)
        assert f"writing checkpoint {disk / 'run' / 'checkpoints' / 'step_2.tmp'} failed: {ENOSPC} (ENOSPC)" in error
        assert "Traceback" not in r.stderr
        assert (disk / "run" / "checkpoints" / "step_1" / "COMPLETE").is_file()  # nothing earlier lost
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, check=False)
