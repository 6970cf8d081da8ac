#!/usr/bin/env python
"""Training throughput of `kernelguard train`'s own step on a Qwen3.5-shaped proxy; one JSON per variant.

Every variant builds the model with ``kernelguard.train.model.build.setup_training`` (meta device -> activation
checkpointing -> chunked-loss head -> FSDP2 ``fully_shard`` on a 1-rank mesh -> weights -> fused AdamW) and
times ``kernelguard.train.step.step.optimizer_step`` (forward/backward, clip, AdamW, LR schedule): the product's
step, FSDP2 included. Variants differ only in their input batches and TrainConfig flags:

  fallback        padded 2D batches of sequential examples (rows x longest <= --tokens-per-batch), fla and
                  causal-conv1d hidden (transformers' torch references run), SDPA, AC, logits loss.
  stock_best      the fair stock baseline: sequential greedy fill, DataCollatorWithFlattening(
                  return_flash_attn_kwargs=True, return_seq_idx=True) (cu_seq_lens + seq_idx reach fla and
                  causal-conv1d), fla + causal-conv1d, SDPA, AC, logits loss.
  stock_defaults  the same with the collator's defaults (position_ids only: GDN state flows across examples;
                  a labelled extra row, not a baseline).
  product         what `kernelguard train` runs by default: best-fit-decreasing blocks of exactly
                  --tokens-per-batch tokens (build_packed_block), kernelguard_varlen attention, AC, chunked loss.
  product_noac    product with --no-activation-checkpointing.
  product_default exactly `kernelguard train` with no performance flags: two blocks per step, activation
                  checkpointing and blocks per forward auto (the memory estimate decides on this GPU; the JSON
                  records the choice), compile auto (on for a GPU run).
  product_round5  the default before round 6: one block per step, checkpointing auto, no compile.

Levers (``--lever``, comma list, measured one at a time). Product flags (the JSON still says product_path:
true): ``compile`` is ``--compile`` (regional torch.compile of each decoder layer, fla/causal-conv1d/attention
left opaque: kernelguard.train.model.compile); ``no_reshard`` is ``--no-reshard-after-forward`` (FSDP2 keeps each
layer's gathered weights from forward to backward: on one GPU the "all-gather" is a copy, done twice per step
otherwise); ``accum2`` is ``--gradient-accumulation-steps 2`` (two micro-batches per optimizer step: the
optimizer and clipping are paid once per 2 blocks); ``tokens2x`` is ``--max-length 2 x --tokens-per-batch``
(one block of twice the tokens); ``fused_norms`` is ``--fused-norms`` (Liger-Kernel's fused RMSNorm and SiLU x up,
kernelguard.train.model.fused_norms). Bench-side patches `kernelguard train` does not run (product_path: false):
``liger`` (Liger-Kernel's fused linear cross-entropy instead of the chunked loss), ``sac2`` (activation
checkpointing on every 2nd layer), ``eager_loss`` (the chunked loss's per-chunk softmax gradient left eager
when the layers compile: the control for the compiled one). ``liger`` and ``fused_norms`` need ``liger-kernel`` importable (a pure-Python
wheel) and CUDA.

``--widths 27b``: Qwen3.5-27B's real widths (bench/configs/qwen3_5_27b_text.json: hidden 5120, vocab 248,320,
48 value heads...) with ``--layers`` of its layers, instead of the 1.16 B proxy.

  python bench/gpu/train_throughput.py --variant product --out product.json
  python bench/gpu/train_throughput.py --all --variants fallback,stock_best,product --out combined.json
  python bench/gpu/train_throughput.py --variant product --device cpu --tiny --out /tmp/p.json  # logic, CPU

Step times go through bench/lib/step_stats.py: the first --warmup steps are dropped, any step > 3x the median
of the rest (an autotune or recompile) is listed in step_stats.outliers and excluded, and tokens/s and MFU are
over the steady steps only (>= 10 wanted; the defaults give 12). Every step time is in the JSON.

On Hopper with Triton 3.4-3.7.0, fla 0.6.0 refuses its gated backward (fla issue 640); at key head dim >= 128
(measured correct on the H200, bench/RESULTS.md) the refusal is lifted in the process and the JSON says
fla_hopper_refusal_lifted: true.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HIDE_ENV = "KERNELGUARD_BENCH_HIDE"  # comma-separated top-level packages to make unimportable
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))  # run from a checkout without installing kernelguard
sys.path.insert(1, str(ROOT / "bench" / "lib"))
from step_stats import steady_rate, steady_stats


@dataclass(frozen=True, slots=True)
class Variant:
    layout: str  # padded | stock_flash | stock_defaults | packed
    attention: str  # TrainConfig.attention
    activation_checkpointing: bool | None  # None: auto, as `kernelguard train` defaults
    loss: str  # TrainConfig.loss
    hide: tuple[str, ...] = ()
    product_path: bool = False  # exactly what `kernelguard train` runs (before levers)
    compile: bool | None = False  # None: auto (on for a GPU run), as `kernelguard train` defaults
    blocks_per_step: int = 1  # --gradient-accumulation-steps: blocks of --tokens-per-batch per optimizer step
    blocks_per_forward: int | None = 1  # None: auto, as `kernelguard train` defaults


VARIANTS: dict[str, Variant] = {
    "fallback": Variant("padded", "sdpa", True, "logits", hide=("fla", "causal_conv1d")),
    "stock_best": Variant("stock_flash", "sdpa", True, "logits"),
    "stock_defaults": Variant("stock_defaults", "sdpa", True, "logits"),
    "product": Variant("packed", "auto", True, "chunked", product_path=True),
    "product_noac": Variant("packed", "auto", False, "chunked", product_path=True),
    # `kernelguard train` with no performance flags: two blocks per step; checkpointing, blocks per forward and
    # compile left to auto (the memory estimate decides on this GPU; the JSON records the choice).
    "product_default": Variant(
        "packed", "auto", None, "chunked", product_path=True, compile=None, blocks_per_step=2, blocks_per_forward=None
    ),
    # The default before round 6: one block per step, checkpointing auto, no compile.
    "product_round5": Variant("packed", "auto", None, "chunked", product_path=True),
}
LEVERS = ("compile", "liger", "sac2", "no_reshard", "reshard", "accum2", "tokens2x", "fused_norms", "eager_loss",
          "foreach_clip")
PRODUCT_LEVERS = {"compile", "no_reshard", "reshard", "accum2", "tokens2x", "fused_norms"}  # flags of `kernelguard train`
CONFIG_27B = ROOT / "bench" / "configs" / "qwen3_5_27b_text.json"


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


# ----------------------------------------------------------------------------------------- model config
def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """config.json contents of the proxy (Qwen3.5 text model, one full-attention layer every N)."""
    if args.tiny:
        dims = {
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
        }
        interval = 2
    elif args.widths == "27b":
        real = json.loads(CONFIG_27B.read_text())
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim")
        dims = {k: real[k] for k in keys} | {"num_hidden_layers": args.layers}
        interval = real.get("full_attention_interval", 4)
    else:
        dims = {
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
        }
        interval = args.full_attention_interval
    n = dims["num_hidden_layers"]
    return {
        "model_type": "qwen3_5_text",
        **dims,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ],
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": max(32768, args.tokens_per_batch),
        "tie_word_embeddings": False,
        "use_cache": False,
    }


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


def group_examples(layout: str, lengths: list[int], cap: int) -> list[list[int]]:
    from kernelguard.train.step.packing import pack_best_fit_decreasing, pack_sequential_greedy

    if layout == "padded":
        return padded_batches(lengths, cap)
    if layout == "packed":
        return pack_best_fit_decreasing(lengths, cap, seed=0)
    return pack_sequential_greedy(lengths, cap)  # what a stock packing collator is fed


def layout_stats(layout: str, groups: list[list[int]], lengths: list[int], cap: int) -> dict[str, Any]:
    real = sum(lengths[i] for g in groups for i in g)
    if layout == "padded":  # rows x longest
        computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    elif layout == "packed":  # every block padded to cap (one padding segment)
        computed = len(groups) * cap
    else:  # the stock collator concatenates without padding
        computed = real
    return {
        "examples": len(lengths),
        "real_tokens": real,
        "batches_per_epoch": len(groups),
        "padding_pct": round(100.0 * (1 - real / computed), 3) if computed else 0.0,
        "unused_capacity_pct": round(100.0 * (1 - real / (len(groups) * cap)), 3) if groups else 0.0,
    }


def build_batch(
    layout: str, idx: list[int], lengths: list[int], cap: int, vocab: int, seed: int
) -> dict[str, Any]:
    """One micro-batch (CPU tensors) for a group of example indices, as each layout's pipeline builds it."""
    import torch

    examples = [make_example(i, lengths[i], vocab, seed) for i in idx]
    if layout == "padded":
        longest = max(len(t) for t, _ in examples)
        batch: dict[str, Any] = {
            "input_ids": torch.zeros((len(idx), longest), dtype=torch.long),
            "labels": torch.full((len(idx), longest), -100, dtype=torch.long),
            "attention_mask": torch.zeros((len(idx), longest), dtype=torch.long),
        }
        for row, (tok, lab) in enumerate(examples):
            batch["input_ids"][row, : len(tok)] = torch.tensor(tok)
            batch["labels"][row, : len(tok)] = torch.tensor(lab)
            batch["attention_mask"][row, : len(tok)] = 1
    elif layout in ("stock_flash", "stock_defaults"):
        from transformers import DataCollatorWithFlattening

        flash = layout == "stock_flash"
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash, return_seq_idx=flash)
        batch = dict(
            collator([{"input_ids": tok, "labels": lab} for tok, lab in examples], return_tensors="pt")
        )
    else:
        from kernelguard.train.step.packing import build_packed_block

        batch = build_packed_block(examples, cap, 0)
    batch["_seq_lens"] = [lengths[i] for i in idx]
    return batch


