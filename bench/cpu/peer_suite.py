"""Issue 23's peer-suite figures: transformers' own qwen3_next / qwen3_5 / qwen3_5_moe test suites under the plugin.

    PYTHONPATH=. python bench/cpu/peer_suite.py --git-dir /work/.mirror/zucchini-nlp+transformers/repo \
        --commit decba1d2ea --tests-dir /tmp/peer-tests --out bench/results/2026-12-01-cpu-peer/peer_suite.json

Exports ``tests/`` (and ``utils/``, the root conftest and pyproject) of the mirror's commit into ``--tests-dir``
(once), links ``src/transformers`` there to the installed package (the pipeline tests read it by path), and runs
the three model folders with ``-p no:cacheprovider -q``, no xdist, one pytest process per run, in this order:

- ``count``: plugin off, ``bench/cpu/peer_plugins/peer_count.py`` records which tests entered a torch reference
  (the ground truth, independent of kernelguard);
- then ``--repeats`` times, interleaved: ``off`` (plugin off), ``allowed`` (``--kernelguard`` with the CPU-CI
  recipe of docs/pytest.md: every GDN kernel allowed), and once ``strict`` (``--kernelguard``, nothing allowed).

On a shared 2-core machine one run of the whole suite takes ~30 min, so the figures of issue 23 were measured
as one ``--order strict_count`` run of the whole suite (ground truth and the plugin in one process) plus
``--order off allowed --simultaneous`` pairs per folder (both runs of a pair start together, so they see the
same load; CPU time is each process's own), then ``peer_suite.py combine OUT STRICT.json PAIR.json...``.

``--fake-providers``: every run also finds kernelguard's CPU stand-ins for fla and causal-conv1d
(``tests/fake_providers``), so transformers takes its fast path: ``--order off strict --simultaneous
--fake-providers`` then lists every test that fails under ``--kernelguard`` and not without it
(``kernelguard_failures``, with each crash line): issue 51's "with the fake providers: no kernelguard failure".

Every run loads ``peer_compat`` (version-skew shims: the mirror's helpers import a few names the installed
transformers lacks; see that file) and ``peer_report`` (one JSON record per test). Wall time and the child's
CPU time (user + sys) are measured around each pytest process; the load average is read before each. Writes
one JSON (per-run totals, the classified test lists; no logs) and prints a summary. Tests that fail in the
plugin-off runs are the version-skew baseline and are left out of every comparison.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "peer_plugins"
FAKE_PROVIDERS = ROOT / "tests" / "fake_providers"
FOLDERS = ("tests/models/qwen3_next", "tests/models/qwen3_5", "tests/models/qwen3_5_moe")
# docs/pytest.md's CPU-CI recipe, with the decode kernels its note says to add when the suite generates.
CPU_CI_ALLOW = ("causal_conv1d_fn", "chunk_gated_delta_rule", "causal_conv1d_update",
                "fused_recurrent_gated_delta_rule")
MODES = {
    "count": ["-p", "peer_count"],
    "off": [],
    "allowed": ["--kernelguard"] + [a for k in CPU_CI_ALLOW for a in ("--kernelguard-allow", k)],
    "strict": ["--kernelguard"],
    "strict_count": ["--kernelguard", "-p", "peer_count"],  # both in one process (see peer_count's docstring)
}


def export(git_dir: str, commit: str, dest: Path) -> None:
    if not (dest / "tests").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit, "tests", "utils", "conftest.py",
                                  "pyproject.toml"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    tu = dest / ".peer" / "testing_utils_mirror.py"
    tu.parent.mkdir(exist_ok=True)
    tu.write_bytes(subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:src/transformers/testing_utils.py"],
                                  check=True, capture_output=True).stdout)
    import transformers  # noqa: PLC0415 - the installed one, whose package the pipeline tests read by path

    link = dest / "src" / "transformers"
    link.parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(Path(transformers.__file__).parent)


def run(mode: str, tests_dir: Path, work: Path, index: int, extra: list[str], folders: list[str],
        fakes: bool = False) -> dict:
    report, count, log = (work / f"{index}-{mode}.{n}" for n in ("report.json", "count.json", "log"))
    paths = [str(ROOT), str(PLUGINS), *([str(FAKE_PROVIDERS)] if fakes else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="2",
               PEER_REPORT=str(report), PEER_COUNT=str(count),
               PEER_MIRROR_TESTING_UTILS=str(tests_dir / ".peer" / "testing_utils_mirror.py"))
    env.pop("CI", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "peer_compat", "-p", "peer_report",
           *MODES[mode], *extra, *folders]
    load = os.getloadavg()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own CPU time, also when runs are simultaneous
        child.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    cpu = usage.ru_utime + usage.ru_stime
    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
    results = json.loads(report.read_text())
    out = {"mode": mode, "index": index, "rc": rc, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
           "load_before": [round(x, 2) for x in load], "summary_line": tail[0] if tail else "",
           "outcomes": dict(collections.Counter(r["outcome"] for r in results.values())),
           "tests": results, "command": " ".join(cmd[1:])}
    if mode in ("count", "strict_count"):
        out["count"] = json.loads(count.read_text())
    print(f"[{index}] {mode:8s} wall {wall:7.1f} s  cpu {cpu:7.1f} s  load {load[0]:.2f}  {out['outcomes']}",
          flush=True)
    return out


def kernelguard_failures(runs: list[dict]) -> dict:
    """Tests that fail with kernelguard on and pass (or skip) with it off, with their crash lines: each is a
    kernelguard failure, since no run calls a torch reference when the stand-ins serve every kernel."""
    off = [r for r in runs if r["mode"] == "off"]
    on = [r for r in runs if r["mode"] != "off"]
    skew = {t for r in off for t, v in r["tests"].items() if v["outcome"] == "failed"}
    failures = {f"{r['index']}-{r['mode']}": {t: v.get("crash", "") for t, v in sorted(r["tests"].items())
                                              if v["outcome"] == "failed" and t not in skew} for r in on}
    return {"outcomes_per_run": {f"{r['index']}-{r['mode']}": r["outcomes"] for r in runs},
            "version_skew_failures": len(skew), "kernelguard_failure_count": {k: len(v) for k, v in failures.items()},
            "kernelguard_failures": failures}


def _reference_calls(calls: dict[str, int]) -> bool:
    return any(".models.qwen3" in name for name in calls)  # the three suites' own modules (and nothing else ran)


def classify(runs: list[dict]) -> dict:
    """The figures of issue 23 from the runs (see the module docstring for what each run is)."""
    by_mode: dict[str, list[dict]] = collections.defaultdict(list)
    for r in runs:
        by_mode[r["mode"]].append(r)
    counted = (by_mode["count"] + by_mode["strict_count"])[0]
    strict_run = (by_mode["strict"] + by_mode["strict_count"])[0]
    off = by_mode["off"]
    tests = sorted(counted["tests"])
    skew = sorted({t for r in off + by_mode["count"] for t, v in r["tests"].items() if v["outcome"] == "failed"})
    compared = [t for t in tests if t not in skew]
    calls = counted["count"]["calls"]
    truth = {t for t in compared if _reference_calls(calls.get(t, {}))}
    strict = strict_run["tests"]
    failed_kfe = {t for t in compared if strict.get(t, {}).get("outcome") == "failed" and strict[t].get("kfe")}
    other_fail = {t for t in compared if strict.get(t, {}).get("outcome") == "failed" and not strict[t].get("kfe")}
    changed = _changed(by_mode["allowed"], compared, off)
    crashes = sorted(t for t in other_fail | changed
                     if any(r["tests"].get(t, {}).get("kg_frame") for r in [strict_run] + by_mode["allowed"]))
    skip_after = sorted(t for t in failed_kfe if strict[t].get("skip_after"))
    return {
        "tests_collected": len(tests), "outcomes_per_run": {f"{r['index']}-{r['mode']}": r["outcomes"] for r in runs},
        "version_skew_failures": skew, "tests_compared": len(compared),
        "tests_entering_a_torch_reference": len(truth), "reference_tests": sorted(truth),
        "failed_with_KernelFallbackError": len(failed_kfe),
        "false_positives": sorted(failed_kfe - truth), "false_negatives": sorted(truth - failed_kfe),
        "strict_other_failures": {t: strict[t].get("crash", "") for t in sorted(other_fail)},
        "crashes_with_kernelguard_frames": crashes, "allowed_outcome_changes": sorted(changed),
        "skip_after_fallback": skip_after,
        "skip_after_fallback_message": strict[skip_after[0]].get("message_tail", "") if skip_after else "",
        "timing": _timing(off, by_mode["allowed"], truth, compared) if off and by_mode["allowed"] else {},
    }


def _changed(allowed: list[dict], compared: list[str], off: list[dict]) -> set[str]:
    if not off:
        return set()
    return {t for r in allowed for t in compared if r["tests"].get(t, {}).get("outcome") == "failed"
            and off[0]["tests"].get(t, {}).get("outcome") not in (None, "failed")}


def _timing(off: list[dict], allowed: list[dict], truth: set[str], compared: list[str]) -> dict:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    quiet = [t for t in compared if t not in truth]  # tests that call no torch reference
    def per_test(runs: list[dict], names: list[str]) -> float:
        return mean([sum(r["tests"][t]["duration"] for t in names if t in r["tests"]) for r in runs])

    out = {"wall_s": {"off": [r["wall_s"] for r in off], "allowed": [r["wall_s"] for r in allowed]},
           "cpu_s": {"off": [r["cpu_s"] for r in off], "allowed": [r["cpu_s"] for r in allowed]}}
    for key in ("wall_s", "cpu_s"):
        a, c = mean(out[key]["off"]), mean(out[key]["allowed"])
        out[f"{key}_overhead_pct"] = round(100 * (c - a) / a, 2)
        out[f"{key}_pairs_overhead_pct"] = [round(100 * (c1 - a1) / a1, 2)
                                            for a1, c1 in zip(out[key]["off"], out[key]["allowed"])]
    out["per_test_ms_all"] = round(1000 * (mean(out["wall_s"]["allowed"]) - mean(out["wall_s"]["off"]))
                                   / len(compared), 3)
    out["per_test_ms_all_cpu"] = round(1000 * (mean(out["cpu_s"]["allowed"]) - mean(out["cpu_s"]["off"]))
                                       / len(compared), 3)
    out["no_reference_tests"] = len(quiet)
    out["per_test_ms_no_reference"] = round(1000 * (per_test(allowed, quiet) - per_test(off, quiet)) / len(quiet), 3)
    if truth:
        out["per_test_ms_reference"] = round(1000 * (per_test(allowed, sorted(truth)) - per_test(off, sorted(truth)))
                                             / len(truth), 3)
    return out


def combine(strict_path: Path, timing_paths: list[Path]) -> dict:
    """One strict run of the whole suite plus plugin-off / allowed pairs that cover it folder by folder (what
    fits a shared 2-core machine): the version-skew baseline is every test failing plugin-off, removed from the
    strict run's figures; the overhead is summed over the pairs."""
    strict = json.loads(strict_path.read_text())
    pairs = [json.loads(p.read_text()) for p in timing_paths]
    offs = [r for d in pairs for r in d["runs"] if r["mode"] == "off"]
    alloweds = [r for d in pairs for r in d["runs"] if r["mode"] == "allowed"]
    skew = sorted({t for r in offs for t, v in r["tests"].items() if v["outcome"] == "failed"})
    f = strict["figures"]
    truth = set(f["reference_tests"])
    kfe = truth - set(f["false_negatives"]) | set(f["false_positives"])
    off_tests = {t for r in offs for t in r["tests"]}
    wall_off, wall_on = sum(r["wall_s"] for r in offs), sum(r["wall_s"] for r in alloweds)
    cpu_off, cpu_on = sum(r["cpu_s"] for r in offs), sum(r["cpu_s"] for r in alloweds)
    n = len(off_tests)
    return {
        "tests_collected": f["tests_collected"], "baseline_covered": n, "version_skew_failures": skew,
        "tests_compared": f["tests_collected"] - len(skew),
        "tests_entering_a_torch_reference": len(truth - set(skew)),
        "failed_with_KernelFallbackError": len(kfe - set(skew)),
        "reference_tests_also_failing_without_the_plugin": sorted(truth & set(skew)),
        "false_positives": sorted(set(f["false_positives"]) - set(skew)),
        "false_negatives": sorted(set(f["false_negatives"]) - set(skew)),
        "strict_other_failures_not_in_baseline": sorted(set(f["strict_other_failures"]) - set(skew)),
        "crashes_with_kernelguard_frames": f["crashes_with_kernelguard_frames"],
        "allowed_outcome_changes": sorted({t for d in pairs for t in d["figures"].get("allowed_outcome_changes", [])}
                                          | {t for a in alloweds for t, v in a["tests"].items()
                                             if v["outcome"] == "failed" and t not in skew}),
        "skip_after_fallback": f["skip_after_fallback"], "skip_after_fallback_message": f["skip_after_fallback_message"],
        "overhead_all_allowed": {
            "pairs": [{"folders": d["meta"]["folders"], **d["figures"]["timing"]} for d in pairs],
            "wall_s_off": round(wall_off, 2), "wall_s_allowed": round(wall_on, 2),
            "wall_pct": round(100 * (wall_on - wall_off) / wall_off, 2),
            "cpu_s_off": round(cpu_off, 2), "cpu_s_allowed": round(cpu_on, 2),
            "cpu_pct": round(100 * (cpu_on - cpu_off) / cpu_off, 2),
            "per_test_ms_wall": round(1000 * (wall_on - wall_off) / n, 3),
            "per_test_ms_cpu": round(1000 * (cpu_on - cpu_off) / n, 3)},
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["combine"]:  # combine OUT STRICT.json TIMING.json...
        out, strict, *timing = (Path(x) for x in argv[1:])
        figures = combine(strict, timing)
        out.write_text(json.dumps({"inputs": [str(strict), *map(str, timing)], "figures": figures}, indent=1))
        print(json.dumps({k: (len(v) if isinstance(v, list) else v) for k, v in figures.items()
                          if k not in ("skip_after_fallback_message",)}, indent=1))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--git-dir", required=True, help="bare git dir of a transformers mirror")
    p.add_argument("--commit", required=True)
    p.add_argument("--tests-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repeats", type=int, default=2, help="off / allowed pairs (interleaved)")
    p.add_argument("--order", nargs="+", choices=sorted(MODES), default=None,
                   help="the runs, in order (default: count off allowed strict, then off allowed per repeat)")
    p.add_argument("--folders", nargs="+", default=list(FOLDERS))
    p.add_argument("--simultaneous", action="store_true",
                   help="start the runs of --order together (A/B under the same load) instead of one by one")
    p.add_argument("--fake-providers", action="store_true",
                   help="every run finds tests/fake_providers (fla, causal-conv1d stand-ins): the fast path")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k, for a quick try of the bench itself")
    a = p.parse_args(argv)
    export(a.git_dir, a.commit, a.tests_dir)
    extra = ["-k", a.keyword] if a.keyword else []
    order = a.order or ["count", "off", "allowed", "strict"] + ["off", "allowed"] * (a.repeats - 1)
    with tempfile.TemporaryDirectory(prefix="peer-suite-") as tmp:
        if a.simultaneous:  # every run at once: each sees the same machine load (CPU time is per process)
            with concurrent.futures.ThreadPoolExecutor(len(order)) as pool:
                runs = list(pool.map(lambda im: run(im[1], a.tests_dir, Path(tmp), im[0], extra, a.folders, a.fake_providers),
                                     enumerate(order)))
        else:
            runs = [run(mode, a.tests_dir, Path(tmp), i, extra, a.folders, a.fake_providers)
                    for i, mode in enumerate(order)]
    if a.fake_providers:
        figures = kernelguard_failures(runs)
    elif any(r["mode"] in ("count", "strict_count") for r in runs):
        figures = classify(runs)
    else:
        figures = {
        "outcomes_per_run": {f"{r['index']}-{r['mode']}": r["outcomes"] for r in runs},
        "timing": _timing([r for r in runs if r["mode"] == "off"], [r for r in runs if r["mode"] == "allowed"],
                          set(), sorted(t for t, v in runs[0]["tests"].items() if v["outcome"] != "failed"))}
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    meta = {"date": time.strftime("%Y-%m-%d"), "fake_providers": a.fake_providers, "machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared)",
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "mirror": a.git_dir, "commit": a.commit, "folders": a.folders, "k": a.keyword, "order": order, "allow": CPU_CI_ALLOW,
            "kernelguard_commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip()}
    for r in runs:  # keep per-test records of the compared runs small: outcome and duration only
        r["tests"] = {t: {"outcome": v["outcome"], "duration": round(v["duration"], 4)} for t, v in r["tests"].items()}
        r.pop("count", None)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "figures": figures, "runs": runs}, indent=1))
    summary = {k: (len(v) if isinstance(v, (list, dict)) and k != "outcomes_per_run" else v)
               for k, v in figures.items() if k not in ("timing", "skip_after_fallback_message")}
    print(json.dumps(summary, indent=1))
    print(json.dumps(figures.get("timing"), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
