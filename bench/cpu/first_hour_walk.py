"""The first hour of a new user, re-walked as README.md and docs/train.md say, with each step's wall time.

From a fresh clone (``--clone``: made here from this checkout's HEAD) it runs the README's set-up + check
command, then docs/train.md's "A first run on CPU" line by line: the tokenizer, the data, the tiny config, a
training run stopped by Ctrl-C once step 6's checkpoint is complete, the resume line the run printed (pasted
as printed), a chat from ``run/final``, an export of a checkpoint and a chat from it. Then the common mistakes,
each three times: every refusal's exit code, wall time and first line. One JSON file and a Markdown table.

    python bench/cpu/first_hour_walk.py --out bench/results/DATE/first_hour_walk.json
    python bench/cpu/first_hour_walk.py --venv /work/main/.venv --skip-install --out ...   # reuse a venv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS: list[dict[str, Any]] = []


def run(name: str, command: str, cwd: Path, env: dict[str, str], *, timeout: int = 1800) -> dict[str, Any]:
    start = time.time()
    p = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    step = {"step": name, "command": command, "code": p.returncode, "wall_s": round(time.time() - start, 2),
            "stdout_tail": p.stdout[-1500:], "stderr_tail": p.stderr[-1500:]}
    STEPS.append(step)
    print(f"{name}: exit {p.returncode}, {step['wall_s']} s", flush=True)
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--venv", type=Path, default=None, help="an existing venv (with --skip-install)")
    ap.add_argument("--skip-install", action="store_true")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kg-walk-"))
    clone = work / "kernelguard"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KERNELGUARD"))}
    readme = (clone / "README.md").read_text()
    setup = next(line for line in readme.splitlines() if line.startswith("python3 -m venv .venv") and "check" in line)
    if args.skip_install:
        assert args.venv is not None, "--skip-install needs --venv"
        (clone / ".venv").symlink_to(args.venv)
        setup = setup.split(" && ")[-1]  # the check alone
    run("README: set up + kernelguard check" if not args.skip_install else "README: kernelguard check", setup,
        clone, env)
    venv_bin = str((clone / ".venv" / "bin").resolve())
    env["PATH"] = venv_bin + os.pathsep + env["PATH"]  # `source .venv/bin/activate`, as a user would

    doc = (clone / "docs" / "train.md").read_text()
    block = doc.split("## A first run on CPU", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    tok, data, config, train, resume_doc, chat = lines[:6]
    for name, line in [("docs: tokenizer", tok), ("docs: data", data), ("docs: tiny config", config)]:
        run(name, line.replace("python ", "python3 ", 1), clone, env)

    # the training run, stopped with Ctrl-C once step 6's checkpoint is complete
    start = time.time()
    p = subprocess.Popen(["bash", "-c", f"exec {train}"], cwd=clone, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    marker = clone / "run" / "checkpoints" / "step_6" / "COMPLETE"
    while p.poll() is None and not marker.exists() and time.time() - start < 1800:
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=300)
    STEPS.append({"step": "docs: train, Ctrl-C after step 6's checkpoint", "command": train, "code": p.returncode,
                  "wall_s": round(time.time() - start, 2), "stderr_tail": err[-2500:]})
    print(f"train + Ctrl-C: exit {p.returncode}, {STEPS[-1]['wall_s']} s", flush=True)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", err)]
    printed = err.split("Continue exactly from it with:\n", 1)[-1].strip()
    resume = printed.replace(" \\\n", " ")
    STEPS[-1]["printed_resume"] = printed
    STEPS[-1]["resume_matches_docs"] = shlex.split(resume) == shlex.split(resume_doc)
    step = run("the printed resume line, pasted", resume, clone, env)
    step["losses_before"] = losses
    step["losses_after"] = [float(x) for x in re.findall(r"loss (\d+\.\d+)", step["stderr_tail"])]
    run("docs: chat with run/final", chat.replace("python ", "python3 ", 1), clone, env)
    run("kernelguard export run/checkpoints/step_9", "kernelguard export run/checkpoints/step_9 --output exported",
        clone, env)
    run("chat with the export", chat.replace("python ", "python3 ", 1).replace("run/final", "exported"), clone, env)

    base = ("kernelguard train --model tiny/config.json --tokenizer tok --data chitchat.jsonl --max-length 256 "
            "--max-steps 12 --packing none --allow causal_conv1d_fn chunk_gated_delta_rule")
    mistakes = [
        ("--data with a typo in its extension", f"{base.replace('chitchat.jsonl', 'chitchat.jsnol')} --output-dir r2"),
        ("--output-dir holding a run", f"{base} --output-dir run"),
        ("a misspelt flag (--packng)", f"{base} --output-dir r2 --packng none"),
        ("a misspelt kernel name (--allow causal_conv1d)", f"{base} --output-dir r2 --allow causal_conv1d"),
        ("--master-port out of range", f"{base} --output-dir r2 --nproc-per-node 2 --master-port 99999"),
        ("--output-dir under a file", f"{base} --output-dir chitchat.jsonl/out"),
        ("export of a step that does not exist", "kernelguard export run/checkpoints/step_7 --output e2"),
        ("check with a model name typo", "kernelguard check --model qwen3_55"),
    ]
    for name, command in mistakes:
        for i in range(3):
            step = run(f"refusal: {name} ({i + 1})", command, clone, env, timeout=120)
            step["first_line"] = next((line for line in step["stderr_tail"].splitlines() if line.strip()), "")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "clone": str(clone),
                                    "head": subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=False,
                                                           capture_output=True, text=True).stdout.strip(),
                                    "steps": STEPS}, indent=1) + "\n")
    print("\n| step | exit | wall |\n|---|---|---|")
    for s in STEPS:
        print(f"| {s['step']} | {s['code']} | {s['wall_s']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
