"""Ctrl-C and SIGTERM in the first seconds of a command, at many delays, many tries each.

A signal that lands in the wrong instant of start-up (inside an import that swallows it, between the launcher
starting its ranks and watching them, while a rank's process group forms) used to be lost or to end in a
traceback. This script finds such windows by brute force: for each scenario and each delay it starts the
command, sends the signal ``delay`` seconds later and classifies how the command ended:

  clear      the signal's exit code (130 for SIGINT, 143 for SIGTERM), no traceback, and one kernelguard line
             naming the signal, followed by at most its command (the run's own progress lines may come first);
  traceback  a Python traceback, a raw KeyboardInterrupt, or a stray library message on stderr;
  noisy      the right exit code, but more than the expected lines or one that does not name the signal;
  silent     killed by the signal without a word (no handler yet: the interpreter's own start-up);
  finished   the command's own exit code (0-3): it had ended before the signal (not counted as a failure);
  wrong-code another exit code (a lost peer's error, a gate verdict: the signal was not acted on);
  hang       still running ``--hang-s`` seconds after the signal (killed).

Scenarios (``--scenarios``, comma-separated):
  check-int          `kernelguard check`, SIGINT to the process group (Ctrl-C in a terminal)
  train-int          `kernelguard train` in one process, SIGINT to the group
  train-term         the same, SIGTERM to the process alone (`kill PID`)
  launch-int         `kernelguard train --nproc-per-node 2`, SIGINT to the group (the launcher and both ranks)
  launch-term        the same, SIGTERM to the group (a scheduler stopping a job step)
  launch-term-pid    the same, SIGTERM to the launcher alone (`kill PID`): it must stop its ranks

Every run is on CPU with tests/fake_providers (the guard passes), a tiny random-init model and a long
``--max-steps`` so that no run ends before its signal. One JSON file: per scenario and delay, the counts by
class and each distinct ending (its exit code and stderr, numbers masked) with its count and first try.

    python bench/cpu/startup_signals.py --tiny                      # 2 delays x 2 tries, two scenarios
    python bench/cpu/startup_signals.py --tries 100 --jobs 14 --out bench/results/DATE/startup_signals.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import train_helpers as h

EXPECTED_CODE = {"SIGINT": 130, "SIGTERM": 143}
SCENARIOS: dict[str, tuple[str, str, bool]] = {
    # name: (command, signal, to the whole process group)
    "check-int": ("check", "SIGINT", True),
    "train-int": ("train", "SIGINT", True),
    "train-term": ("train", "SIGTERM", False),
    "launch-int": ("launch", "SIGINT", True),
    "launch-term": ("launch", "SIGTERM", True),
    "launch-term-pid": ("launch", "SIGTERM", False),
}
DEFAULT_DELAYS = "0.05,0.15,0.3,0.5,0.75,1,1.5,2,2.5,3,4,5,6"
# Where a line comes from a library rather than from kernelguard, or from a raw exception.
BAD_TEXT = ("Traceback (most recent call last)", "KeyboardInterrupt", "Error importing", "Connection reset",
            "ChildFailedError", "SignalException", "Exception ignored")
SIGNAL_WORDS = {"SIGINT": ("interrupted", "Ctrl-C"), "SIGTERM": ("SIGTERM",)}


def command(kind: str, assets: dict[str, Path], out: Path) -> list[str]:
    if kind == "check":
        return [sys.executable, "-m", "kernelguard", "check", "--model", str(assets["model"])]
    train = [sys.executable, "-m", "kernelguard", "train", "--model", str(assets["model"]), "--tokenizer",
             str(assets["tok"]), "--data", str(assets["data"]), "--output-dir", str(out), "--max-steps", "100000",
             "--max-length", "128", "--save-steps", "0", "--allow", "attention", "--no-progress"]
    return [*train, "--nproc-per-node", "2"] if kind == "launch" else train


def mask(text: str) -> str:
    """An ending's text with what differs between tries (numbers, paths, ports) masked, so endings group."""
    text = re.sub(r"/tmp/\S+", "<path>", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)


def classify(sig: str, code: int | None, err: str) -> str:
    if code is None:
        return "hang"
    if any(bad in err for bad in BAD_TEXT):
        return "traceback"
    if code in (0, 1, 2, 3):  # the command's own verdict: it had ended before the signal could matter
        return "finished"
    if code == -getattr(signal, sig) and not err.strip():
        return "silent"  # killed by the signal before any handler existed (the interpreter's own start-up)
    if code != EXPECTED_CODE[sig]:
        return "wrong-code"
    # The run's own lines (data, packing, the guard's table) may come first; the ending is the lines from the
    # first that names the signal: exactly one such line (not one per rank), and nothing but its command after.
    lines = [line for line in err.splitlines() if line.strip()]
    naming = [i for i, line in enumerate(lines) if line.startswith("kernelguard")
              and any(word in line for word in SIGNAL_WORDS[sig])]
    if len(naming) != 1 or len(lines) - naming[0] > 2:
        return "noisy"
    return "clear"


