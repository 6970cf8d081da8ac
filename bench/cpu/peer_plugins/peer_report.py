"""pytest plugin (``-p peer_report``) for bench/cpu/peer_suite.py: one small JSON record per test.

Writes ``PEER_REPORT`` at session end: nodeid -> outcome (passed / failed / skipped), summed phase durations,
and for a failure its crash line plus three flags read from the full text (a KernelFallbackError from
kernelguard, a kernelguard frame in the traceback, the skip-after-fallback sentence). Loaded in every run of
the bench (plugin off and on), so its own cost is the same on both sides of each comparison.
"""

from __future__ import annotations

import json
import os
import re

_RESULTS: dict[str, dict] = {}
_KG_FRAME = re.compile(r"kernelguard/(?:\w+/)*\w+\.py")


def pytest_runtest_logreport(report):
    r = _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
    r["duration"] += report.duration
    if report.failed:
        text = str(report.longrepr)
        crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", text.splitlines()[-1] if text else "")
        r.update(outcome="failed", when=report.when, crash=crash.split("\n", 1)[0][:300],
                 kfe="KernelFallbackError: kernelguard:" in text,
                 kg_frame=bool(_KG_FRAME.search(text)),
                 skip_after="then skipped itself" in text)
        if "skip_after" in r and r["skip_after"]:
            r["message_tail"] = text[text.find("The test then skipped itself"):][:600]
    elif report.skipped and r["outcome"] == "passed":
        r["outcome"] = "skipped"


def pytest_sessionfinish(session):
    path = os.environ.get("PEER_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_RESULTS, f)
