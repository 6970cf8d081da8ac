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

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
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
        assert summary["cut"] is True and summary["cut_during"][0].endswith("test_x.py::test_d_hangs")
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
    assert ("gpu tests 1 passed, 0 failed, 0 skipped in 1 group(s) (CUT by the time limit, during "
            "tests/test_b.py::test_slow)") in capsys.readouterr().out


# --------------------------------------------------------------------- the one-call run: several parts at once ---
def _junit(path: Path, cases: dict[str, str]) -> None:
    """A junit XML as pytest writes it: {"file.py::name": "passed" | "failure" | "skipped"}."""
    body = "".join(
        f'<testcase classname="{t.split("::")[0]}" name="{t.split("::")[1]}" time="1.5">'
        + {"passed": "", "failure": '<failure message="x"/>', "skipped": '<skipped message="no varlen"/>'}[o]
        + "</testcase>"
        for t, o in cases.items()
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>')


def _whole_run(results: Path) -> list[dict[str, object]]:
    """Every part of a full acceptance.sh run, each as it writes it, all of them right; returns the timeline."""
    results.mkdir()
    for name, wall in (("cold", 47.6), ("warm", 24.6)):
        (results / f"check_{name}.json").write_text(json.dumps({"rc": 0, "wall_s": wall, "shared_gpu": name == "warm"}))
    verdicts = {"fallback": "slow_path", "product_default": "healthy", "stock_best": "healthy"}
    speed = {"fallback": 8500.0, "product_default": 50000.0, "stock_best": 20000.0}
    for variant, verdict in verdicts.items():
        (results / f"bench_{variant}.json").write_text(json.dumps(
            {"tokens_per_s": {variant: speed[variant]}, "detector": {variant: {"verdict": verdict}}, "errors": {}}))
    _junit(results / "gpu_tests.train.xml", {"tests/train/test_train_gpu.py::test_a": "passed",
                                             "tests/train/test_train_gpu.py::test_b": "skipped"})
    _junit(results / "gpu_tests.exact.xml", {"tests/runtime/test_packing_exactness.py::test_gpu": "passed"})
    (results / "extra_train_diagnosis").mkdir()
    (results / "extra_train_diagnosis" / "train_diagnosis.json").write_text(
        json.dumps({"no_alarm": True, "windows": [{}, {}, {}]}))
    timeline = [{"part": "check_cold", "kind": "check", "shared_gpu": False, "rc": 0, "t0_s": 30, "t1_s": 78,
                 "limit_s": 200}]
    timeline += [{"part": p, "kind": k, "shared_gpu": True, "rc": 0, "t0_s": 78, "t1_s": 230, "limit_s": 215}
                 for p, k in (("gpu_tests.train", "tests"), ("gpu_tests.exact", "tests"),
                              ("variant_fallback", "variant"), ("extra_train_diagnosis", "extra"))]
    (results / "parts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in timeline))
    return timeline


def _summarise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wall: str = "437") -> tuple[int, dict]:
    monkeypatch.setenv("ACCEPTANCE_WALL_S", wall)
    monkeypatch.setenv("ACCEPTANCE_TARGET_S", "480")
    monkeypatch.delenv("ACCEPTANCE_PARTIAL", raising=False)
    rc = main(tmp_path / "results", tmp_path / "acceptance.json")
    return rc, json.loads((tmp_path / "acceptance.json").read_text())


def test_a_whole_run_in_several_groups_is_green_and_says_its_wall_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _whole_run(tmp_path / "results")
    rc, summary = _summarise(tmp_path, monkeypatch)
    line = capsys.readouterr().out.splitlines()[0]
    assert rc == 0 and summary["green"] is True, summary["checks"]
    assert line.startswith("acceptance GREEN in 437 s (target 480 s): gpu tests 2 passed, 0 failed, 1 skipped in "
                           "2 group(s); check --run cold 47.6 s (rc 0), warm 24.6 s on the shared GPU (rc 0)"), line
    assert line.endswith("product 2.5x stock best; kernelguard train: no alarm (3 windows)"), line
    assert summary["gpu_tests"]["groups"] == {"exact": {"passed": 1, "failure": 0, "error": 0, "skipped": 0},
                                              "train": {"passed": 1, "failure": 0, "error": 0, "skipped": 1}}
    assert [p["part"] for p in summary["parts"]][:2] == ["check_cold", "gpu_tests.train"]


def _skip_fallback(results: Path) -> None:
    lines = [json.loads(x) for x in (results / "parts.jsonl").read_text().splitlines()]
    lines = [p for p in lines if p["part"] != "variant_fallback"]
    lines.append({"part": "variant_fallback", "kind": "variant", "skipped": "40 s left"})
    (results / "parts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    (results / "bench_fallback.json").unlink()


def _cut_a_group(results: Path) -> None:
    (results / "gpu_tests.exact.xml").unlink()  # what `timeout` leaves: the progress lines, no XML
    (results / "gpu_tests.exact.progress.jsonl").write_text(
        json.dumps({"test": "tests/runtime/test_packing_exactness.py::test_gpu", "event": "start"}) + "\n")
    lines = (results / "parts.jsonl").read_text().replace('"gpu_tests.exact", "kind": "tests", "shared_gpu": true, '
                                                          '"rc": 0', '"gpu_tests.exact", "kind": "tests", '
                                                          '"shared_gpu": true, "rc": 124')
    (results / "parts.jsonl").write_text(lines)


def _group_left_nothing(results: Path) -> None:
    (results / "gpu_tests.exact.xml").unlink()


@pytest.mark.parametrize(
    ("spoil", "wall", "failed_check", "in_line"),
    [
        (_skip_fallback, "437", "diagnosis", "fallback=not run (WRONG)"),
        (_cut_a_group, "437", "gpu_tests", "(CUT by the time limit, during tests/runtime/test_packing_exactness.py::test_gpu)"),
        (_group_left_nothing, "437", "gpu_tests", "(MISSING: exact)"),
        (lambda r: (r / "bench_stock_best.json").unlink(), "437", "diagnosis", "stock_best=not run (WRONG)"),
        (lambda r: (r / "extra_train_diagnosis" / "train_diagnosis.json").unlink(), "437", "train_no_alarm",
         "kernelguard train: not run"),
        (lambda r: None, "493", "wall", "acceptance RED in 493 s (target 480 s: OVER)"),
    ],
    ids=["a part skipped for time", "a group cut", "a group that left nothing", "a variant without its verdict",
         "no train diagnosis", "over the wall-time target"],
)
def test_a_run_not_whole_is_red_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    spoil: object, wall: str, failed_check: str, in_line: str,
) -> None:
    _whole_run(tmp_path / "results")
    spoil(tmp_path / "results")  # type: ignore[operator]
    rc, summary = _summarise(tmp_path, monkeypatch, wall)
    out = capsys.readouterr().out
    assert rc == 1 and summary["green"] is False and out.startswith("acceptance RED")
    assert summary["checks"][failed_check] is False, summary["checks"]
    assert in_line in out, out


def test_a_part_stopped_by_its_limit_is_not_whole_even_when_its_files_look_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    _whole_run(results)
    text = (results / "parts.jsonl").read_text().replace('"variant_fallback", "kind": "variant", "shared_gpu": true, '
                                                         '"rc": 0', '"variant_fallback", "kind": "variant", '
                                                         '"shared_gpu": true, "rc": 137')
    (results / "parts.jsonl").write_text(text)
    rc, summary = _summarise(tmp_path, monkeypatch)
    assert rc == 1 and summary["checks"]["parts_whole"] is False
    assert summary["not_whole"] == ["variant_fallback stopped at its 215 s limit"]
    assert "  not whole: variant_fallback stopped at its 215 s limit" in capsys.readouterr().out


def test_tiny_run_on_cpu_needs_each_variant_to_run_not_a_gpu_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    _whole_run(results)
    for path in results.glob("bench_*.json"):  # what a CPU run writes: steps timed, no GPU kernels to judge
        data = json.loads(path.read_text())
        data["detector"] = {v: {"verdict": None} for v in data["detector"]}
        path.write_text(json.dumps(data))
    rc, summary = _summarise(tmp_path, monkeypatch)
    assert rc == 1 and summary["checks"]["diagnosis"] is False  # on a GPU a missing verdict is red
    monkeypatch.setenv("ACCEPTANCE_TINY", "1")
    capsys.readouterr()
    rc, summary = _summarise(tmp_path, monkeypatch)
    assert rc == 0 and summary["green"] is True
    assert capsys.readouterr().out.startswith("acceptance GREEN (--tiny: CPU plumbing, no GPU verdicts) in 437 s")
    (results / "bench_stock_best.json").write_text(json.dumps({"errors": {"stock_best": "boom"}}))
    rc, summary = _summarise(tmp_path, monkeypatch)
    assert rc == 1 and summary["verdicts_right"]["stock_best"] is False
