#!/usr/bin/env python
"""Packed vs unpacked loss and gradients of a Qwen3.5-shaped proxy with the REAL kernels (GPU).

The same examples are run (1) one by one, unpacked, and (2) packed into one 1D block with kernelguard's
boundary kwargs (cu_seq_lens, max_length, seq_idx, per-example position_ids) through fla, causal-conv1d and
the kernelguard_varlen attention; (3) the same block WITHOUT the boundary kwargs shows what leakage looks
like. Prints JSON: relative error of the summed loss and of the gradient norm-wise, per variant.

    python bench/gpu/packed_vs_unpacked.py --out packed_vs_unpacked.json [--dtype bf16|fp32]

On Hopper with Triton < 3.7.1, fla 0.6.0 refuses its gated backward (fla #640); this script lifts the
refusal because the proxy's key head dim is 128 (measured correct, bench/gpu/kernel_numerics.py) and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--lengths", default="700,1500,333,2048,901,64,1200")
    args = parser.parse_args()

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from kernelguard.resolution.packed_batch import MODEL_INPUT_KEYWORDS
    from kernelguard.runtime.attention import register_varlen_attention
    from kernelguard.runtime.model_guard import guard
    from kernelguard.stack.numerics import lift_fla_hopper_refusal
    from kernelguard.train.step.packing import build_packed_block

    lifted = lift_fla_hopper_refusal()
    attn = register_varlen_attention(device_type="cuda")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM._from_config(config, attn_implementation=attn).to("cuda", dtype)
    report = guard(model, mode="training", packed=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    gen = torch.Generator().manual_seed(1)
    examples = []
    for n in lengths:
        ids = torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()
        examples.append((ids, list(ids)))

    def grads() -> torch.Tensor:
        flat = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    def summed_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].float().reshape(-1, logits.shape[-1])
        shift_labels = labels[..., 1:].reshape(-1)
        return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")

    # (1) unpacked, one example at a time; sum of per-token losses
    start = time.perf_counter()
    total = torch.zeros((), device="cuda")
    for ids, labels in examples:
        x = torch.tensor([ids], device="cuda")
        y = torch.tensor([labels], device="cuda")
        loss = summed_loss(model(input_ids=x).logits, y)
        loss.backward()
        total += loss.detach()
    unpacked_grad, unpacked_loss = grads(), total.item()
    unpacked_s = time.perf_counter() - start

    block_size = sum(lengths) + 100  # leaves a padding tail, as real blocks do
    block = build_packed_block(examples, block_size, pad_token_id=0)
    inputs = {k: (v.to("cuda") if torch.is_tensor(v) else v) for k, v in block.items() if k in MODEL_INPUT_KEYWORDS}
    labels = block["labels"].to("cuda")

    def packed(with_boundaries: bool) -> tuple[float, torch.Tensor]:
        kwargs = dict(inputs)
        if not with_boundaries:
            for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
                kwargs.pop(key, None)
        loss = summed_loss(model(**kwargs).logits, labels)
        loss.backward()
        return loss.item(), grads()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    start = time.perf_counter()
    packed_loss, packed_grad = packed(True)
    packed_s = time.perf_counter() - start
    report.disarm()  # the leak case below is a deliberate slow/wrong path
    leak_loss, leak_grad = packed(False) if attn != "kernelguard_varlen" else _leak_with_sdpa(model, packed)
    result = {
        "config": config.to_diff_dict(),
        "dtype": args.dtype,
        "attention": attn,
        "fla_hopper_refusal_lifted": bool(lifted),
        "guard_ok": bool(getattr(report, "ok", True)),
        "lengths": lengths,
        "block_size": block_size,
        "loss_unpacked_sum": unpacked_loss,
        "loss_packed_sum": packed_loss,
        "loss_rel_error": abs(packed_loss - unpacked_loss) / abs(unpacked_loss),
        "grad_rel_error": rel(packed_grad, unpacked_grad),
        "without_boundary_kwargs": {
            "loss_rel_error": abs(leak_loss - unpacked_loss) / abs(unpacked_loss),
            "grad_rel_error": rel(leak_grad, unpacked_grad),
        },
        "seconds": {"unpacked_first_call_included": unpacked_s, "packed": packed_s},
        "versions": _versions(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    return 0


def _leak_with_sdpa(model, packed):  # type: ignore[no-untyped-def]
    """Without cu_seq_lens the varlen attention has nothing to go on: run the leak case with sdpa attention,
    which sees only position_ids, as stock packing does."""
    model.config._attn_implementation = "sdpa"
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = "sdpa"
    return packed(False)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "triton", "transformers", "fla-core", "causal-conv1d"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


if __name__ == "__main__":
    sys.exit(main())
