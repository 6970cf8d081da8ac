"""Where does fla issue 640 bite on this GPU? A GPU probe of fla's gated chunk backward, by numbers.

fla 0.6.0 refuses the gated backward on Hopper with Triton 3.4-3.7.0 (``chunk_bwd_dqkwg``, fla issue 640).
Upstream bisected the miscompile to the key-dim tile of that kernel: ``CONST_TILING`` 64 -> BK 64 fails,
32 and 128 pass. fla picks ``BK = min(next_pow2(K), CONST_TILING)`` with ``CONST_TILING = 128`` on any GPU
with Hopper-sized shared memory, so on an H100/H200 the tile is 64 only for key head dims 33-64, where it is
also the whole key dim (one K block).

This probe lifts the refusal (``numerics.lift_fla_hopper_refusal``) and compares fla in bf16 against
transformers' fp32 torch reference for:

* the stock tiling at key head dim 64 and 128;
* a forced tile: ``CONST_TILING`` 64 (BK 64, two K blocks at K 128) and 32 (four blocks), by making
  ``fla.ops.common.chunk_o.check_shared_mem`` report Ampere-/Ada-sized shared memory for that module only;
* the input recipe of fla's own test in the issue (``torch.rand`` q/k/v, l2-normalised outside the kernel,
  ``logsigmoid(rand) / 10`` decay, an fp32 initial state, B2 T1500 - not a multiple of the 64-token chunk).

Every case goes through ``kernelguard.stack.numerics``'s comparator and threshold (relative L2 error vs the fp32
reference, 2%), so a failure here is exactly what ``kernelguard check --run`` would report. One JSON line per
case is appended to ``--out`` as soon as it is measured (a device time limit keeps the finished ones).

Run on the GPU machine: ``python3 bench/gpu/fla640_probe.py --out $OUT/fla640_probe.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CASES = (
    # name, tiling, key dim, value dim, dtype, recipe
    ("forced64-K128-issue", 64, 128, 128, "bfloat16", "issue"),
    ("forced64-K128-kernelguard", 64, 128, 128, "bfloat16", "kernelguard"),
    ("stock-K64-issue", None, 64, 64, "bfloat16", "issue"),
    ("stock-K64-V128-issue", None, 64, 128, "bfloat16", "issue"),
    ("stock-K128-issue", None, 128, 128, "bfloat16", "issue"),
    ("forced32-K128-issue", 32, 128, 128, "bfloat16", "issue"),
    ("forced64-K64-issue", 64, 64, 64, "bfloat16", "issue"),
    ("stock-K64-issue-fp16", None, 64, 64, "float16", "issue"),
    ("forced64-K128-issue-fp16", 64, 128, 128, "float16", "issue"),
)
BATCH, SEQ, HEADS = 2, 1500, 4
DEVICE = "cuda"


def force_tiling(tiling: int | None) -> None:
    """Make fla's chunk_o launchers pick ``CONST_TILING = tiling`` (None: restore the real check)."""
    from fla.ops.common import chunk_o
    from fla.utils import check_shared_mem

    if tiling is None:
        chunk_o.check_shared_mem = check_shared_mem
        return
    # The launchers test 'hopper', then 'ampere' (128 for 16-bit inputs, else 64), then 'ada' (64), else 32.
    answers = {64: {"ada"}, 32: set()}[tiling]
    chunk_o.check_shared_mem = lambda arch="none", tensor_idx=0: arch in answers