def one_try(scenario: str, delay: float, index: int, assets: dict[str, Path], work: Path, hang_s: float,
            env: dict[str, str]) -> dict[str, Any]:
    kind, sig, group = SCENARIOS[scenario]
    out = work / f"{scenario}-{delay}-{index}"
    p = subprocess.Popen(command(kind, assets, out), env=env, cwd=work, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         # a new session ignores nothing, and SIGINT acts as in a terminal's foreground job
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    time.sleep(delay)
    if p.poll() is None:
        (os.killpg if group else os.kill)(p.pid, getattr(signal, sig))
    try:
        _, err = p.communicate(timeout=hang_s)
        code: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        code = None
    finally:
        # ranks a broken launcher left behind would skew every later try
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {"scenario": scenario, "delay": delay, "try": index, "code": code, "class": classify(sig, code, err),
            "stderr": err[-4000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--delays", default=DEFAULT_DELAYS, help="seconds after the start, comma-separated")
    ap.add_argument("--tries", type=int, default=100, help="tries per scenario and delay")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="tries at once (a launch counts as three processes)")
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting tries after this many seconds (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="2 delays x 2 tries of check-int and launch-int")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="add up these result files (runs of the same scenarios and delays) into --out instead")
    args = ap.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    if args.tiny:
        args.scenarios, args.delays, args.tries = "check-int,launch-int", "0.3,2", 2
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"--scenarios: {s!r} is not one of {', '.join(SCENARIOS)}")
    delays = [float(d) for d in args.delays.split(",")]

    work = Path(tempfile.mkdtemp(prefix="kg-signals-"))
    assets = h.write_train_assets(work / "assets", rows=400)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(h.FAKE_PROVIDERS)]))
    env.pop("COLUMNS", None)
    # try by try over every scenario and delay: a run cut by --budget-s leaves every cell with as many tries
    tasks = [(s, d, i) for i in range(args.tries) for d in delays for s in scenarios]
    started = time.time()
    results: list[dict[str, Any]] = []
    skipped = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        pending: set[concurrent.futures.Future[dict[str, Any]]] = set()
        for task in tasks:
            if args.budget_s and time.time() - started > args.budget_s:
                skipped += 1
                continue
            while len(pending) >= args.jobs:
                done, pending = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
                results.extend(f.result() for f in done)
            pending.add(pool.submit(one_try, *task, assets, work, args.hang_s, env))
        results.extend(f.result() for f in concurrent.futures.as_completed(pending))
    wall = time.time() - started

    summary: dict[str, Any] = {}
    for s in scenarios:
        per_delay = {}
        for d in delays:
            rows = [r for r in results if r["scenario"] == s and r["delay"] == d]
            endings: dict[tuple[Any, str], dict[str, Any]] = {}
            for r in sorted(rows, key=lambda r: r["try"]):
                key = (r["code"], mask(r["stderr"].strip()))
                e = endings.setdefault(key, {"code": r["code"], "class": r["class"], "stderr": r["stderr"].strip(),
                                             "count": 0, "first_try": r["try"]})
                e["count"] += 1
            per_delay[str(d)] = {"tries": len(rows), **collections.Counter(r["class"] for r in rows),
                                 "endings": sorted(endings.values(), key=lambda e: -e["count"])}
        summary[s] = per_delay
    not_clear = sum(r["class"] not in ("clear", "finished") for r in results)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} cores)",
              "python": platform.python_version(), "versions": versions(), "args": vars(args) | {"out": str(args.out)},
              "wall_s": round(wall, 1), "tries": len(results), "not_clear": not_clear, "skipped_for_budget": skipped,
              "scenarios": summary}
    for s, per_delay in summary.items():
        cells = "  ".join(f"{d}s:{v.get('clear', 0) + v.get('finished', 0)}/{v['tries']}" for d, v in per_delay.items())
        print(f"{s:16} {cells}")
    classes = collections.Counter(r["class"] for r in results)
    print(f"{len(results)} tries, {not_clear} not clear ({dict(classes)}), {skipped} skipped for budget, {wall:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if not_clear else 0


def merge(files: list[Path], out: Path | None) -> int:
    """One report from several runs (e.g. two calls on a machine lent for ten minutes at a time)."""
    reports = [json.loads(f.read_text()) for f in files]
    total = dict(reports[0], merged_from=[str(f) for f in files], wall_s=sum(r["wall_s"] for r in reports),
                 tries=sum(r["tries"] for r in reports), not_clear=sum(r["not_clear"] for r in reports),
                 skipped_for_budget=sum(r["skipped_for_budget"] for r in reports), scenarios={})
    for report in reports:
        for s, per_delay in report["scenarios"].items():
            for d, cell in per_delay.items():
                into = total["scenarios"].setdefault(s, {}).setdefault(d, {"tries": 0, "endings": []})
                for key, value in cell.items():
                    if key not in ("endings", "tries"):
                        into[key] = into.get(key, 0) + value
                into["tries"] += cell["tries"]
                for e in cell["endings"]:
                    same = next((x for x in into["endings"] if (x["code"], mask(x["stderr"])) == (e["code"], mask(e["stderr"]))), None)
                    if same is None:
                        into["endings"].append(dict(e))
                    else:
                        same["count"] += e["count"]
    for s, per_delay in total["scenarios"].items():
        cells = "  ".join(f"{d}s:{v.get('clear', 0) + v.get('finished', 0)}/{v['tries']}" for d, v in per_delay.items())
        print(f"{s:16} {cells}")
    print(f"{total['tries']} tries, {total['not_clear']} not clear")
    if out:
        out.write_text(json.dumps(total, indent=1) + "\n")
    return 1 if total["not_clear"] else 0


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "huggingface_hub", "kernels"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


if __name__ == "__main__":
    sys.exit(main())
