"""bench/gpu/acceptance.sh's GPU-test step when the call's time limit cuts pytest (no --junitxml then): the
progress plugin's lines still say what passed, what failed, and which test was running; a cut run is never green."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))
from acceptance_summary import gpu_tests, main

TESTS = '''
import time, pytest

def test_a_passes(): pass

def test_b_fails(): assert False

@pytest.mark.skip(reason="no GPU")
def test_c_skips(): pass

def test_d_hangs(): time.sleep(600)

def test_e_never_reached(): pass
'''


@pytest.mark.parametrize("cut", [True, False], ids=["cut by the time limit", "ran to the end"])
def test_a_cut_run_still_reports_what_it_did(tmp_path: Path, cut: bool) -> None:
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_x.py").write_text(TESTS if cut else TESTS.replace("time.sleep(600)", "pass"))
    results = tmp_path / "results"
    results.mkdir()
    env = dict(os.environ, KG_TEST_PROGRESS=str(results / "gpu_tests.progress.jsonl"),
               PYTHONPATH=os.pathsep.join([str(GPU_BENCH), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "progress_log",
                             "--junitxml", str(results / "gpu_tests.xml"), str(tests)], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    if cut:  # what `timeout` does to the call's pytest: killed mid-test, before it writes its XML
        progress = results / "gpu_tests.progress.jsonl"
        deadline = time.monotonic() + 120
        while "test_d_hangs" not in (progress.read_text() if progress.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=120)
    assert (results / "gpu_tests.xml").exists() is not cut
    summary = gpu_tests(results)
    outcomes = {c["test"].rsplit("test_", 1)[-1]: c["outcome"] for c in summary["cases"]}
    if cut:
        assert outcomes == {"a_passes": "passed", "b_fails": "failure", "c_skips": "skipped"}
        assert summary["cut"] is True and summary["cut_during"].endswith("test_x.py::test_d_hangs")
    else:
        assert outcomes == {"a_passes": "passed", "b_fails": "failure", "c_skips": "skipped", "d_hangs": "passed",
                            "e_never_reached": "passed"}
        assert "cut" not in summary
    assert (summary["passed"], summary["failure"], summary["skipped"]) == ((1, 1, 1) if cut else (3, 1, 1))


def test_a_cut_run_of_passing_tests_is_not_green(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    lines = [{"test": "tests/test_a.py::test_ok", "event": "start"},
             {"test": "tests/test_a.py::test_ok", "event": "end", "outcome": "passed", "s": 1.0},
             {"test": "tests/test_b.py::test_slow", "event": "start"}]
    (results / "gpu_tests.progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(results, tmp_path / "acceptance.json") == 1
    summary = json.loads((tmp_path / "acceptance.json").read_text())
    assert summary["checks"]["gpu_tests"] is False and summary["gpu_tests"]["passed"] == 1
    assert "gpu tests 1 passed, 0 failed, 0 skipped (CUT by the time limit, during tests/test_b.py::test_slow)" in (
        capsys.readouterr().out)
