#!/usr/bin/env python
"""Training throughput of a Qwen3.5-shaped proxy, one process per variant, JSON out.

Variants (same model, init, data, bf16 weights, AdamW, activation checkpointing on every decoder layer,
single GPU — no FSDP here, the point is kernel/packing/launch cost, not sharding):

  a  fallback: fla and causal_conv1d hidden (imports blocked before transformers loads), padded 2D batches
     of sequential examples capped at --tokens-per-batch tokens (rows x longest <= cap), SDPA, AdamW (foreach).
  b  stock transformers packing: sequential greedy fill into --tokens-per-batch blocks, exactly what
     DataCollatorWithFlattening passes by default (input_ids, labels, position_ids; no cu_seq_lens, no
     seq_idx: GDN layers then run each block as ONE sequence), SDPA (block mask from position ids),
     fla + causal-conv1d present, AdamW (foreach).
  c  kernelguard: best-fit-decreasing blocks padded to --tokens-per-batch with cu_seq_lens_q/k,
     max_length_q/k, seq_idx (kernelguard.train.packing.build_packed_block), the varlen attention from
     kernelguard.attention.register_varlen_attention(), fused AdamW.
  d  c without activation checkpointing (what `kernelguard train --no-activation-checkpointing` does; the
     forward is no longer recomputed in the backward - only where the activations fit, see peak memory).
  e  d with kernelguard.train.loss.linear_cross_entropy: the loss from the final hidden states in
     4,096-token chunks, never materialising the fp32 tokens x vocab logits.

  python bench/train_throughput.py --variant c --out c.json
  python bench/train_throughput.py --all --out combined.json       # a..e, each in a fresh subprocess
  python bench/train_throughput.py --variant a --device cpu --tiny --steps 2 --out /tmp/a.json  # logic check

On Hopper with Triton 3.4-3.7.0, fla 0.6.0 refuses its gated backward (fla issue 640). --lift-fla-hopper-refusal
auto (default) lifts it only when the model's key head dim is >= 128, the geometry measured correct on the H200
(bench/gpu_numerics.py); the JSON then says fla_hopper_refusal_lifted: true, and so must every figure quoted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HIDE_ENV = "KERNELGUARD_BENCH_HIDE"  # comma-separated top-level packages to make unimportable
VARIANTS = ("a", "b", "c", "d", "e")
PACKED_VARIANTS = ("c", "d", "e")  # kernelguard's data layout, attention and optimizer
NO_AC_VARIANTS = ("d", "e")  # activation checkpointing off (kernelguard train --no-activation-checkpointing)
FUSED_LOSS_VARIANTS = ("e",)  # kernelguard.train.loss.linear_cross_entropy instead of the model's loss
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # run from a checkout without installing kernelguard


# ----------------------------------------------------------------------------------------- import blocker
def hide_packages(names: set[str]) -> None:
    """Make top-level packages look not installed, before transformers' modeling modules import them.

    ``sys.modules[name] = None`` is the interpreter's own "not importable" marker: ``import fla`` raises
    ModuleNotFoundError and ``importlib.util.find_spec("fla")`` returns None (a meta-path finder that raises
    would instead crash availability probes such as transformers' ``_is_package_available``).
    """
    if not names:
        return
    loaded = [m for m in sys.modules if m.split(".")[0] in names and sys.modules[m] is not None]
    if loaded or any(m.startswith("transformers.models.") for m in sys.modules):
        raise RuntimeError(
            f"{sorted(names)} must be hidden before transformers' modeling modules are imported"
        )
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------------------- config
def model_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.tiny:
        return {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "use_cache": False,
        }
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.attn_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_key_dim,
        "linear_value_head_dim": args.linear_value_dim,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": max(32768, args.tokens_per_batch),
        "tie_word_embeddings": False,
        "use_cache": False,
    }


def layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


# ----------------------------------------------------------------------------------------- data
def example_lengths(n: int, *, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [max(2, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def make_example(index: int, length: int, vocab: int, seed: int) -> tuple[list[int], list[int]]:
    """Random token ids for example ``index`` (deterministic per example, independent of batching)."""
    import random

    rng = random.Random(f"{seed}:{index}")
    ids = [rng.randrange(1, vocab) for _ in range(length)]
    return ids, list(ids)


def padded_batches(lengths: list[int], cap: int) -> list[list[int]]:
    """Sequential examples into 2D batches while rows x longest <= cap tokens."""
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > cap:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def group_examples(variant: str, lengths: list[int], cap: int) -> list[list[int]]:
    if variant == "a":
        return padded_batches(lengths, cap)
    from kernelguard.train.packing import pack_best_fit_decreasing, pack_sequential_greedy

    return (
        pack_sequential_greedy(lengths, cap)
        if variant == "b"
        else pack_best_fit_decreasing(lengths, cap, seed=0)
    )


def layout_stats(variant: str, groups: list[list[int]], lengths: list[int], cap: int) -> dict[str, Any]:
    real = sum(lengths[i] for g in groups for i in g)
    if variant == "a":  # rows x longest
        computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    elif variant == "b":  # the stock collator concatenates without padding
        computed = real
    else:  # every block padded to cap (one padding segment)
        computed = len(groups) * cap
    return {
        "examples": len(lengths),
        "real_tokens": real,
        "batches_per_epoch": len(groups),
        "padding_pct": round(100.0 * (1 - real / computed), 3) if computed else 0.0,
        "unused_capacity_pct": round(100.0 * (1 - real / (len(groups) * cap)), 3) if groups else 0.0,
    }


def build_batch(
    variant: str, idx: list[int], lengths: list[int], cap: int, vocab: int, seed: int, pad_id: int
) -> dict[str, Any]:
    """Model inputs (CPU tensors) for one group of example indices, as each variant's pipeline builds them."""
    import torch

    examples = [make_example(i, lengths[i], vocab, seed) for i in idx]
    seq_lens = [lengths[i] for i in idx]
    if variant == "a":
        longest = max(seq_lens)
        ids = torch.full((len(idx), longest), pad_id, dtype=torch.long)
        labels = torch.full((len(idx), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(idx), longest), dtype=torch.long)
        for row, (tok, lab) in enumerate(examples):
            n = len(tok)
            ids[row, :n] = torch.tensor(tok)
            labels[row, :n] = torch.tensor(lab)
            mask[row, :n] = 1
        batch: dict[str, Any] = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    elif variant == "b":
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening(return_tensors="pt")  # stock defaults
        batch = dict(collator([{"input_ids": tok, "labels": lab} for tok, lab in examples]))
    else:
        from kernelguard.train.packing import build_packed_block

        batch = build_packed_block(examples, cap, pad_id)
        batch.pop("num_real_tokens", None)
    batch["_seq_lens"] = seq_lens
    return batch


# ----------------------------------------------------------------------------------------- measuring
def which_implementations() -> dict[str, str]:
    """Which callable transformers' decorated GDN/conv functions will call (closure ``implementation``)."""
    import importlib

    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    from kernelguard.smoke import hub_wrapper

    out = {}
    for kernel, name in (
        ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
        ("causal_conv1d_fn", "causal_conv1d_fn"),
    ):
        fn: Any = hub_wrapper(getattr(mod, name))
        try:
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
            impl = cells["implementation"]
            torch_fn = cells.get("torch_function")
            module = getattr(impl, "__module__", "?") or "?"
            reference = impl is torch_fn or module.startswith("transformers.")
            out[kernel] = "torch reference" if reference else f"{module}.{getattr(impl, '__qualname__', '?')}"
        except Exception as exc:  # noqa: BLE001 - another transformers layout: say so, do not crash
            out[kernel] = f"unknown ({type(exc).__name__})"
    return out


def measure_matmul_tflops(device: Any, n: int, iters: int) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    return 2.0 * n**3 / dt / 1e12


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def profile_counts(step_fn: Any, batches: list[dict[str, Any]], device: Any) -> dict[str, Any]:
    """Kernel launches and CPU ops per step from torch.profiler over len(batches) steps."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for b in batches:
            step_fn(b)
        sync(device)
    wall = time.perf_counter() - t0
    n = len(batches)
    cpu_ops = launch_calls = kernels = copies = 0
    kernel_us = 0.0
    by_kernel: dict[str, list[float]] = {}
    for evt in prof.events():
        name = evt.name
        if evt.device_type == DeviceType.CPU:
            if name.startswith(("cuda", "cu", "hip")):  # CUDA runtime/driver API calls, not ops
                launch_calls += "Launch" in name
            elif not name.startswith(("ProfilerStep", "## ")):
                cpu_ops += 1
        elif "memcpy" in name.lower() or "memset" in name.lower():
            copies += 1
        else:  # a GPU kernel that ran
            kernels += 1
            us = float(evt.time_range.elapsed_us())
            kernel_us += us
            slot = by_kernel.setdefault(name[:90], [0, 0.0])
            slot[0] += 1
            slot[1] += us
    return {
        "profiled_steps": n,
        "profiled_wall_s_per_step": round(wall / n, 4),
        "kernel_launches_per_step": round(kernels / n, 1),
        "launch_api_calls_per_step": round(launch_calls / n, 1),
        "memcpy_memset_per_step": round(copies / n, 1),
        "gpu_kernel_s_per_step": round(kernel_us / 1e6 / n, 4),
        "gpu_busy_pct": round(100.0 * kernel_us / 1e6 / wall, 1) if cuda and wall > 0 else None,
        "cpu_ops_per_step": round(cpu_ops / n, 1),
        "top_gpu_kernels": [
            {"kernel": k, "calls_per_step": round(c / n, 1), "ms_per_step": round(us / 1e3 / n, 2),
             "pct_of_gpu_time": round(100.0 * us / kernel_us, 1) if kernel_us else None}
            for k, (c, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:15]
        ],
        "profiler_note": "kernel launches = GPU kernels executed (profiler device events, memcpy/memset excluded); "
        "cpu ops = CPU-side profiler events other than CUDA runtime/driver calls; "
        "profiler overhead inflates the profiled wall time",
    }


def maybe_lift_refusal(mode: str, key_dim: int, device: Any) -> tuple[bool, str]:
    """fla's Hopper refusal: lift per --lift-fla-hopper-refusal (auto: only at key head dim >= 128)."""
    import torch

    try:
        from fla.ops.common import chunk_o
    except Exception as exc:  # noqa: BLE001
        return False, f"fla.ops.common.chunk_o not importable ({type(exc).__name__}); nothing to lift"
    flag = getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    hopper = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False))
    triton34 = bool(getattr(chunk_o, "TRITON_ABOVE_3_4_0", False))
    if flag or not (hopper and triton34) or torch.device(device).type != "cuda":
        return False, "fla does not refuse on this stack"
    if mode == "no":
        return (
            False,
            "fla refuses the gated backward on this stack and the refusal was kept: fla steps will raise",
        )
    if mode == "auto" and key_dim < 128:
        raise SystemExit(
            f"fla refuses its gated backward here (Hopper, Triton < 3.7.1) and key head dim {key_dim} < 128 is "
            "the shape where that refusal is justified (wrong dk/dg, fla issue 640); pass "
            "--lift-fla-hopper-refusal yes to time it anyway (gradients wrong)"
        )
    from kernelguard.smoke import lift_fla_hopper_refusal

    changed = lift_fla_hopper_refusal()
    return True, (
        f"fla's Hopper/Triton<3.7.1 refusal lifted in this process ({', '.join(changed)}); key head dim "
        f"{key_dim}: {'measured correct (DEVICE.md, gpu_numerics)' if key_dim >= 128 else 'GRADIENTS WRONG'}"
    )