def make_schedule(
    args: argparse.Namespace, variant: Variant, vocab: int, micro: int = 1
) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """Batches for warm-up + measured + profiled steps, drawn from a whole synthetic epoch's layout (a seeded
    sample, not the first ones: best-fit-decreasing opens its blocks longest example first)."""
    cap = args.tokens_per_batch
    lengths = example_lengths(
        args.examples, median=args.median_len, sigma=args.sigma, cap=cap, seed=args.seed
    )
    groups = group_examples(variant.layout, lengths, cap)
    stats = layout_stats(variant.layout, groups, lengths, cap)
    needed = (args.warmup + args.steps + args.profile_steps) * micro
    picks = random.Random(args.seed).sample(range(len(groups)), min(needed, len(groups)))
    built = [build_batch(variant.layout, groups[i], lengths, cap, vocab, args.seed) for i in picks]
    stats["batch_kwargs"] = sorted(k for k in built[0] if k not in ("_seq_lens", "labels"))
    stats["lengths"] = (
        f"lognormal(median={args.median_len}, sigma={args.sigma}) capped at {cap}, seed {args.seed}"
    )
    flat = [built[i % len(built)] for i in range(needed)]
    return [flat[i : i + micro] for i in range(0, needed, micro)], stats


# ----------------------------------------------------------------------------------------- levers
def apply_levers(levers: list[str], notes: list[str]) -> None:
    """Bench-side patches of the product's build/step (before setup_training)."""
    from kernelguard.train.model import build
    from kernelguard.train.step import step

    if "sac2" in levers:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        from kernelguard.train.model.parallel import decoder_layers

        def every_second(model: Any) -> None:
            layers = decoder_layers(model)
            for i in range(1, len(layers), 2):
                layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=True)

        build.apply_activation_checkpointing = every_second  # type: ignore[assignment]
        notes.append("lever sac2: activation checkpointing on every 2nd decoder layer only")
    if "liger" in levers:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger_loss(hidden: Any, weight: Any, labels: Any, *, ignore_index: int = -100, **_: Any) -> Any:
            total = liger_fused_linear_cross_entropy(
                hidden, weight, labels, ignore_index=ignore_index, reduction="sum"
            )
            return total.float(), (labels != ignore_index).sum()

        step.linear_cross_entropy = liger_loss  # type: ignore[assignment]
        notes.append("lever liger: Liger-Kernel fused linear cross-entropy replaces the chunked loss")
    if "eager_loss" in levers:
        from kernelguard.train.step.loss import linear_cross_entropy

        def eager_loss(*args: Any, **kwargs: Any) -> Any:
            return linear_cross_entropy(*args, **{**kwargs, "compiled_chunks": False})

        step.linear_cross_entropy = eager_loss  # type: ignore[assignment]
        notes.append("lever eager_loss: the chunked loss's softmax-gradient pass eager even when the model compiles")
    if "foreach_clip" in levers:  # the control of kernelguard.train.step.grad_norm: the step before it
        from kernelguard.train.step import grad_norm

        grad_norm.tiled_buffers = lambda grads: ([], list(grads))  # type: ignore[assignment]
        step.gradient_norm = lambda model: grad_norm.clip_gradients_(model, 1.0)  # type: ignore[assignment]
        step.clip_divisor = lambda norm, max_norm: None  # type: ignore[assignment]
        notes.append("lever foreach_clip: the gradient norm over every tensor (torch._foreach_norm) and the clip as a "
                     "pass over every gradient (clip_grads_with_norm_), not the fused AdamW's grad_scale")
    if "reshard" in levers:  # the product's --reshard-after-forward (set in run_variant)
        notes.append("lever reshard: `kernelguard train --reshard-after-forward`: each layer's gathered weights freed "
                     "after its forward and gathered again for its backward")
    if "fused_norms" in levers:  # the product's --fused-norms (TrainConfig.runtime.fused_norms, set in run_variant)
        notes.append("lever fused_norms: `kernelguard train --fused-norms` (kernelguard.train.model.fused_norms): Liger's "
                     "fused RMSNorm for every norm that computes what it computes, and its fused SiLU x up in every MLP")
    if "compile" in levers:  # the product's --compile (TrainConfig.compile, set in run_variant)
        notes.append(
            "lever compile: `kernelguard train --compile` (kernelguard.train.model.compile.compile_layers): "
            "torch.compile per decoder layer before fully_shard; GDN kernels, conv and attention opaque"
        )


