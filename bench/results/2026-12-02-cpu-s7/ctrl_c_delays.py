"""Ctrl-C (SIGINT to the process group) N seconds into `kernelguard train --nproc-per-node 2`, for each N given;
prints the exit code and last line, and where the interrupt was raised when the run went on anyway (exit 0).
Run from the repository root: python bench/results/2026-12-02-cpu-s7/ctrl_c_delays.py 0.3 0.65 1.0"""
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
import train_helpers as h

HOOK = """import os, signal, traceback
def _h(signum, frame):
    with open(os.environ["SIGSTACK"] + f".{os.getpid()}", "a") as f:
        f.write("".join(traceback.format_stack(frame)))
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, _h)
"""
work = Path(tempfile.mkdtemp(prefix="kg-ctrl-c-"))
(work / "hook").mkdir()
(work / "hook" / "sitecustomize.py").write_text(HOOK)
assets = h.write_train_assets(work / "assets", rows=40)
for delay in [float(x) for x in sys.argv[1:]]:
    out, stack = work / f"out{delay}", str(work / f"stack{delay}")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", SIGSTACK=stack,
               PYTHONPATH=os.pathsep.join([str(work / "hook"), str(h.REPO), str(h.FAKE_PROVIDERS)]))
    argv = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(out), "--max-steps", "2", "--max-length", "128", "--allow", "attention", "--no-progress"]
    p = subprocess.Popen([sys.executable, "-m", "kernelguard", "train", "--nproc-per-node", "2", *argv], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=180)
    print(delay, p.returncode, err.strip().splitlines()[-1:], flush=True)
    if p.returncode == 0:
        for f in glob.glob(stack + "*"):
            print(open(f).read())