# ----------------------------------------------------------------------------------------- one variant
def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    variant = args.variant
    if variant == "a":
        hide_packages({"fla", "causal_conv1d"} | set(filter(None, os.environ.get(HIDE_ENV, "").split(","))))
    else:
        hide_packages(set(filter(None, os.environ.get(HIDE_ENV, "").split(","))))
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from kernelguard.train.metrics import peak_flops, step_flops

    result: dict[str, Any] = {"variant": variant, "ok": False, "notes": []}
    cfg_kwargs = model_config_kwargs(args)
    interval = 2 if args.tiny else args.full_attention_interval  # tiny: one GDN + one attention layer
    cfg_kwargs["layer_types"] = layer_types(cfg_kwargs["num_hidden_layers"], interval)
    config = Qwen3_5TextConfig(**cfg_kwargs)

    attn = "sdpa"
    if args.attn_impl:
        attn = args.attn_impl
        if attn == "kernelguard_varlen":
            from kernelguard.attention import register_varlen_attention

            register_varlen_attention(device_type=device.type)
        result["notes"].append(f"attention forced to {attn} by --attn-impl")
    elif variant in PACKED_VARIANTS:
        from kernelguard.attention import register_varlen_attention

        attn = register_varlen_attention(device_type=device.type)
        if attn == "sdpa":
            result["notes"].append("register_varlen_attention() chose sdpa (no varlen kernel on this device)")
    lifted, lift_note = (False, "fallback variant: fla hidden")
    if variant != "a":
        lifted, lift_note = maybe_lift_refusal(
            args.lift_fla_hopper_refusal, config.linear_key_head_dim, device
        )
    result["notes"].append(lift_note)
    if variant == "b":
        result["notes"].append(
            "stock DataCollatorWithFlattening defaults pass no cu_seq_lens/seq_idx: GDN layers run each block as "
            "one sequence (recurrent and conv state flow across packed examples) - stock behaviour, timed as is"
        )
    result["kernels"] = which_implementations()
    result["attention"] = attn

    # ---- data: layout statistics over a whole synthetic epoch; tensors only for a seeded sample of its
    # batches (not the first ones: best-fit-decreasing opens its blocks longest example first).
    cap = args.tokens_per_batch
    lengths = example_lengths(
        args.examples, median=args.median_len, sigma=args.sigma, cap=cap, seed=args.seed
    )
    groups = group_examples(variant, lengths, cap)
    layout = layout_stats(variant, groups, lengths, cap)
    needed = args.warmup + args.steps + args.profile_steps
    import random

    picks = random.Random(args.seed).sample(range(len(groups)), min(needed, len(groups)))
    if len(picks) < needed:
        result["notes"].append(f"only {len(groups)} batches for {needed} steps: batches reused cyclically")
    built = [build_batch(variant, groups[i], lengths, cap, config.vocab_size, args.seed, 0) for i in picks]
    schedule = [built[i % len(built)] for i in range(needed)]
    layout["batch_kwargs"] = sorted(k for k in built[0] if k not in ("_seq_lens", "input_ids", "labels"))

    # ---- model + optimizer
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    model.to(device=device, dtype=dtype)
    model.train()
    ac_kwargs = {"use_reentrant": False}
    if variant in NO_AC_VARIANTS:
        pass
    elif hasattr(model, "activation_checkpointing_enable"):  # transformers >= ~5.20
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=ac_kwargs)
    else:  # 5.17 on the GPU machine
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ac_kwargs)
    fused = variant in PACKED_VARIANTS and device.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=1e-5,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        **({"fused": True} if fused else {"foreach": device.type == "cuda"}),
    )
    n_params = sum(p.numel() for p in model.parameters())

    def to_dev(batch: dict[str, Any]) -> dict[str, Any]:
        return {
            k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()
            if not k.startswith("_")
        }

    def model_loss(inputs: dict[str, Any]) -> Any:
        return model(**inputs, use_cache=False).loss

    def fused_loss(inputs: dict[str, Any]) -> Any:
        from kernelguard.train.loss import linear_cross_entropy

        labels = inputs.pop("labels")
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
        # The model's loss shifts inside (token t predicts t+1) and takes the mean over counted tokens.
        total, count = linear_cross_entropy(
            hidden[:, :-1].reshape(-1, hidden.shape[-1]), model.lm_head.weight, labels[:, 1:].reshape(-1)
        )
        return total / count.clamp(min=1)

    compute_loss = fused_loss if variant in FUSED_LOSS_VARIANTS else model_loss

    def step(batch: dict[str, Any]) -> float:
        loss = compute_loss(to_dev(batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # ---- warm-up (compiles/autotunes Triton kernels on first fla call)
    t0 = time.perf_counter()
    for b in schedule[: args.warmup]:
        loss = step(b)
    sync(device)
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # ---- measured steps (no profiler)
    times: list[float] = []
    real_tokens = 0
    flops = 0.0
    losses = []
    for b in schedule[args.warmup : args.warmup + args.steps]:
        sync(device)
        s = time.perf_counter()
        loss = step(b)
        sync(device)
        times.append(time.perf_counter() - s)
        real_tokens += sum(b["_seq_lens"])
        flops += step_flops(config, b["_seq_lens"])
        losses.append(float(loss))
    total = sum(times)
    if device.type == "cuda":
        peak_mem = torch.cuda.max_memory_allocated(device)
        mem_kind = "torch.cuda.max_memory_allocated"
    else:
        import resource

        peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        mem_kind = "process max RSS (CPU run)"

    # ---- profiler over the next steps
    try:
        prof = profile_counts(step, schedule[args.warmup + args.steps :], device)
    except Exception as exc:  # noqa: BLE001 - keep the throughput figures even if profiling fails
        prof = {"profiler_error": f"{type(exc).__name__}: {exc}"}

    # ---- matmul roofline in this process
    mm_n = 256 if args.tiny or device.type != "cuda" else 8192
    mm_tflops = measure_matmul_tflops(device, mm_n, iters=5 if device.type != "cuda" else 20)
    achieved = flops / total if total else 0.0
    peak = peak_flops(device)

    result.update(
        {
            "ok": all(math.isfinite(x) for x in losses),
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "fla_hopper_refusal_lifted": lifted,
            "config": {
                "class": type(config).__name__,
                **cfg_kwargs,
                "params": n_params,
                "dtype": "bfloat16 weights, grads and optimizer state",
                "activation_checkpointing": "none"
                if variant in NO_AC_VARIANTS
                else "every decoder layer (use_reentrant=False)",
                "loss": "kernelguard.train.loss.linear_cross_entropy (4,096-token chunks)"
                if variant in FUSED_LOSS_VARIANTS
                else "the model's (logits, fp32 upcast, cross_entropy)",
                "optimizer": f"torch.optim.AdamW(lr=1e-5, betas=(0.9,0.95), wd=0.1, {'fused' if fused else 'foreach' if device.type == 'cuda' else 'for-loop'})",
                "parallelism": "single device, no FSDP",
            },
            "data": {
                "lengths": f"lognormal(median={args.median_len}, sigma={args.sigma}) capped at {cap}, seed {args.seed}",
                "tokens_per_batch": cap,
                **{k: v for k, v in layout.items() if k != "batch_kwargs"},
            },
            "batch_kwargs": layout["batch_kwargs"],
            "batches_per_epoch": layout["batches_per_epoch"],
            "padding_pct": layout["padding_pct"],
            "unused_capacity_pct": layout["unused_capacity_pct"],
            "warmup_steps": args.warmup,
            "warmup_s": round(warmup_s, 2),
            "measured_steps": len(times),
            "step_time_s": round(total / len(times), 4) if times else None,
            "step_time_s_median": round(statistics.median(times), 4) if times else None,
            "step_times_s": [round(t, 4) for t in times],
            "real_tokens_measured": real_tokens,
            "tokens_per_s": round(real_tokens / total, 1) if total else 0.0,
            "achieved_tflops": round(achieved / 1e12, 3),
            "mfu": round(achieved / peak, 4) if peak else None,
            "mfu_peak_tflops": round(peak / 1e12, 1) if peak else None,
            "matmul_bf16": {"n": mm_n, "tflops": round(mm_tflops, 1)},
            "mfu_vs_measured_matmul": round(achieved / (mm_tflops * 1e12), 4) if mm_tflops else None,
            "flops_source": "kernelguard.train.metrics.step_flops (3 x forward, real tokens only; AC recompute not counted)",
            "peak_memory_bytes": int(peak_mem),
            "peak_memory_kind": mem_kind,
            "losses": [round(x, 4) for x in losses],
            **prof,
            "versions": versions(),
        }
    )
    for key in ("kernel_launches_per_step", "cpu_ops_per_step"):
        result.setdefault(key, None)
    if result.get("gpu_kernel_s_per_step") and result.get("step_time_s"):
        # The profiler slows the host side, so its own wall time overstates idle GPU time; kernel time per
        # step over the unprofiled step time is the better "is the GPU busy" figure.
        result["gpu_busy_vs_unprofiled_step_pct"] = round(
            100.0 * result["gpu_kernel_s_per_step"] / result["step_time_s"], 1
        )
    if lifted:
        result["notes"].append("timing obtained with fla's Hopper refusal lifted (Triton path)")
    return result


def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "fla-core", "flash-linear-attention", "causal-conv1d"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        import torch

        out["cuda"] = torch.version.cuda
    except ImportError:
        out["cuda"] = None
    return out


# ----------------------------------------------------------------------------------------- driver
def run_all(args: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    combined: dict[str, Any] = {"variants": {}, "errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants.split(","):
            out = Path(tmp) / f"{v}.json"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--variant",
                v,
                "--out",
                str(out),
                *passthrough,
            ]
            print(f"[train_throughput] variant {v}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            rc: int | str
            try:
                proc = subprocess.run(
                    cmd, check=False, capture_output=True, text=True, timeout=args.child_timeout
                )
                rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = "timeout", str(exc)[-4000:]
            elapsed = round(time.perf_counter() - t0, 1)
            if out.exists():
                combined["variants"][v] = {**json.loads(out.read_text()), "process_s": elapsed}
            if rc != 0 or not out.exists():
                combined["errors"][v] = {"returncode": rc, "process_s": elapsed, "output_tail": tail}
            print(f"[train_throughput] variant {v}: rc={rc} in {elapsed}s", file=sys.stderr, flush=True)
            _summarize(combined)
            # Partial results survive an outer timeout: rewrite the combined file after every variant.
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(combined, indent=2, default=str))
    return combined


def _summarize(combined: dict[str, Any]) -> None:
    tps = {v: r.get("tokens_per_s") for v, r in combined["variants"].items() if r.get("tokens_per_s")}
    combined["tokens_per_s"] = tps
    combined["speedup_vs_a"] = {v: round(t / tps["a"], 3) for v, t in tps.items()} if "a" in tps else {}
    if "b" in tps:
        combined["vs_b"] = {v: round(t / tps["b"], 3) for v, t in tps.items()}
    combined["note"] = (
        "Ratios are only meaningful within this one run/machine (the fallback is CPU-launch-bound). "
        "Variants with fla_hopper_refusal_lifted=true ran fla's Triton backward past its Hopper refusal."
    )


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--variant", choices=VARIANTS)
    g.add_argument("--all", action="store_true", help="run --variants each in a fresh subprocess")
    p.add_argument("--variants", default="a,b,c,d,e")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model/data for a CPU logic check")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--tokens-per-batch", type=int, default=None)
    p.add_argument("--examples", type=int, default=None, help="synthetic epoch size (layout statistics)")
    p.add_argument("--median-len", type=float, default=None)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--attn-heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--linear-key-heads", type=int, default=16)
    p.add_argument("--linear-value-heads", type=int, default=32)
    p.add_argument("--linear-key-dim", type=int, default=128)
    p.add_argument("--linear-value-dim", type=int, default=128)
    p.add_argument("--full-attention-interval", type=int, default=4)
    p.add_argument("--attn-impl", default=None, help="override the variant's attention (e.g. sdpa)")
    p.add_argument("--lift-fla-hopper-refusal", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--child-timeout", type=int, default=420)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.tokens_per_batch is None:
        args.tokens_per_batch = 256 if args.tiny else 8192
    if args.median_len is None:
        args.median_len = 40.0 if args.tiny else 1100.0
    if args.examples is None:
        # Enough for warm-up + measured + profiled steps even in the densest layout (packed ~4-5 per block).
        args.examples = 200 if args.tiny else 4000
    passthrough = _strip(raw, {"--all": 0, "--variants": 1, "--out": 1, "--child-timeout": 1})
    return args, passthrough


def _strip(argv: list[str], drop: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        key = argv[i].split("=", 1)[0]
        if key in drop:
            i += 1 + (drop[key] if "=" not in argv[i] else 0)
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse(argv)
    try:
        result = run_all(args, passthrough) if args.all else run_variant(args)
        rc = 0 if (args.all or result.get("ok")) else 1
    except SystemExit as exc:
        if exc.code in (0, None):
            raise
        result = {"variant": args.variant, "ok": False, "error": str(exc.code)}
        rc = 1
    except Exception as exc:  # noqa: BLE001 - the JSON must say what went wrong
        result = {
            "variant": args.variant,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-6000:],
        }
        rc = 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    summary = {
        k: result.get(k)
        for k in (
            "variant",
            "ok",
            "tokens_per_s",
            "step_time_s",
            "mfu",
            "mfu_vs_measured_matmul",
            "padding_pct",
            "batches_per_epoch",
            "fla_hopper_refusal_lifted",
            "error",
        )
        if k in result
    }
    print(
        json.dumps(
            summary
            if not args.all
            else {
                "tokens_per_s": result.get("tokens_per_s"),
                "speedup_vs_a": result.get("speedup_vs_a"),
                "errors": list(result.get("errors", {})),
            }
        )
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
