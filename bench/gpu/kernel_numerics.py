#!/usr/bin/env python
"""Evidence for fla issue 640 on this GPU: kernel numerics at key head dim 64 and 128, JSON out, exit 0.

Steps, each isolated so one failure never hides the others:
  1. refusal      chunk_gated_delta_rule with fla as shipped (no lifting): captures fla's own refusal
                  message on Hopper + Triton 3.4-3.7.0 (or shows it passes elsewhere).
  2. lift         sets TRITON_ABOVE_3_7_1=True in fla's modules for this process (kernelguard.stack.numerics).
  3. k64          chunk_gated_delta_rule at key head dim 64 (BK = 64): expect dk/dg FAIL on the bad stack.
  4. k128         chunk_gated_delta_rule at key head dim 128: Qwen3.5's geometry (16 key / 32 value heads) +
                  a 4-head case: expect PASS (~0.5% rel error).
  5. all_kernels  every kernel (chunk, fused_recurrent fwd, causal_conv1d_fn with seq_idx, causal_conv1d_update)
                  at the key-dim-128 shapes: expect PASS.
  6. default_check_warm  run_numerics(all kernels, config=Qwen3.5) = what `check --run` runs, warm: its
                  seconds is the warm cost; K64 dk/dg failures expected on the bad stack.

  export PYTHONPATH=/tmp/site:$PWD
  python bench/gpu/kernel_numerics.py --out gpu_numerics.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))


def _step(results: dict[str, Any], name: str, fn: Any) -> Any:
    t0 = time.perf_counter()
    try:
        value = fn()
        results[name] = value if isinstance(value, dict) else {"value": value}
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        value = None
    results[name]["wall_s"] = round(time.perf_counter() - t0, 2)
    print(
        f"[gpu_numerics] {name}: {results[name].get('summary', results[name].get('error', 'done'))} "
        f"({results[name]['wall_s']} s)",
        file=sys.stderr,
        flush=True,
    )
    return value


def _summary(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    worst: dict[str, float] = {}
    for c in report.cases:
        key = f"{c.kernel} {c.tensor}"
        worst[key] = max(worst.get(key, 0.0), c.rel_error)
    d["worst_rel_error_by_tensor"] = {
        k: (v if v != float("inf") else "inf") for k, v in sorted(worst.items())
    }
    d["summary"] = (
        ("PASS" if report.ok else "FAIL") + f": {len(report.failures)}/{len(report.cases)} tensors out of "
        f"tolerance; failing tensors: {sorted({c.tensor for c in report.failures})}"
    )
    d["kernel_errors"] = [f"{c.kernel} [{c.shape}]: {c.detail}" for c in report.cases if c.tensor == "error"]
    d["render"] = report.render()
    return d


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for dist in ("triton", "transformers", "fla-core", "flash-linear-attention", "causal-conv1d", "tilelang"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        from fla.ops.common import chunk_o

        env["fla_flags"] = {
            k: getattr(chunk_o, k, None)
            for k in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
        }
    except Exception as exc:  # noqa: BLE001
        env["fla_import_error"] = f"{type(exc).__name__}: {exc}"
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("gpu_numerics.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-warm-rerun", action="store_true", help="skip the second all-kernels run")
    args = p.parse_args(argv)

    results: dict[str, Any] = {}
    try:
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        from kernelguard.stack import numerics
        from kernelguard.stack.numerics import GdnShape, run_numerics, shapes_for_model

        results["environment"] = environment()
        results["tolerance"] = {
            "rel_error": numerics.REL_TOL,
            "definition": "||kernel - ref||_2 / ||ref||_2, fp32; "
            "kernel in bf16, reference = transformers' torch function in fp32 on the same inputs",
        }
        cfg = Qwen3_5TextConfig()
        qwen = shapes_for_model(cfg, generic=False)
        generic = numerics.generic_shapes()
        k64 = [s for s in generic if s.key_dim == 64]
        k128 = qwen + [s for s in generic if s.key_dim == 128]
        chunk = ["chunk_gated_delta_rule"]
        first = [GdnShape(num_k_heads=4, num_v_heads=4, key_dim=128, value_dim=128, batch=1, seq_len=256)]
        dev = args.device

        _step(results, "refusal", lambda: _summary(run_numerics(chunk, shapes=first, device=dev)))
        _step(results, "lift", lambda: {"changed_modules": numerics.lift_fla_hopper_refusal()})
        _step(results, "k64", lambda: _summary(run_numerics(chunk, shapes=k64, device=dev)))
        _step(results, "k128", lambda: _summary(run_numerics(chunk, shapes=k128, device=dev)))
        _step(results, "all_kernels", lambda: _summary(run_numerics(numerics.KERNELS, shapes=k128, device=dev)))
        if not args.no_warm_rerun:
            # What `check --run` does for a Qwen3.5 config (model shapes + generic K64/K128), now warm: its
            # seconds is the warm cost; its K64 dk/dg failures are expected on the bad stack.
            _step(
                results,
                "default_check_warm",
                lambda: _summary(run_numerics(numerics.KERNELS, config=cfg, device=dev)),
            )
        results["verdict"] = {
            name: results.get(name, {}).get("summary", results.get(name, {}).get("error"))
            for name in ("refusal", "k64", "k128", "all_kernels", "default_check_warm")
        }
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        results["fatal"] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
    text = json.dumps(results, indent=2, default=str)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    except OSError as exc:
        print(f"[gpu_numerics] could not write {args.out}: {exc}", file=sys.stderr)
    print(json.dumps(results.get("verdict", results.get("fatal")), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