# ----------------------------------------------------------------------------------------- measuring
def which_implementations() -> dict[str, str]:
    """Which callable transformers' decorated GDN/conv functions will call (closure ``implementation``)."""
    import importlib

    from kernelguard.resolution.transformers_compat import hub_wrapper
    from kernelguard.stack.numerics import kernel_sources

    out = {}
    for kernel in ("chunk_gated_delta_rule", "causal_conv1d_fn"):
        src = kernel_sources(kernel, family="qwen3_5")[
            0
        ]  # the catalog's call site in the proxy's modeling file
        fn: Any = hub_wrapper(getattr(importlib.import_module(src.reference_module), src.reference_name))
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
    with profile(activities=acts, record_shapes=True, with_flops=True) as prof:
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
        elif getattr(evt, "is_user_annotation", False):
            continue  # a GPU-side range such as "Optimizer.step#AdamW.step": its kernels are counted themselves
        elif "memcpy" in name.lower() or "memset" in name.lower():
            copies += 1
        else:  # a GPU kernel that ran
            kernels += 1
            us = float(evt.time_range.elapsed_us())
            kernel_us += us
            slot = by_kernel.setdefault(name[:160], [0, 0.0])
            slot[0] += 1
            slot[1] += us
    classify = kernel_classifier()
    by_class: dict[str, float] = {}
    for k, (_, us) in by_kernel.items():
        by_class[classify(k)] = by_class.get(classify(k), 0.0) + us
    return {
        "gpu_ms_by_class_per_step": {c: round(us / 1e3 / n, 2) for c, us in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "gpu_pct_by_class": {c: round(100.0 * us / kernel_us, 1) for c, us in sorted(by_class.items(), key=lambda kv: -kv[1])}
        if kernel_us else {},
        "classifier": getattr(classify, "__module__", "?"),
        "matmul_ops": matmul_rates(prof, n, cuda=cuda),
        "profiled_steps": n,
        "profiled_wall_s_per_step": round(wall / n, 4),
        "kernel_launches_per_step": round(kernels / n, 1),
        "launch_api_calls_per_step": round(launch_calls / n, 1),
        "memcpy_memset_per_step": round(copies / n, 1),
        "gpu_kernel_s_per_step": round(kernel_us / 1e6 / n, 4),
        "gpu_busy_pct": round(100.0 * kernel_us / 1e6 / wall, 1) if cuda and wall > 0 else None,
        "cpu_ops_per_step": round(cpu_ops / n, 1),
        "top_gpu_kernels": [
            {
                "kernel": k,
                "calls_per_step": round(c / n, 1),
                "ms_per_step": round(us / 1e3 / n, 2),
                "pct_of_gpu_time": round(100.0 * us / kernel_us, 1) if kernel_us else None,
            }
            for k, (c, us) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:15]
        ],
        "profiler_note": "kernel launches = GPU kernels executed (profiler device events, memcpy/memset excluded); "
        "cpu ops = CPU-side profiler events other than CUDA runtime/driver calls; "
        "profiler overhead inflates the profiled wall time",
    }


