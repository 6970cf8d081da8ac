#!/usr/bin/env python
"""bench/gpu/acceptance.sh's summary: one JSON and one line from the parts it wrote.

    ACCEPTANCE_WALL_S=S ACCEPTANCE_TARGET_S=480 python bench/gpu/acceptance_summary.py RESULTS_DIR OUT.json

Green only when every part ran whole: every GPU test group ran to its end (none cut, no test failed or errored;
a skip with a reason is allowed), `check --run` exited 0 cold and warm, every variant of the step diagnosis gave
its verdict and the right one (the fallback a slow path, the others healthy), `kernelguard train` raised no
alarm, no part was skipped or stopped for time (acceptance.sh's parts.jsonl), and the whole run took at most
ACCEPTANCE_TARGET_S. A part that did not run is missing, which is not green. With ACCEPTANCE_PARTIAL set (a
call that repeats only some parts) only what ran is judged and the head says PARTIAL, never GREEN.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

__all__ = ["EXPECTED_VERDICTS", "gpu_tests", "main", "parts", "tests_from_progress", "tests_from_xml"]

EXPECTED_VERDICTS = {"fallback": {"slow_path"}, "product_default": {"healthy"}, "stock_best": {"healthy"}}
OUTCOMES = ("passed", "failure", "error", "skipped")
TIMED_OUT = (124, 137)  # `timeout` stopped the part (137: it had to be killed)


def tests_from_xml(xml: Path) -> dict[str, Any]:
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
    return {**_count(cases), "cases": cases}


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
    running = [t for t in started if t not in ended]
    return {**_count(cases), "cases": cases, "cut": True, "cut_during": running[-1] if running else None}


def _count(cases: list[dict[str, Any]]) -> dict[str, int]:
    return {k: sum(1 for c in cases if c["outcome"] == k) for k in OUTCOMES}


def _groups(results: Path) -> list[str]:
    """Test groups that left a file: ``gpu_tests.NAME.xml`` / ``.progress.jsonl`` (one per concurrent pytest
    process), or the single group ``gpu_tests.xml`` / ``gpu_tests.progress.jsonl`` (named "")."""
    names = set()
    for path in [*results.glob("gpu_tests*.xml"), *results.glob("gpu_tests*.progress.jsonl")]:
        stem = path.name.removesuffix(".xml").removesuffix(".progress.jsonl")
        names.add(stem.removeprefix("gpu_tests").removeprefix("."))
    return sorted(names)


def gpu_tests(results: Path, expected: list[str] | None = None) -> dict[str, Any]:
    """Every group's tests, merged: counts summed, cases listed, cut when any group was cut; ``expected``:
    groups acceptance.sh started or skipped (parts.jsonl), each missing one reported as missing."""
    groups = _groups(results)
    merged: dict[str, Any] = {**{k: 0 for k in OUTCOMES}, "cases": [], "groups": {}}
    for name in sorted(set(groups) | set(expected or [])):
        prefix = f"gpu_tests.{name}" if name else "gpu_tests"
        xml = results / f"{prefix}.xml"
        one = tests_from_xml(xml) if xml.exists() else tests_from_progress(results / f"{prefix}.progress.jsonl")
        merged["groups"][name or "all"] = {k: one.get(k) for k in (*OUTCOMES, "cut", "missing") if k in one}
        for k in OUTCOMES:
            merged[k] += one.get(k, 0)
        merged["cases"] += one.get("cases", [])
        if one.get("missing"):
            merged.setdefault("missing_groups", []).append(name or "all")
        if one.get("cut"):
            merged["cut"] = True
            merged.setdefault("cut_during", []).append(one.get("cut_during") or f"group {name or 'all'}")
    if not merged["groups"]:
        merged["missing"] = True
    return merged


def parts(results: Path) -> list[dict[str, Any]]:
    """acceptance.sh's timeline: one record per part (start and end in seconds from the run's start, rc, its
    limit, whether it shared the GPU), or the reason it was skipped."""
    path = results / "parts.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


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


def _not_whole(timeline: list[dict[str, Any]]) -> list[str]:
    """Parts skipped for time or stopped by their limit."""
    return [f"{p['part']} skipped ({p['skipped']})" if "skipped" in p else f"{p['part']} stopped at its "
            f"{p.get('limit_s')} s limit" for p in timeline if "skipped" in p or p.get("rc") in TIMED_OUT]


def judge(summary: dict[str, Any], partial: str | None, target_s: float | None) -> dict[str, bool]:
    """One check per claim; in a partial run a part that did not run is not held against it."""
    tests, check, diag = summary["gpu_tests"], summary["check"], summary["diagnosis"]
    verdicts = {v: (diag.get(v) or {}).get("verdict") for v in EXPECTED_VERDICTS}
    right = {v: verdicts[v] in ok or (bool(partial) and verdicts[v] is None) or (TINY() and _ran(diag.get(v)))
             for v, ok in EXPECTED_VERDICTS.items()}
    summary.update(verdicts=verdicts, verdicts_right=right)
    gpu_ok = (not tests.get("missing") and not tests.get("missing_groups") and not tests.get("cut")
              and tests["failure"] + tests["error"] == 0 and tests["passed"] > 0)
    checks = {
        "gpu_tests": gpu_ok or (bool(partial) and bool(tests.get("missing"))),
        "check_run": all(check[n].get("rc") == 0 for n in ("cold", "warm"))
        or (bool(partial) and all(check[n].get("missing") for n in ("cold", "warm"))),
        "diagnosis": all(right.values()),
        "parts_whole": not summary["not_whole"],
    }
    train = (summary["extras"].get("train_diagnosis") or {}).get("train_diagnosis")
    if train is not None or not partial:
        checks["train_no_alarm"] = bool(train and train.get("no_alarm"))
    if target_s is not None and summary["wall_s"] is not None and not partial:
        checks["wall"] = summary["wall_s"] <= target_s
    return checks


def TINY() -> bool:  # noqa: N802 - read when judged: acceptance.sh --tiny (CPU) sets ACCEPTANCE_TINY=1
    return os.environ.get("ACCEPTANCE_TINY") == "1"


def _ran(variant: dict[str, Any] | None) -> bool:
    """--tiny: a CPU run has no GPU kernels to give a verdict on; the variant must have run and timed its steps."""
    return bool(variant) and variant.get("tokens_per_s") is not None and "error" not in variant


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def main(results: Path, dest: Path) -> int:
    timeline = parts(results)
    expected = [p["part"].removeprefix("gpu_tests").removeprefix(".") for p in timeline if p.get("kind") == "tests"]
    summary: dict[str, Any] = {"check": {}, "gpu_tests": gpu_tests(results, expected), "diagnosis": bench(results),
                               "extras": extras(results), "parts": timeline, "not_whole": _not_whole(timeline),
                               "wall_s": _env_float("ACCEPTANCE_WALL_S"), "target_s": _env_float("ACCEPTANCE_TARGET_S")}
    for name in ("cold", "warm"):
        part = results / f"check_{name}.json"
        summary["check"][name] = json.loads(part.read_text()) if part.exists() else {"missing": True}
    partial = os.environ.get("ACCEPTANCE_PARTIAL")
    checks = judge(summary, partial, summary["target_s"])
    diag = summary["diagnosis"]
    product, stock = ((diag.get(v) or {}).get("tokens_per_s") for v in ("product_default", "stock_best"))
    summary.update(product_vs_stock_best=round(product / stock, 2) if product and stock else None,
                   green=all(checks.values()) and not partial, checks=checks, partial=partial)
    dest.write_text(json.dumps(summary, indent=2, default=str))
    print(summary_line(summary))
    for case in summary["gpu_tests"].get("cases", []):
        if case["outcome"] in ("failure", "error"):
            print(f"  {case['outcome']}: {case['test']} ({case['s']} s)")
    for note in summary["not_whole"]:
        print(f"  not whole: {note}")
    return 0 if all(checks.values()) else 1


def summary_line(summary: dict[str, Any]) -> str:
    checks, partial, tests = summary["checks"], summary["partial"], summary["gpu_tests"]
    head = (("PARTIAL ok" if all(checks.values()) else "PARTIAL RED") if partial
            else ("GREEN" if summary["green"] else "RED"))
    head += " (--tiny: CPU plumbing, no GPU verdicts)" if TINY() else ""
    wall, target = summary["wall_s"], summary["target_s"]
    timing = f" in {wall:.0f} s" if wall is not None else ""
    timing += f" (target {target:.0f} s{'' if checks.get('wall', True) else ': OVER'})" if target and wall else ""
    cold, warm, train = summary["check"]["cold"], summary["check"]["warm"], (
        summary["extras"].get("train_diagnosis") or {}).get("train_diagnosis")
    verdicts, right = summary["verdicts"], summary["verdicts_right"]
    return (
        f"acceptance {head}{timing}{f' ({partial})' if partial else ''}: gpu tests {tests['passed']} passed, "
        f"{tests['failure'] + tests['error']} failed, {tests['skipped']} skipped"
        f" in {len(tests['groups'])} group(s){_cut_note(tests)}; "
        f"check --run cold {cold.get('wall_s')} s (rc {cold.get('rc')}), warm {warm.get('wall_s')} s"
        f"{' on the shared GPU' if warm.get('shared_gpu') else ''} (rc {warm.get('rc')}); diagnosis "
        + ", ".join(f"{v}={verdicts[v] or 'not run'}{'' if right[v] or (partial and verdicts[v] is None) else ' (WRONG)'}"
                    for v in EXPECTED_VERDICTS)
        + f"; product {summary['product_vs_stock_best']}x stock best"
        + (f"; kernelguard train: {'no alarm' if checks.get('train_no_alarm') else 'ALARM or failure'} "
           f"({len(train.get('windows', []))} windows)" if train is not None else
           ("; kernelguard train: not run" if "train_no_alarm" in checks else ""))
        + (f"; {len(summary['not_whole'])} part(s) not whole" if summary["not_whole"] else "")
    )


def _cut_note(tests: dict[str, Any]) -> str:
    notes = []
    if tests.get("missing_groups"):
        notes.append(f"MISSING: {', '.join(tests['missing_groups'])}")
    if tests.get("cut"):
        notes.append(f"CUT by the time limit, during {'; '.join(tests['cut_during'])}")
    return f" ({'; '.join(notes)})" if notes else ""


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
