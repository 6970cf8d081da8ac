"""A pytest plugin for bench/gpu/acceptance.sh: one JSON line per test as it starts and as it ends, so a run cut
by the call's time limit (which writes no --junitxml) still says what passed, what failed and which test was
running when it was cut.

    KG_TEST_PROGRESS=FILE python -m pytest -p progress_log ...   # bench/gpu on PYTHONPATH
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

_START: dict[str, float] = {}


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get("KG_TEST_PROGRESS")
    if path:
        with open(path, "a", encoding="utf-8") as f:  # appended and closed per line: a kill loses nothing written
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _START[nodeid] = time.time()
    _write({"test": nodeid, "event": "start"})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The outcome a person reads: a failing setup or teardown is an error, a skip anywhere a skip.
    if report.when == "call" or report.outcome != "passed":
        outcome = {"passed": "passed", "skipped": "skipped"}.get(report.outcome, "failure")
        if report.when != "call" and outcome == "failure":
            outcome = "error"
        _write({"test": report.nodeid, "event": "end", "outcome": outcome,
                "s": round(time.time() - _START.get(report.nodeid, time.time()), 1)})