def kernel_classifier() -> Any:
    """The product's kernel classes (kernelguard.diagnosis.kernel_classes) when this checkout has them, else a
    local fallback with the same class names."""
    try:
        from kernelguard.diagnosis.kernel_classes import classify_kernel

        return classify_kernel
    except ImportError:
        return _fallback_classify


_FALLBACK_RULES = (
    ("communication", ("nccl", "allgather", "all_gather", "reducescatter", "reduce_scatter")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "adamw")),
    ("copy", ("memcpy", "memset", "chunk_cat", "catarraybatchedcopy", "split_with_sizes_copy", "copy_kernel")),
    ("conv", ("causal_conv1d", "conv1d", "depthwise", "convolution")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "varlen")),
    ("gdn", ("delta_rule", "gated_delta", "chunk_fwd_kernel", "chunk_bwd_kernel", "chunk_scaled_dot_kkt",
             "solve_tril", "recompute_w_u", "wy_repr", "chunk_local_cumsum", "chunk_delta_h", "l2norm", "chunk_o",
             "chunk_dqkwg", "chunk_dv")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsumexp")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "norm_fwd", "norm_bwd")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "wgmma", "splitk", "sm90_", "bmm")),
    ("elementwise", ("elementwise", "reduce", "triton_", "index", "scatter", "gather", "fill", "cumsum",
                     "softmax", "where", "cat", "vectorized", "at::native", "unrolled")),
)


def _fallback_classify(name: str) -> str:
    lowered = name.lower()
    return next((cls for cls, needles in _FALLBACK_RULES if any(n in lowered for n in needles)), "other")


