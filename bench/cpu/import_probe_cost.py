"""What the crash-safe import probe adds to `kernelguard check`, per package that ships compiled extensions.

Writes a fake causal-conv1d distribution (one .so listed in RECORD plus its package code) into a temporary
site dir, then times ``probe_package`` in fresh interpreters with KERNELGUARD_IMPORT_PROBE=off|fork|spawn.
Packages without .so files (fla) and absent packages never start a child: on the CPU CI machine the probe
costs nothing. Usage: ``python bench/cpu/import_probe_cost.py [repeats]``.
"""

from __future__ import annotations

import importlib.machinery
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TIMED = """
import time, torch
from kernelguard.resolution.catalog import PACKAGES
from kernelguard.resolution.providers.installed import probe_package
start = time.perf_counter()
found = probe_package(PACKAGES["causal_conv1d"], "causal_conv1d", "causal_conv1d_fn")
print((time.perf_counter() - start) * 1000)
"""


def _fake_site(root: Path) -> Path:
    site = root / "site"
    so = f"causal_conv1d_cuda{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    files = {
        "causal_conv1d/__init__.py": "def causal_conv1d_fn(*args, **kwargs):\n    return None\n",
        so: "not an ELF file: the import fails fast, as a wrong-torch build does\n",
    }
    for relative, text in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_text(text)
    info = site / "causal_conv1d-1.7.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: causal-conv1d\nVersion: 1.7.0\n")
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]))
    return site


def main(repeats: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        site = _fake_site(Path(tmp))
        for mode in ("off", "fork", "spawn"):
            env = {**os.environ, "PYTHONPATH": str(site), "KERNELGUARD_IMPORT_PROBE": mode}
            times = [
                float(subprocess.run([sys.executable, "-c", TIMED], env=env, capture_output=True, text=True,
                                     check=True).stdout.split()[-1])
                for _ in range(repeats)
            ]
            print(f"{mode:>5}: probe_package(causal_conv1d) median {statistics.median(times):7.1f} ms "
                  f"(min {min(times):.1f}, max {max(times):.1f}, n={repeats})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
