#!/usr/bin/env python
"""bench/gpu/acceptance.sh's summary: one JSON and one line from the parts it wrote.

    python bench/gpu/acceptance_summary.py RESULTS_DIR OUT.json

Green when: every GPU test passed or skipped with a reason (none failed, none errored), `check --run` exited 0
cold and warm, and the step diagnosis called the fallback a slow path and neither the product nor the stock
recipe anything but healthy. A part that did not run is reported as missing, which is not green.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

EXPECTED_VERDICTS = {"fallback": {"slow_path"}, "product_default": {"healthy"}, "stock_best": {"healthy"},
                     "product_noac+compile": {"healthy"}}
OPTIONAL = {"product_noac+compile"}  # run only when time is left


def gpu_tests(results: Path) -> dict[str, Any]:
    xml = results / "gpu_tests.xml"
    if not xml.exists():
        return tests_from_progress(results / "gpu_tests.progress.jsonl")
    root = ET.parse(xml).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
            elif child.tag == "skipped":
                outcome = "skipped"
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "s": round(float(case.get("time") or 0), 1)})
    count = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failure", "error", "skipped")}
    return {**count, "cases": cases}


def tests_from_progress(path: Path) -> dict[str, Any]:
    """What a run cut before pytest wrote its XML did (bench/gpu/progress_log.py's lines): the tests that
    ended, and the one that was running when the time ran out. A cut run is never green."""
    if not path.exists():
        return {"missing": True}
    ended: dict[str, dict[str, Any]] = {}
    started: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["event"] == "start":
            started.append(record["test"])
        elif record["test"] not in ended or record["outcome"] != "passed":  # a teardown error outranks the call
            ended[record["test"]] = {"test": record["test"], "outcome": record["outcome"], "s": record["s"]}
    cases = list(ended.values())
    count = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failure", "error", "skipped")}
    running = [t for t in started if t not in ended]
    return {**count, "cases": cases, "cut": True, "cut_during": running[-1] if running else None}


def bench(results: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in sorted(results.glob("bench_*.json")):
        data = json.loads(path.read_text())
        for variant, det in (data.get("detector") or {}).items():
            out[variant] = {"tokens_per_s": (data.get("tokens_per_s") or {}).get(variant), **(det or {})}
        for variant, err in (data.get("errors") or {}).items():
            out.setdefault(variant, {})["error"] = str(err)[-500:]
    return out


def extras(results: Path) -> dict[str, Any]:
    """Every JSON an extra script wrote (acceptance_parts/extra_NAME/*.json), by script and file name."""
    out: dict[str, Any] = {}
    for path in sorted(results.glob("extra_*/*.json")):
        try:
            out.setdefault(path.parent.name.removeprefix("extra_"), {})[path.stem] = json.loads(path.read_text())
        except ValueError:
            out.setdefault(path.parent.name.removeprefix("extra_"), {})[path.stem] = "unreadable"
    return out


def main(results: Path, dest: Path) -> int:
    summary: dict[str, Any] = {"check": {}, "gpu_tests": gpu_tests(results), "diagnosis": bench(results),
                               "extras": extras(results)}
    for name in ("cold", "warm"):
        part = results / f"check_{name}.json"
        summary["check"][name] = json.loads(part.read_text()) if part.exists() else {"missing": True}
    diag = summary["diagnosis"]
    verdicts = {v: (diag.get(v) or {}).get("verdict") for v in EXPECTED_VERDICTS}
    verdicts_right = {v: verdicts[v] in ok or (v in OPTIONAL and verdicts[v] is None)
                      for v, ok in EXPECTED_VERDICTS.items()}
    product, stock = (diag.get("product_default") or {}).get("tokens_per_s"), (diag.get("stock_best") or {}).get(
        "tokens_per_s")
    ratio = round(product / stock, 2) if product and stock else None
    tests = summary["gpu_tests"]
    checks = {
        "gpu_tests": not tests.get("missing") and not tests.get("cut")
        and tests.get("failure", 0) + tests.get("error", 0) == 0 and tests.get("passed", 0) > 0,
        "check_run": all(summary["check"][n].get("rc") == 0 for n in ("cold", "warm")),
        "diagnosis": all(verdicts_right.values()),
    }
    train = (summary["extras"].get("train_diagnosis") or {}).get("train_diagnosis")
    if train is not None:
        checks["train_no_alarm"] = bool(train.get("no_alarm"))
    partial = os.environ.get("ACCEPTANCE_PARTIAL")
    if partial:  # only what ran is judged; the head says PARTIAL, never GREEN
        checks["check_run"] = checks["check_run"] or all(summary["check"][n].get("missing") for n in ("cold", "warm"))
        checks["diagnosis"] = all(ok or verdicts[v] is None for v, ok in verdicts_right.items())
    summary.update(verdicts=verdicts, verdicts_right=verdicts_right, product_vs_stock_best=ratio, green=all(
        checks.values()) and not partial, checks=checks, partial=partial)
    dest.write_text(json.dumps(summary, indent=2, default=str))
    cold, warm = summary["check"]["cold"], summary["check"]["warm"]
    line = (
        f"acceptance {('PARTIAL ok' if all(checks.values()) else 'PARTIAL RED') if partial else ('GREEN' if summary['green'] else 'RED')}"
        f"{f' ({partial})' if partial else ''}: gpu tests {tests.get('passed', 0)} passed, "
        f"{tests.get('failure', 0) + tests.get('error', 0)} failed, {tests.get('skipped', 0)} skipped"
        f"{_cut_note(tests)}; "
        f"check --run cold {cold.get('wall_s')} s (rc {cold.get('rc')}), warm {warm.get('wall_s')} s "
        f"(rc {warm.get('rc')}); diagnosis "
        + ", ".join(f"{v}={verdicts[v] or 'not run'}{'' if verdicts_right[v] or (partial and verdicts[v] is None) else ' (WRONG)'}"
                    for v in EXPECTED_VERDICTS)
        + f"; product {ratio}x stock best"
        + (f"; kernelguard train: {'no alarm' if checks['train_no_alarm'] else 'ALARM or failure'} "
           f"({len(train.get('windows', []))} windows)" if train is not None else "")
    )
    print(line)
    for case in tests.get("cases", []):
        if case["outcome"] in ("failure", "error"):
            print(f"  {case['outcome']}: {case['test']} ({case['s']} s)")
    return 0 if all(checks.values()) else 1


def _cut_note(tests: dict[str, Any]) -> str:
    if not tests.get("cut"):
        return ""
    return f" (CUT by the time limit, during {tests['cut_during']})" if tests.get("cut_during") else " (CUT)"


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