def matmul_rates(prof: Any, steps: int, *, cuda: bool, top: int = 12) -> list[dict[str, Any]]:
    """The matmul ops (aten mm/addmm/bmm/_scaled_mm, grouped by input shapes) with the most GPU time per step,
    each with its FLOPs (torch.profiler's with_flops) and the rate its kernels achieved."""
    rows = []
    for avg in prof.key_averages(group_by_input_shape=True):
        if avg.key not in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::baddbmm"):
            continue
        device_us = float(getattr(avg, "device_time_total", 0.0) or getattr(avg, "cuda_time_total", 0.0) or 0.0)
        if not cuda:  # a CPU run (--tiny): the ops' own CPU time, so the table's plumbing is exercised
            device_us = float(avg.self_cpu_time_total)
        flops = float(getattr(avg, "flops", 0) or 0)
        if device_us <= 0:
            continue
        rows.append({
            "op": avg.key, "shapes": str(avg.input_shapes)[:120], "calls_per_step": round(avg.count / steps, 1),
            "ms_per_step": round(device_us / 1e3 / steps, 2),
            "tflops_achieved": round(flops / (device_us * 1e-6) / 1e12, 1) if flops else None,
        })
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:top]


def detector_figures(
    step_fn: Any, batches: list[dict[str, Any]], device: Any, *, config: Any, dump: Path | None = None
) -> dict[str, Any]:
    """`kernelguard train`'s step diagnosis (kernelguard.diagnosis.profiler) on this variant's step, as the loop
    runs it: the references armed and allowed as the gate arms them under --allow, unprofiled steps until three
    agree, then one profiled step. ``dump``: the window's kernel records (gzipped JSON), for the CPU tests."""
    import gzip

    import torch

    from kernelguard.diagnosis.profiler import StepProfiler
    from kernelguard.diagnosis.verdict import attribute_kernels
    from kernelguard.resolution.geometry import layer_types
    from kernelguard.runtime.tripwires import arm_tripwires
    from kernelguard.train.output.metrics import peak_flops, step_flops

    said: list[str] = []
    kept: list[Any] = []
    detector = StepProfiler(
        first_step=4, every=0, device=torch.device(device), log=said.append,
        layers=len(layer_types(config)) or None, peak_flops=peak_flops(torch.device(device)) or None,
        on_events=(lambda events: kept.append(attribute_kernels(events))) if dump is not None else None,
    )
    with arm_tripwires(allow=["*"], source="bench/gpu/train_throughput.py"):
        for step in range(1, 4 + 12):
            b = batches[step % len(batches)]
            detector.run(step, step_fn, b, flops=step_flops(config, b["_seq_lens"]))
            if detector.profiles:
                break
    window = detector.profiles[-1]
    if dump is not None and kept:
        dump.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "step_s": window.step_s, "layers": detector.layers, "peak_flops": detector.peak_flops,
            "flops_per_step": step_flops(config, batches[window.step % len(batches)]["_seq_lens"]),
            "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
            "kernels": [k.to_list() for k in kept[-1]],
        }
        with gzip.open(dump, "wt") as f:
            json.dump(payload, f)
    return {
        **window.record(),
        "says": said,
        "summary": detector.summary(),
        "reference_step_s": window.reference_step_s,
        "profiled_step_s": round(window.wall_s, 4),
        "profiled_at_step": window.step,
    }


def lift_refusal(key_dim: int, device: Any) -> tuple[bool, str]:
    """fla's Hopper refusal, lifted only at key head dim >= 128 (measured correct on the H200)."""
    import torch

    try:
        from fla.ops.common import chunk_o
    except Exception as exc:  # noqa: BLE001 - fla hidden or absent: nothing to lift
        return False, f"fla.ops.common.chunk_o not importable ({type(exc).__name__}); nothing to lift"
    refuses = not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) and bool(
        getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
    )
    if not refuses or torch.device(device).type != "cuda":
        return False, "fla does not refuse on this stack"
    if key_dim < 128:
        raise SystemExit(
            f"fla refuses its gated backward here and key head dim {key_dim} < 128 is where that is justified"
        )
    from kernelguard.resolution.fla_refusal import lift_fla_hopper_refusal

    changed = lift_fla_hopper_refusal()
    return (
        True,
        f"fla's Hopper/Triton<3.7.1 refusal lifted in this process ({', '.join(changed)}); key head dim {key_dim}",
    )


def memory_estimate(cfg: Any, measured: int, device: Any) -> dict[str, Any] | None:
    """kernelguard.train.model.memory's estimate for this configuration next to the measured peak."""
    from kernelguard.train.model.memory import estimate

    est = estimate(cfg, world_size=1)
    return {
        "estimated_peak_bytes": est.peak_bytes,
        "measured_peak_bytes": measured,
        "estimate_over_measured": round(est.peak_bytes / measured, 4) if measured else None,
        "estimate": est.to_dict(),
    }


