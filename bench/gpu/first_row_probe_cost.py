"""What the first-row probe (kernelguard.runtime.equivalence) costs, and what it measures, on this machine.

One packed row of real-length examples (lognormal lengths, median ~1,100 tokens, as bench/gpu/train_throughput.py)
through a Qwen3.5-shaped model: the guarded model's first forward with the probe and without it (each on a fresh
guard, medians of --repeats), against one training step (forward + backward) of the same row. Also the probe's
own figures: per layer, the first example's difference (rounding) and the largest later one, for a correct row;
then (``control``) the same row with every GDN kernel call stripped of its ``cu_seqlens`` (what a kernel that
ignores its boundaries does; no static check sees it): the probe must refuse that row.

  python bench/gpu/first_row_probe_cost.py --tiny            # CPU, fake providers, seconds
  python bench/gpu/first_row_probe_cost.py --device cuda     # GPU: real fla / causal-conv1d, the proxy widths

Writes one JSON object to --out (default: stdout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _model(args: argparse.Namespace) -> Any:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    widths = {} if args.tiny else {
        "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 128, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "vocab_size": 151936,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    }
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return tiny_models.tiny_model("qwen3_5", **widths).to(args.device, dtype)


def _row(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < args.tokens:
        n = int(torch.empty(1).log_normal_(7.0, 0.8, generator=g).clamp(16, 4096)) if not args.tiny else 8 + len(lengths)
        lengths.append(min(n, args.tokens - sum(lengths)))
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    row = {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
           "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
           "seq_idx": torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), cu.diff())[None]}
    return {k: v.to(args.device) if hasattr(v, "to") else v for k, v in row.items()}


def _strip_cu_seqlens(model: Any) -> int:
    """The negative control: every GDN layer's module-level kernel call gets ``cu_seqlens=None`` from now on, so
    its state runs on from one packed example into the next. Returns how many call sites were wrapped."""
    import functools

    from kernelguard.resolution import transformers_compat as compat

    wrapped = 0
    for module in model.modules():
        for site in compat.layer_global_sites(module):
            names = sys.modules[site.module].__dict__
            original = names[site.name]
            if site.closure.kernel != "chunk_gated_delta_rule" or getattr(original, "kernelguard_leak", False):
                continue

            @functools.wraps(original)
            def leaking(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                return _original(*args, **{**kwargs, "cu_seqlens": None})

            leaking.kernelguard_leak = True  # type: ignore[attr-defined]
            names[site.name] = leaking
            wrapped += 1
    return wrapped


def _control(model: Any, row: dict[str, Any], allow: list[str]) -> dict[str, Any]:
    """The probe on the leaking model: the refusal's first sentence, or what it measured when it passed."""
    import torch

    from kernelguard.errors import PackedWithoutBoundariesError
    from kernelguard.runtime.model_guard import guard
    from kernelguard.runtime.registry import REGISTRY

    sites = _strip_cu_seqlens(model)
    report = guard(model, packed=True, allow=allow, first_row_probe=True)
    try:
        with torch.no_grad():
            model(**row, use_cache=False)
    except PackedWithoutBoundariesError as e:
        layers = e.details.get("layers", [])
        return {"sites_stripped": sites, "refused": True, "message": e.message.split(". ")[0],
                "layers": [{"layer": d[0], "first_example": d[1], "worst_later": d[2], "tolerance": d[3]}
                           for d in layers]}
    finally:
        REGISTRY.reset()
    watch = report.boundaries
    measured = watch.probes[0].measured if watch and watch.probes else []
    return {"sites_stripped": sites, "refused": False,
            "layers": [{"layer": d.layer, "first_example": d.reference, "worst_later": d.worst,
                        "tolerance": d.tolerance} for d in measured]}


def _timed(fn: Any, device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.tokens = args.tokens or (96 if args.tiny else 8192)
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests" / "fake_providers"))
    import torch

    from kernelguard.runtime.model_guard import guard
    from kernelguard.runtime.registry import REGISTRY

    if args.device == "cuda":  # key head dim 128: fla's Hopper backward is correct there (bench/RESULTS.md)
        from kernelguard.resolution.fla_refusal import lift_for_accepted_issues

        lift_for_accepted_issues(["fla-640-refusal", "fla-640-wrong-grads"])
    model = _model(args)
    row = _row(args, model.config.vocab_size)
    allow = ["attention"] if model.config._attn_implementation in ("sdpa", "eager") else []

    def first_forward(probe: bool) -> tuple[float, Any]:
        report = guard(model, packed=True, allow=allow, first_row_probe=probe)
        try:
            with torch.no_grad():
                return _timed(lambda: model(**row, use_cache=False), args.device), report.boundaries
        finally:
            REGISTRY.reset()

    def step() -> None:
        model(**row, use_cache=False).logits.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    first_forward(False), _timed(step, args.device)  # warm-up: compilation, autotuning, allocator
    plain = [first_forward(False)[0] for _ in range(args.repeats)]
    probed, watch = [], None
    for _ in range(args.repeats):
        t, watch = first_forward(True)
        probed.append(t)
    steps = [_timed(step, args.device) for _ in range(args.repeats)]
    measured = watch.probes[0].measured if watch and watch.probes else []
    result = {
        "device": args.device, "dtype": args.dtype, "tiny": args.tiny, "tokens": row["input_ids"].shape[1],
        "examples": int(row["cu_seq_lens_q"].numel() - 1), "layers": model.config.num_hidden_layers,
        "forward_s": statistics.median(plain), "forward_with_probe_s": statistics.median(probed),
        "train_step_s": statistics.median(steps),
        "probe_s": statistics.median(probed) - statistics.median(plain),
        "raw": {"forward_s": plain, "forward_with_probe_s": probed, "train_step_s": steps},
        "probe": [{"layer": d.layer, "first_example": d.reference, "worst_later": d.worst, "tolerance": d.tolerance,
                   "example": d.example} for d in measured],
    }
    result["probe_vs_step"] = result["probe_s"] / result["train_step_s"]
    result["control"] = _control(model, row, allow)  # last: it changes the model's kernel calls for good
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
