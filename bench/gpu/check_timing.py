#!/usr/bin/env python
"""`kernelguard check --run` timed in this process, optionally recording fla's autotune choices as pins.

    python bench/gpu/check_timing.py --out check.json [--record pins.json] [--no-pins] -- --model qwen3_5 \
        --mode training --allow fla-640-refusal

Runs ``kernelguard.cli.main(["check", ..., "--run", "--json"])`` in-process (what the console script does), so
the autotune caches fla filled are still here afterwards: ``--record`` merges them into a pins file for
``kernelguard/fla_autotune_pins.json`` (see kernelguard.resolution.fla_autotune). ``--no-pins`` ignores shipped pins (the
autotuning baseline). Writes {"wall_s", "process_s", "rc", "check": <the check JSON>, "pins_recorded": n}.
Measure cold vs warm by pointing TRITON_CACHE_DIR at an empty or a filled directory.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # after the clock: a user's CLI run pays these imports too
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--record", type=Path, help="merge this process's fla autotune choices into this pins file"
    )
    p.add_argument("--no-pins", action="store_true", help="do not apply kernelguard's shipped autotune pins")
    p.add_argument("check_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    check_args = [a for a in args.check_args if a != "--"]
    from kernelguard.resolution import fla_autotune

    if args.no_pins:
        fla_autotune.pin_for_this_gpu = lambda *a, **k: "fla autotune pins: disabled (--no-pins)"  # type: ignore[assignment]
    from kernelguard.cli import main as cli_main

    buffer = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buffer):
        rc = cli_main(["check", *check_args, "--run", "--json"])
    wall = time.perf_counter() - t0
    result = {
        "command": "kernelguard check " + " ".join([*check_args, "--run", "--json"]),
        "rc": rc,
        "wall_s": round(wall, 2),
        "process_s": round(time.perf_counter() - PROCESS_START, 2),
        "pins_disabled": args.no_pins,
    }
    try:
        result["check"] = json.loads(buffer.getvalue())
    except ValueError:
        result["check_output_tail"] = buffer.getvalue()[-4000:]
    if args.record:
        result["pins_recorded"] = record(args.record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    numerics = (result.get("check") or {}).get("numerics") or {}
    print(
        json.dumps(
            {k: result.get(k) for k in ("rc", "wall_s", "process_s", "pins_recorded")}
            | {
                "numerics_s": numerics.get("seconds"),
                "numerics_ok": numerics.get("ok"),
                "cases": len(numerics.get("cases", [])),
                "notes": numerics.get("notes"),
            }
        )
    )
    return 0


def record(path: Path) -> int:
    from kernelguard.resolution import fla_autotune

    stack = fla_autotune.current_stack()
    if stack is None:
        return 0
    entry = fla_autotune.record(stack)
    pins = fla_autotune.merge_entry(fla_autotune.load_pins(path), entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    return sum(len(rows) for rows in entry["kernels"].values())


if __name__ == "__main__":
    sys.exit(main())
