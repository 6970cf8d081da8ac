#!/usr/bin/env python
"""One `kernelguard train` start, in this process, then what fla autotuned: issue 49's start to the first step.

    python bench/gpu/start_time.py --out run.json [--record pins.json] -- TRAIN ARGS...

Runs the trainer's own ``main`` through bench/gpu/sharded_load_timing.py's ``train`` (the end-of-run checkpoint
skipped: fp32 weights and AdamW's state at 27B widths are tens of GB the start does not need), then, in the same
process, reads fla's autotune caches: the kernel shapes that were searched for lack of a shipped pin
(``searched``), and with ``--record`` merges every choice made into a pins file (the shipped one's format,
``kernelguard/resolution/fla_autotune_pins.json``). Writes {"rc", "searched", "pins_recorded", "wall_s"}.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # after the clock: a user's run pays these imports too
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(1, str(ROOT / "bench" / "gpu"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--record", type=Path, help="merge this process's fla autotune choices into this pins file")
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    from sharded_load_timing import train

    rc: int | None
    try:
        rc = train([a for a in args.train_args if a != "--"])
    except SystemExit as exc:  # the trainer's own exit (a refusal): its code is the figure
        rc = exc.code if isinstance(exc.code, int) else 1
    result: dict[str, object] = {"rc": rc, "wall_s": round(time.perf_counter() - PROCESS_START, 1)}
    result.update(autotune_state(args.record))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v if k != "searched" else len(v) for k, v in result.items()}), flush=True)  # type: ignore[arg-type]
    return 0


def autotune_state(record: Path | None) -> dict[str, object]:
    """The searched shapes against the shipped pins, and the recorded pins (CUDA, Triton and fla only)."""
    from kernelguard.resolution import fla_autotune

    stack = fla_autotune.current_stack()
    if stack is None:
        return {"searched": [], "pins_recorded": None, "stack": None}
    shipped = fla_autotune.entry_for(stack, fla_autotune.load_pins())
    out: dict[str, object] = {
        "searched": fla_autotune.searched_after_pinning(shipped),
        "stack": stack.to_dict(),
        "pins_recorded": None,
    }
    if record is not None:
        entry = fla_autotune.record(stack)
        merged = fla_autotune.merge_entry(fla_autotune.load_pins(record), entry)
        record.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        out["pins_recorded"] = sum(len(rows) for rows in entry["kernels"].values())
    return out


if __name__ == "__main__":
    sys.exit(main())
