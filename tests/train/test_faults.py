"""Fault injection through the real entry points, on CPU with the tiny model and the fake providers: two runs on
one folder, kill -9 of the launcher and of one rank, SIGTERM, a full disk during a checkpoint and during the
final export. Each ends with the folder consistent (no ``*.tmp``, the last good checkpoint kept) and a
``--resume`` that continues exactly (the same losses and final weights as an uninterrupted run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

pytestmark = pytest.mark.slow

STEPS = 8
FAULT_HOOKS = h.TESTS_DIR / "fault_hooks"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return h.write_train_assets(tmp_path_factory.mktemp("faults"))


def _args(assets: dict[str, Path], output: Path, *extra: str) -> list[str]:
    return [
        "--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
        "--output-dir", str(output), "--block-size", "256", "--param-dtype", "fp32", "--learning-rate", "3e-3",
        "--schedule-steps", "8", "--warmup-steps", "1", "--no-progress", "--no-plot", "--allow", "attention",
        "--max-steps", str(STEPS), *extra,
    ]  # fmt: skip


def _env(fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(h.REPO), str(h.FAKE_PROVIDERS)] + ([str(FAULT_HOOKS)] if fault else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("KERNELGUARD_FAULT", None)
    if fault:
        env["KERNELGUARD_FAULT"] = fault
    return env


def _start(args: list[str], *, ranks: int = 0, fault: str | None = None) -> subprocess.Popen[str]:
    """`kernelguard train ARGS` (one process), or with `--nproc-per-node RANKS` (the launcher)."""
    launcher = ["--nproc-per-node", str(ranks)] if ranks else []
    cmd = [sys.executable, "-m", "kernelguard.train", *launcher, *args]
    return subprocess.Popen(
        cmd, env=_env(fault), cwd=str(h.REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _run(args: list[str], *, ranks: int = 0, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = _start(args, ranks=ranks, fault=fault)
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _losses(output: Path) -> dict[int, float]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if x.strip()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"steps written twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _wait_for(predicate: Callable[[], bool], *, timeout: float, what: str, proc: Any = None) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: {proc.communicate()[1]}")
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _steps_done(output: Path) -> int:
    try:
        return sum('"loss"' in x for x in (output / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _rank_pid(launcher: int, rank: int) -> int:
    """The launched process of ``rank``, read from its environment: the launcher's newest child is not always a
    rank (a helper process started later), and killing a helper leaves the run to finish."""
    for pid in _children(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(v.startswith(b"LOCAL_RANK=") for v in env):
            return pid
    raise AssertionError(f"no child of the launcher (pid {launcher}) is rank {rank}: {_children(launcher)}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_consistent(output: Path) -> None:
    """No half-written folder anywhere; every checkpoint sealed."""
    from kernelguard.train.output import checkpoint as ckpt
    leftovers = sorted(str(p.relative_to(output)) for p in output.rglob("*.tmp"))
    assert leftovers == [], leftovers
    for _, folder in ckpt.complete_checkpoints(output):
        assert ckpt.verify_checkpoint(folder) is None
    root = ckpt.checkpoint_root(output)
    unsealed = [p.name for p in root.iterdir() if not (p / ckpt.MARKER).is_file()] if root.is_dir() else []
    assert unsealed == []


def _assert_resumes_exactly(reference: Path, output: Path, cmd: list[str], *, ranks: int = 0) -> None:
    from safetensors.torch import load_file

    r = _run([*cmd, "--resume"], ranks=ranks)
    assert r.returncode == 0, r.stderr
    a, b = _losses(reference), _losses(output)
    assert sorted(b) == sorted(a)
    assert all(abs(a[s] - b[s]) <= 1e-6 for s in a), (a, b)
    pa, pb = (load_file(str(o / "final" / "model.safetensors")) for o in (reference, output))
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) <= 1e-6
    _assert_consistent(output)


@pytest.fixture(scope="module")
def reference(assets: dict[str, Path]) -> Path:
    """One process, uninterrupted."""
    out = assets["root"] / "reference"
    r = _run(_args(assets, out))
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def reference2(assets: dict[str, Path]) -> Path:
    """Two ranks through the launcher, uninterrupted."""
    out = assets["root"] / "reference2"
    r = _run(_args(assets, out), ranks=2)
    assert r.returncode == 0, r.stderr
    return out


def test_second_run_is_refused_then_sigterm_saves_and_resume_is_exact(
    assets: dict[str, Path], reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "two-runs"
    cmd = _args(assets, out, "--save-steps", "0")
    first = _start(cmd)
    _wait_for(lambda: _steps_done(out) >= 2, timeout=120, what="two steps", proc=first)
    os.kill(first.pid, signal.SIGSTOP)  # keep it mid-training, holding the folder, while the others try
    try:
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
        for attempt, ranks in ((["--resume"], 0), (["--overwrite"], 2)):
            r = _run([*cmd, *attempt], ranks=ranks)
            assert r.returncode == 2, r.stderr
            assert f"--output-dir {out} is in use by another run (pid {first.pid} on " in r.stderr, r.stderr
            assert "kernelguard.train" in r.stderr and "then --resume" in r.stderr
            assert "Traceback" not in r.stderr, r.stderr
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written by them
    finally:
        os.kill(first.pid, signal.SIGCONT)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    stopped = _steps_done(out)
    line = f"kernelguard train: stopped by SIGTERM after step {stopped} of {STEPS}; checkpoint step_{stopped} is saved"
    assert line in err, err
    assert f"\nFix: kernelguard train {shlex.join([*cmd, '--resume'])}\n" in err, err  # the line to paste
    assert "Traceback" not in err
    _assert_consistent(out)
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{stopped}"]
    assert not (out / "final").exists()
    _assert_resumes_exactly(reference, out, cmd)


def test_kill_9_of_the_launcher_takes_its_ranks_with_it(
    assets: dict[str, Path], reference2: Path, tmp_path: Path
) -> None:
    out = tmp_path / "launcher-killed"
    cmd = _args(assets, out, "--save-steps", "1")
    launcher = _start(cmd, ranks=2)
    _wait_for(lambda: _steps_done(out) >= 2, timeout=150, what="two steps", proc=launcher)
    ranks = _children(launcher.pid)
    assert len(ranks) == 2, ranks
    launcher.kill()
    launcher.communicate(timeout=30)
    end = time.monotonic() + 5
    while any(_alive(p) for p in ranks) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(_alive(p) for p in ranks), "ranks outlived their launcher"
    # The dead launcher's lock file may remain; it blocks nothing, and the half-written checkpoint is discarded.
    _assert_resumes_exactly(reference2, out, cmd, ranks=2)


def test_kill_9_of_one_rank_is_reported_once(assets: dict[str, Path], reference2: Path, tmp_path: Path) -> None:
    out = tmp_path / "rank-killed"
    cmd = _args(assets, out, "--save-steps", "1")
    launcher = _start(cmd, ranks=2)
    _wait_for(lambda: _steps_done(out) >= 2, timeout=150, what="two steps", proc=launcher)
    os.kill(_rank_pid(launcher.pid, 1), signal.SIGKILL)
    _, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 137, err
    assert err.count("was killed by SIGKILL") == 1, err
    assert "Traceback" not in err, err
    _assert_resumes_exactly(reference2, out, cmd, ranks=2)


@pytest.mark.parametrize("fault", ["checkpoint:step_4", "checkpoint-rng:step_4", "export"])
def test_disk_full_is_named_and_the_last_checkpoint_kept(
    assets: dict[str, Path], reference: Path, fault: str, tmp_path: Path
) -> None:
    out = tmp_path / fault.replace(":", "-")
    cmd = _args(assets, out, "--save-steps", "2")
    r = _run(cmd, fault=fault)
    assert r.returncode == 2, r.stderr
    assert "No space left on device (ENOSPC)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "SafetensorError" not in r.stderr, r.stderr
    assert f"Fix: free disk space on the disk of {out}" in r.stderr, r.stderr
    _assert_consistent(out)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    if fault == "export":
        assert f"exporting the final model to {out / 'final.tmp'} failed" in r.stderr
        assert re.search(r"about [0-9.]+ [KMG]iB is needed; [0-9.]+ [KMG]iB free there", r.stderr), r.stderr
        assert not (out / "final").exists() and f"step_{STEPS}" in kept
    else:
        assert f"writing checkpoint {out / 'checkpoints' / 'step_4.tmp'} failed" in r.stderr
        assert kept == ["step_2"]
    _assert_resumes_exactly(reference, out, cmd)
