"""The output-folder lock and the unwrapping of write failures, in-process (the end-to-end faults are
tests/train/test_faults.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelguard.errors import CheckpointError
from kernelguard.train.common.run_folder_lock import LOCK_FILE, acquire, holder_of
from kernelguard.train.common.write_errors import root_cause, write_failure


def test_a_held_folder_is_refused_naming_the_holder_and_freed_on_release(tmp_path: Path) -> None:
    out = tmp_path / "new" / "run"
    lock = acquire(out, argv=["kernelguard", "train", "--output-dir", str(out)])
    assert holder_of(out) is not None and holder_of(out)["pid"] == os.getpid()  # type: ignore[index]
    with pytest.raises(CheckpointError) as e:
        acquire(out)  # another open file description: flock refuses it even in this process
    assert f"--output-dir {out} is in use by another run (pid {os.getpid()} on " in str(e.value)
    assert f"kernelguard train --output-dir {out}" in str(e.value)
    lock.release()
    assert not (tmp_path / "new").exists()  # nothing else was written: the folders it made are gone
    acquire(out).release()


def test_a_lock_file_left_by_a_dead_process_blocks_nothing(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from kernelguard.train.common.run_folder_lock import acquire; "
        "acquire(Path(sys.argv[1])); import os; os._exit(9)"  # dies holding it, the file stays
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, cwd=Path(__file__).parents[2])
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] != os.getpid()
    with acquire(tmp_path):
        assert holder_of(tmp_path)["pid"] == os.getpid()  # type: ignore[index]
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_folder_where_the_lock_file_goes_is_named_not_blamed_on_permissions(tmp_path: Path) -> None:
    from kernelguard.errors import ConfigError

    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(ConfigError) as info:
        acquire(tmp_path)
    assert "is a folder, where this run's lock file belongs" in info.value.message
    assert "may write" not in info.value.message
    assert info.value.fix == f"move it away: mv {tmp_path / LOCK_FILE} {tmp_path / LOCK_FILE}.old"
    subprocess.run(info.value.fix.removeprefix("move it away: ").split(), check=True)  # the fix, pasted
    acquire(tmp_path).release()


def test_dcp_failures_are_unwrapped_to_their_real_cause(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "__0_0.distcp"))
    wrapped = CheckpointException("save failed", {1: (full, None), 0: (RuntimeError("peer gone"), None)})
    assert root_cause(wrapped) is wrapped.failures[0][0]  # the lowest rank's
    error = write_failure("writing checkpoint X", CheckpointException("", {1: (full, None)}), folder=tmp_path)
    assert isinstance(error, CheckpointError)
    assert str(error).startswith(
        f"writing checkpoint X failed: No space left on device (ENOSPC): {full.filename}"
    )
    assert "free disk space on the disk of" in str(error)
    interrupted = CheckpointException("", {0: (full, None), 1: (KeyboardInterrupt(), None)})
    assert isinstance(write_failure("w", interrupted, folder=tmp_path), KeyboardInterrupt)


def test_a_real_safetensors_write_error_names_its_errno(tmp_path: Path) -> None:
    """The text safetensors raises when the kernel refuses a write (here RLIMIT_FSIZE's EFBIG, in a child)."""
    code = (
        "import resource, sys, torch; from safetensors.torch import save_file; "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
        "save_file({'a': torch.zeros(10**6)}, sys.argv[1])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.safetensors")],
        check=False,
        capture_output=True,
        text=True,
    )
    message = r.stderr.strip().splitlines()[-1].split(": ", 1)[1]
    assert "(os error 27)" in message, r.stderr
    error = write_failure("exporting", RuntimeError(message), folder=tmp_path, need_bytes=4 << 20)
    assert "File too large (EFBIG), about 4.0 MiB is needed" in str(error)
    assert "ulimit -f" in str(error)