# ----------------------------------------------------------------------------------------- one variant
def _step_batch(micro: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer step's micro-batches as the profilers' step function takes them (one argument, with the
    step's example lengths for its FLOPs)."""
    return {"_micro": micro, "_seq_lens": [n for b in micro for n in b["_seq_lens"]]}


def train_config(args: argparse.Namespace, variant: Variant, model_path: Path, out_dir: Path) -> Any:
    from kernelguard.train.settings.config import TrainConfig

    return TrainConfig.from_flags(
        model=str(model_path),
        data="unused",
        output=out_dir,
        block_size=args.tokens_per_batch,
        param_dtype="fp32" if args.tiny else "bf16",
        attention=variant.attention,
        activation_checkpointing=variant.activation_checkpointing,
        loss=variant.loss,
        lr=1e-5,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        grad_clip=1.0,
        warmup_steps=0,
        seed=args.seed,
    )


def timed_steps(state: Any, batches: list[list[dict[str, Any]]], device: Any) -> tuple[list[float], list[float]]:
    from kernelguard.train.step.step import optimizer_step

    times, losses = [], []
    for b in batches:
        sync(device)
        t0 = time.perf_counter()
        result = optimizer_step(state, b)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
    return times, losses


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    name, levers = args.variant, [x for x in (args.lever or "").split(",") if x]
    variant = VARIANTS[name]
    hide_packages(set(variant.hide) | set(filter(None, os.environ.get(HIDE_ENV, "").split(","))))
    import torch

    from kernelguard.train.model.parallel import init_distributed
    from kernelguard.train.output.metrics import peak_flops, step_flops

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    result: dict[str, Any] = {"variant": name, "levers": levers, "ok": False, "notes": []}
    apply_levers(levers, result["notes"])
    tmp = Path(tempfile.mkdtemp(prefix="kg-bench-"))
    atexit.register(shutil.rmtree, tmp, True)  # the variant's config and output, read only in this process
    if "tokens2x" in levers:
        args.tokens_per_batch *= 2
    micro = variant.blocks_per_step * (2 if "accum2" in levers else 1)
    config = model_config(args)
    (tmp / "config.json").write_text(json.dumps(config))
    cfg = train_config(args, variant, tmp / "config.json", tmp / "out")
    cfg.runtime.compile = True if "compile" in levers else variant.compile
    cfg.runtime.reshard_after_forward = False if "no_reshard" in levers else True if "reshard" in levers else None
    cfg.runtime.fused_norms = "fused_norms" in levers
    cfg.training.gradient_accumulation_steps = micro
    cfg.runtime.blocks_per_forward = variant.blocks_per_forward
    lifted, note = (
        (False, "fla hidden")
        if "fla" in variant.hide
        else lift_refusal(config["linear_key_head_dim"], device)
    )
    result["notes"].append(note)
    if "fla" not in variant.hide and device.type == "cuda":
        from kernelguard.resolution.fla_autotune import pin_for_this_gpu

        result["notes"].append(pin_for_this_gpu())  # only shortens the warm-up: pins are autotune's own choices
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    info = init_distributed()
    schedule, layout = make_schedule(args, variant, config["vocab_size"], micro=micro)
    baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    from kernelguard.train.model.build import setup_training

    result["kernels"] = which_implementations()  # before a lever wraps the call sites
    t0 = time.perf_counter()
    built, state = setup_training(cfg, info, schedule_steps=len(schedule) + 1)
    setup_s = time.perf_counter() - t0
    result["attention"] = built.attention
    warm, _ = timed_steps(state, schedule[: args.warmup], device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measured = schedule[args.warmup : args.warmup + args.steps]
    times, losses = timed_steps(state, measured, device)
    peak_mem = (torch.cuda.max_memory_allocated(device) - baseline) if device.type == "cuda" else 0

    def one_step(b: dict[str, Any], st: Any = state) -> None:
        from kernelguard.train.step.step import optimizer_step

        optimizer_step(st, b["_micro"])

    try:
        prof = profile_counts(one_step, [_step_batch(m) for m in schedule[args.warmup + args.steps :]], device)
    except Exception as exc:  # noqa: BLE001 - keep the throughput figures even if profiling fails
        prof = {"profiler_error": f"{type(exc).__name__}: {exc}"}
    try:
        if not args.detector:
            raise RuntimeError("skipped (--no-detector)")
        dump = Path(args.profile_dump) / f"{name}.json.gz" if args.profile_dump else None
        result["detector"] = detector_figures(one_step, [_step_batch(m) for m in measured], device,
                                              config=built.config, dump=dump)
    except Exception as exc:  # noqa: BLE001 - keep the throughput figures even if the detector fails
        result["detector"] = {"error": f"{type(exc).__name__}: {exc}"}
    # Warm-up and measured steps together through the one statistic: outliers (autotune, recompile) are listed
    # and excluded, and every figure below is over the steady steps only.
    stats = steady_stats(warm + times, warmup=len(warm))
    timed = schedule[: len(warm)] + measured
    real_per_step = [sum(n for b in m for n in b["_seq_lens"]) for m in timed]
    flops_per_step = [step_flops(built.config, [n for b in m for n in b["_seq_lens"]]) for m in timed]
    real = sum(real_per_step[i] for i in stats.steady)
    total = sum(stats.step_times_s[i] for i in stats.steady)
    tokens_per_s = steady_rate(stats, real_per_step)
    flops_per_s = steady_rate(stats, flops_per_step)
    mm = measure_matmul_tflops(
        device, 256 if args.tiny or device.type != "cuda" else 8192, 5 if device.type != "cuda" else 20
    )
    peak = peak_flops(device)
    result.update(
        {
            "ok": bool(losses) and all(math.isfinite(x) for x in losses),
            "product_path": variant.product_path and not set(levers) - PRODUCT_LEVERS,  # flags of kernelguard train
            "step": "kernelguard.train.step.step.optimizer_step after kernelguard.train.model.build.setup_training "
            f"(FSDP2 fully_shard, world size {info.world_size})",
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "fla_hopper_refusal_lifted": lifted,
            "flags": {
                "attention": cfg.runtime.attention,
                "activation_checkpointing": "auto" if cfg.runtime.activation_checkpointing is None
                else cfg.runtime.activation_checkpointing,
                "activation_checkpointing_applied": built.activation_checkpointing,
                "loss": cfg.runtime.loss,
                "param_dtype": cfg.runtime.param_dtype,
                "layout": variant.layout,
                "levers": levers,
                "reshard_after_forward": built.layout.reshard_after_forward if built.layout else None,
                "micro_batches_per_step": micro,
                "blocks_per_forward_applied": state.blocks_per_forward,
                "compile_applied": built.compiled is not None,
                "step_layout": built.layout.line if built.layout else None,
                "widths": "tiny" if args.tiny else args.widths,
            },
            "config": {**config, "params": sum(p.numel() for p in state.model.parameters())},
            "tokens_per_batch": args.tokens_per_batch,
            "data": layout,
            "batches_per_epoch": layout["batches_per_epoch"],
            "padding_pct": layout["padding_pct"],
            "setup_s": round(setup_s, 2),
            "warmup_steps": args.warmup,
            "warmup_s": round(sum(warm), 2),
            "measured_steps": len(times),
            "steady_steps": len(stats.steady),
            "step_time_s": round(stats.mean_s, 4),
            "step_time_s_median": round(stats.median_s, 4),
            "step_times_s": [round(t, 4) for t in times],
            "step_stats": stats.to_dict(),
            "real_tokens_measured": real,
            "tokens_per_s": round(tokens_per_s, 1),
            "achieved_tflops": round(flops_per_s / 1e12, 3),
            "mfu_datasheet": round(flops_per_s / peak, 4) if peak and total else None,
            "matmul_bf16": {"n": 256 if args.tiny else 8192, "tflops": round(mm, 1)},
            "mfu_vs_measured_matmul": round(flops_per_s / (mm * 1e12), 4) if mm and total else None,
            "flops_source": "kernelguard.train.output.metrics.step_flops (3 x forward, real tokens only; AC recompute not counted)",
            "peak_memory_bytes": int(peak_mem),
            "losses": [round(x, 4) for x in losses],
            **prof,
            "versions": versions(),
        }
    )
    if result.get("gpu_kernel_s_per_step") and result.get("step_time_s"):
        # The profiler slows the host side, so its own wall time overstates idle GPU time; kernel time per
        # step over the unprofiled step time is the better "is the GPU busy" figure.
        result["gpu_busy_fraction"] = round(result["gpu_kernel_s_per_step"] / result["step_time_s"], 3)
    if variant.layout == "packed" and device.type == "cuda" and args.memory_estimate:
        result["memory"] = memory_estimate(cfg, int(peak_mem), device)
    for o in stats.outliers:
        result["notes"].append(f"step {o['step']} took {o['s']} s ({o['x_median']}x the median): outlier, excluded")
    if not stats.enough:
        result["notes"].append(f"only {len(stats.steady)} steady steps (< {stats.min_steady}): not a figure to quote")
    if lifted:
        result["notes"].append("timing obtained with fla's Hopper refusal lifted (Triton path)")
    del state, built
    gc.collect()
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
        for spec in args.variants.split(","):
            name, _, lever = spec.partition("+")  # "product_noac+compile"
            out = Path(tmp) / f"{spec}.json"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--variant",
                name,
                "--out",
                str(out),
                *passthrough,
            ]
            cmd += ["--lever", lever.replace("+", ",")] if lever else []
            print(f"[train_throughput] {spec}: {' '.join(cmd)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, check=False, capture_output=True, text=True, timeout=args.child_timeout
                )
                rc: int | str = proc.returncode
                tail = (proc.stdout + proc.stderr)[-4000:]
            except subprocess.TimeoutExpired as exc:
                rc, tail = "timeout", str(exc)[-4000:]
            elapsed = round(time.perf_counter() - t0, 1)
            if out.exists():
                combined["variants"][spec] = {**json.loads(out.read_text()), "process_s": elapsed}
            if rc != 0 or not out.exists():
                combined["errors"][spec] = {"returncode": rc, "process_s": elapsed, "output_tail": tail}
            print(f"[train_throughput] {spec}: rc={rc} in {elapsed}s", file=sys.stderr, flush=True)
            summarize(combined)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(combined, indent=2, default=str))  # partial results survive a kill
    return combined


def summarize(combined: dict[str, Any]) -> None:
    tps = {v: r.get("tokens_per_s") for v, r in combined["variants"].items() if r.get("tokens_per_s")}
    combined["tokens_per_s"] = tps
    for base in ("fallback", "stock_best"):
        if base in tps:
            combined[f"speedup_vs_{base}"] = {v: round(t / tps[base], 3) for v, t in tps.items()}
    combined["mfu_vs_measured_matmul"] = {
        v: r.get("mfu_vs_measured_matmul") for v, r in combined["variants"].items()
    }
    combined["detector"] = {
        v: {k: r["detector"].get(k) for k in ("verdict", "verdict_line", "gpu_busy_pct", "reference_pct",
                                                  "gpu_time_by_class_pct", "kernels_per_step", "kernels_per_layer",
                                                  "profile_mfu", "cpu_s_per_step", "profile_overhead_s")}
        for v, r in combined["variants"].items()
        if isinstance(r.get("detector"), dict)
    }
    combined["step_stats"] = {
        v: {k: r["step_stats"].get(k) for k in ("median_s", "min_s", "max_s", "steady_steps", "outliers")}
        for v, r in combined["variants"].items()
        if r.get("step_stats")
    }
    combined["note"] = (
        "Ratios are only meaningful within this one run/machine (the fallback is CPU-launch-bound). "
        "Variants with fla_hopper_refusal_lifted=true ran fla's Triton backward past its Hopper refusal."
    )


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--variant", choices=sorted(VARIANTS))
    g.add_argument("--all", action="store_true", help="run --variants, each in a fresh subprocess")
    p.add_argument(
        "--variants",
        default="fallback,stock_best,stock_defaults,product,product_noac",
        help="comma list; NAME+LEVER[+LEVER] adds levers (e.g. product_noac+compile)",
    )
    p.add_argument("--lever", default="", help=f"comma list of {', '.join(LEVERS)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model/data for a CPU logic check")
    p.add_argument("--steps", type=int, default=12, help="timed steps after warm-up (>= 10 steady steps wanted)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--profile-dump", default=None, help="folder for each variant's profiled kernels (json.gz)")
    p.add_argument("--tokens-per-batch", type=int, default=None)
    p.add_argument("--examples", type=int, default=None, help="synthetic epoch size (layout statistics)")
    p.add_argument("--median-len", type=float, default=None)
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--widths", choices=("proxy", "27b"), default="proxy",
                   help="proxy: the 1.16 B model of the flags below; 27b: Qwen3.5-27B's widths, --layers layers")
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
    p.add_argument("--no-memory-estimate", dest="memory_estimate", action="store_false")
    p.add_argument("--no-detector", dest="detector", action="store_false",
                   help="skip the step diagnosis window (its ~15 extra steps); the profile's class table stays")
    p.add_argument("--child-timeout", type=int, default=300)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    bad = [x for x in args.lever.split(",") if x and x not in LEVERS]
    if bad:
        p.error(f"unknown lever(s) {bad}; known: {', '.join(LEVERS)}")
    if args.tokens_per_batch is None:
        args.tokens_per_batch = 256 if args.tiny else 8192
    if args.median_len is None:
        args.median_len = 40.0 if args.tiny else 1100.0
    if args.examples is None:
        args.examples = 200 if args.tiny else 4000
    return args, _strip(raw, {"--all": 0, "--variants": 1, "--out": 1, "--child-timeout": 1, "--lever": 1})


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
        result, rc = {"variant": args.variant, "ok": False, "error": str(exc.code)}, 1
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
    keys = (
        "variant",
        "levers",
        "ok",
        "tokens_per_s",
        "step_time_s",
        "mfu_vs_measured_matmul",
        "gpu_busy_fraction",
        "peak_memory_bytes",
        "padding_pct",
        "fla_hopper_refusal_lifted",
        "error",
    )
    if args.all:
        print(
            json.dumps(
                {
                    k: result.get(k)
                    for k in ("tokens_per_s", "speedup_vs_fallback", "speedup_vs_stock_best", "detector", "errors")
                },
                default=str,
            )
        )
    else:
        summary = {k: result.get(k) for k in keys if k in result}
        if result.get("memory"):
            summary["memory_estimate_over_measured"] = result["memory"]["estimate_over_measured"]
        print(json.dumps(summary))
    return rc


if __name__ == "__main__":
    sys.exit(main())