def issue_recipe_case(name: str, kd: int, vd: int, dtype_name: str, tol: float) -> list[Any]:
    """fla's test_chunk inputs from issue 640 (q/k/v uniform, normalised outside, weak decay, h0)."""
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from kernelguard.stack import numerics

    refs, _ = numerics.torch_references()
    ref = refs[numerics.CHUNK]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(42)
    b, t, h = BATCH, SEQ, HEADS
    raw = {
        "q": torch.rand(b, t, h, kd, generator=gen),
        "k": torch.rand(b, t, h, kd, generator=gen),
        "v": torch.rand(b, t, h, vd, generator=gen),
        "beta": torch.rand(b, t, h, generator=gen).sigmoid(),
        "g": F.logsigmoid(torch.rand(b, t, h, generator=gen)) / 10,
        "h0": torch.zeros(b, h, kd, vd),
        "do": torch.rand(b, t, h, vd, generator=gen),
        "dht": torch.rand(b, h, kd, vd, generator=gen),
    }
    names = ("q", "k", "v", "g", "beta", "h0")
    low = ("q", "k", "v", "beta")  # what the kernel receives in `dtype`; g and h0 stay fp32
    # Both sides get the same values (rounded to `dtype` once) as fp32 leaves and do the l2-normalisation in
    # fp32; only the kernel call sees `dtype`. So every difference below is the kernel's arithmetic, not
    # bf16 rounding of the normalisation or of the gradients.
    base = {n: (raw[n].to(dtype) if n in low else raw[n]).to(DEVICE, torch.float32) for n in names}
    kin = {n: base[n].clone().requires_grad_(True) for n in names}
    rin = {n: base[n].clone().requires_grad_(True) for n in names}
    label = f"B{b} T{t} H{h} K{kd} V{vd} {dtype_name} issue-640 recipe"

    def run(fn: Callable[..., Any], x: dict[str, Any], cast: Any, do: Any, dht: Any) -> tuple[Any, ...]:
        o, ht = fn(
            cast(F.normalize(x["q"], p=2, dim=-1)),
            cast(F.normalize(x["k"], p=2, dim=-1)),
            cast(x["v"]),
            g=x["g"],
            beta=cast(x["beta"]),
            initial_state=x["h0"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        grads = torch.autograd.grad((o, ht), [x[n] for n in names], grad_outputs=(do, dht), allow_unused=True)
        return o, ht, grads

    do = raw["do"].to(DEVICE, dtype)
    dht = raw["dht"].to(DEVICE)
    try:
        o, ht, kgrads = run(chunk_gated_delta_rule, kin, lambda x: x.to(dtype), do, dht)
    except Exception as exc:  # noqa: BLE001 - the refusal or a crash is a result too
        return [numerics.error_case(numerics.CHUNK, label, exc)]
    ro, rht, rgrads = run(ref, rin, lambda x: x, do.float(), dht)
    cases = [numerics.compare(numerics.CHUNK, label, "o", o, ro, tol), numerics.compare(numerics.CHUNK, label, "ht", ht, rht, tol)]
    cases += [numerics.compare(numerics.CHUNK, label, "d" + n, kg, rg, tol) for n, kg, rg in zip(names, kgrads, rgrads)]
    return cases


def kernelguard_case(kd: int, vd: int) -> list[Any]:
    """The same check `kernelguard check --run` does (randn inputs, varlen and padded rows)."""
    from kernelguard.stack import numerics
    from kernelguard.stack.numerics import GdnShape

    shapes = [
        GdnShape(num_k_heads=HEADS, num_v_heads=HEADS, key_dim=kd, value_dim=vd, batch=BATCH, seq_len=SEQ),
        GdnShape(num_k_heads=HEADS, num_v_heads=HEADS, key_dim=kd, value_dim=vd, seq_len=1024, segments=(300, 500, 224)),
    ]
    report = numerics.run_numerics([numerics.CHUNK], shapes=shapes, device="cuda", lift_fla_hopper_refusal=True)
    print(report.render(), flush=True)
    return list(report.cases)


def tile_for(kd: int, tiling: int | None) -> int:
    import triton

    return min(max(triton.next_power_of_2(kd), 16), tiling or 128)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", default=",".join(c[0] for c in CASES))
    p.add_argument("--budget-s", type=float, default=400.0, help="start no new case after this many seconds")
    args = p.parse_args(argv)

    import torch

    from kernelguard.stack import numerics

    if not torch.cuda.is_available():
        print("fla640_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    numerics.lift_fla_hopper_refusal()
    import triton

    env = {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    try:
        import importlib.metadata as md

        env["fla"] = md.version("fla-core")
    except Exception:  # noqa: BLE001
        env["fla"] = None
    wanted = args.cases.split(",")
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name, tiling, kd, vd, dtype_name, recipe in CASES:
        if name not in wanted:
            continue
        if time.perf_counter() - start > args.budget_s:
            print(f"[probe] {name}: skipped (budget)", flush=True)
            continue
        force_tiling(tiling)
        t0 = time.perf_counter()
        if recipe == "issue":
            cases = issue_recipe_case(name, kd, vd, dtype_name, numerics.REL_TOL)
        else:
            cases = kernelguard_case(kd, vd)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        force_tiling(None)
        ok = all(c.ok for c in cases)
        failures += not ok
        row = {
            "case": name,
            "const_tiling": tiling or "stock",
            "BK": tile_for(kd, tiling),
            "NK": -(-kd // tile_for(kd, tiling)),
            "key_dim": kd,
            "value_dim": vd,
            "dtype": dtype_name,
            "recipe": recipe,
            "ok": ok,
            "seconds": round(seconds, 1),
            "tensors": {f"{c.shape} | {c.tensor}": [round(c.rel_error, 6), round(c.max_abs_error, 5), c.ok] for c in cases},
            "errors": [c.detail for c in cases if c.detail],
            "env": env,
        }
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        worst = max(cases, key=lambda c: c.rel_error)
        print(
            f"[probe] {name}: BK={row['BK']} NK={row['NK']} ok={ok} worst {worst.tensor} "
            f"rel {worst.rel_error:.4%} max|d| {worst.max_abs_error:.4g} ({seconds:.1f}s)",
            flush=True,
        )
        for c in cases:
            if not c.ok:
                print("    FAIL " + c.render(), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
