"""Cost per call of the packed-row boundary check (kernelguard.runtime.boundaries), on CPU or CUDA (no timing asserts).

    python bench/cpu/boundaries_cost.py [--tiny] [--device cpu|cuda] [--out FILE]

Two measurements, each a median over repeats:
* the hook alone (``BoundaryCheck.check_call``) with the kwargs of each batch kind: a bounded packed row (both
  boundaries present: dict reads only), a row with position ids and no boundaries (the row is counted: one device
  read on CUDA), a padded batch (an attention mask: nothing counted), no position ids at all;
* a whole forward of a mid-size hybrid model, watched vs not, A/B interleaved, per batch kind.

On CPU the fake fla / causal-conv1d (tests/fake_providers) stand in for the kernels; on CUDA the real ones are
used when importable. Writes JSON to --out (default: $OUT/boundaries_cost.json when $OUT is set, else stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
sys.path[:0] = [str(REPO), str(TESTS)]

SIZE: dict[str, Any] = {  # ~20M parameters: 6 GDN + 2 full-attention layers
    "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "vocab_size": 4096,
}


def _batches(tokens: int, device: str, vocab: int) -> dict[str, dict[str, Any]]:
    import torch

    lengths = [tokens // 4, tokens // 4, tokens // 2]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1], tokens], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lengths))[None]
    ids = torch.randint(0, vocab, (1, tokens))
    batches = {
        "bounded_packed_row": {"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": cu,
                               "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
                               "seq_idx": seq_idx},
        "single_row_with_position_ids": {"input_ids": ids, "position_ids": torch.arange(tokens)[None]},
        "padded_batch": {"input_ids": ids.view(2, -1), "attention_mask": torch.ones(2, tokens // 2, dtype=torch.long)},
        "no_position_ids": {"input_ids": ids},
    }
    return {k: {n: v.to(device) if hasattr(v, "to") else v for n, v in b.items()} for k, b in batches.items()}


def _median_us(fn: Any, repeats: int, inner: int, sync: Any) -> float:
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, few repeats (a smoke run)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 64 tiny, 1024 else)")
    args = parser.parse_args()
    if args.device == "cpu" or args.tiny:
        sys.path.insert(0, str(TESTS / "fake_providers"))
    import tiny_models
    import torch

    from kernelguard.resolution.policy import AllowPolicy
    from kernelguard.runtime.boundaries import watch_boundaries
    from kernelguard.runtime.model_guard import inspect

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    size = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]} if args.tiny else SIZE
    tokens = args.tokens or (64 if args.tiny else 1024)
    repeats, inner, forwards = (3, 50, 3) if args.tiny else (9, 500, 6)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = tiny_models.tiny_model("qwen3_5", **size).to(args.device, dtype)
    report = inspect(model, packed=False)
    batches = _batches(tokens, args.device, model.config.vocab_size)
    result: dict[str, Any] = {
        "device": args.device, "torch": torch.__version__, "tiny": args.tiny, "tokens": tokens,
        "providers": sorted({f"{e.kernel}: {e.implementation}" for e in report.kernel_sites}),
        "hook_us": {}, "forward_ms": {},
    }
    watch = watch_boundaries(model, AllowPolicy())
    assert watch is not None
    watch.disarm()  # measured by hand below; the forward A/B arms it per sample
    for name, batch in batches.items():
        result["hook_us"][name] = _median_us(lambda b=batch: watch.check.check_call((), b), repeats, inner, sync)
    with torch.no_grad():
        for name, batch in batches.items():
            timings: dict[str, list[float]] = {"unwatched": [], "watched": []}
            for i in range(forwards * 2):
                watched = i % 2 == 1
                armed = watch_boundaries(model, AllowPolicy()) if watched else None
                sync()
                start = time.perf_counter()
                model(**batch)
                sync()
                timings["watched" if watched else "unwatched"].append((time.perf_counter() - start) * 1e3)
                if armed is not None:
                    armed.disarm()
            result["forward_ms"][name] = {k: statistics.median(v[1:] or v) for k, v in timings.items()}
        result["steady_forward_ms"] = _steady(model, batches["bounded_packed_row"], forwards, sync)
    text = json.dumps(result, indent=2)
    out = args.out or (Path(os.environ["OUT"]) / "boundaries_cost.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def _steady(model: Any, batch: dict[str, Any], forwards: int, sync: Any) -> dict[str, Any]:
    """Calls past the first host reads (the 8 first calls, and every 64th, read the row on the host; the calls
    between compare the boundary signals on the device only): one watch armed per block, its first calls not
    timed, then ``forwards`` timed calls, then as many unwatched ones; medians over the blocks' calls."""
    from kernelguard.resolution.policy import AllowPolicy
    from kernelguard.runtime.boundaries import watch_boundaries

    timings: dict[str, list[float]] = {"unwatched": [], "watched": []}
    for _ in range(3):
        armed = watch_boundaries(model, AllowPolicy())
        for _ in range(9):
            model(**batch)
        for kind in ("watched", "unwatched"):
            for _ in range(forwards):
                sync()
                start = time.perf_counter()
                model(**batch)
                sync()
                timings[kind].append((time.perf_counter() - start) * 1e3)
            if kind == "watched" and armed is not None:
                armed.disarm()
    medians = {k: statistics.median(v) for k, v in timings.items()}
    return medians | {"added_ms": medians["watched"] - medians["unwatched"], "calls": {k: v for k, v in timings.items()}}


if __name__ == "__main__":
    main()
