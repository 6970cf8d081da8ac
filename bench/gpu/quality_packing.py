"""Does packing preserve quality? The same model, data, steps and schedule, trained packed and padded.

A learnable synthetic chat task (multi-turn: the user sends a sequence of "words", the assistant answers with
the same words through a fixed substitution cipher, so learning it needs attention over the turn), with example
lengths drawn lognormal (median ~1,100 tokens). Loss only on assistant tokens, normalised per token over the
step. The two variants differ ONLY in the batch layout:

  packed   kernelguard's layout: each step is one [1, block] row of whole examples (best-fit-decreasing), with
           position ids restarting per example, cu_seq_lens/max_length/seq_idx, varlen attention
           (kernelguard_varlen), no attention mask;
  padded   the SAME examples of the SAME step as a [B, max_len] right-padded batch with an attention mask
           (SDPA), i.e. what training without packing does.

Same init (seed), same optimizer and LR schedule, same per-token normalisation. Eval: a held-out set, one
example at a time (no packing, no padding), so eval is layout-independent. Goal (issue 11): final eval loss of
packed within 1% of padded. Prints one JSON object; ``--out DIR`` also writes it and a PNG of both curves.

CPU smoke: ``python bench/gpu/quality_packing.py --tiny --steps 12`` (torch reference kernels, sdpa for both).
Step times (training only) go through bench/lib/step_stats.py: step 0 is warm-up, outliers are excluded.
GPU: ``python bench/gpu/quality_packing.py --steps 500 --out $OUT/quality`` (fla + causal-conv1d, refusal lifted at
key head dim 128 where fla 0.6.0 refuses on Hopper with Triton < 3.7.1; stated in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "lib"))
from step_stats import steady_rate, steady_stats

from kernelguard.resolution.packed_batch import IGNORE_INDEX, MODEL_INPUT_KEYWORDS
from kernelguard.train.step.loss import linear_cross_entropy
from kernelguard.train.step.packing import build_packed_block, pack_best_fit_decreasing

USER, ASSISTANT, END = 10, 11, 12  # marker tokens
WORDS_FROM = 1000  # the alphabet of "words" starts here


def proxy_config(args: argparse.Namespace) -> Any:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    layers = args.layers
    return Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=layers, num_attention_heads=args.attn_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, linear_num_key_heads=args.linear_key_heads,
        linear_num_value_heads=args.linear_value_heads, linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=32768, tie_word_embeddings=False,
    )


# ----------------------------------------------------------------------------------------------- data ---
def make_conversation(rng: random.Random, length: int, alphabet: int, cipher: list[int]) -> tuple[list[int], list[int]]:
    """Turns of [USER w1..wn ASSISTANT c(w1)..c(wn) END] until ``length`` tokens; labels on the answers only."""
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < length:
        n = max(4, min(int(rng.lognormvariate(math.log(60), 0.5)), (length - len(ids)) // 2 - 2))
        words = [rng.randrange(alphabet) for _ in range(n)]
        prompt = [USER, *(WORDS_FROM + w for w in words), ASSISTANT]
        answer = [*(WORDS_FROM + cipher[w] for w in words), END]
        ids += prompt + answer
        labels += [IGNORE_INDEX] * len(prompt) + answer
        if n < 8:
            break
    return ids, labels


def make_dataset(count: int, seed: int, block: int, median: int, alphabet: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    cipher = list(range(alphabet))
    random.Random(1234).shuffle(cipher)  # the task is the same for train and eval
    out = []
    for _ in range(count):
        length = min(block, max(32, int(rng.lognormvariate(math.log(median), 0.6))))
        ids, labels = make_conversation(rng, length, alphabet, cipher)
        out.append((ids[:block], labels[:block]))
    return out


def step_groups(examples: list[tuple[list[int], list[int]]], block: int, steps: int, seed: int) -> list[list[int]]:
    blocks = pack_best_fit_decreasing([len(ids) for ids, _ in examples], block, seed=seed)
    random.Random(seed).shuffle(blocks)
    if len(blocks) < steps:
        raise SystemExit(f"only {len(blocks)} blocks for {steps} steps: raise --examples")
    return blocks[:steps]


def packed_batch(examples: list[tuple[list[int], list[int]]], group: list[int], block: int, device: str) -> dict[str, Any]:
    built = build_packed_block([examples[i] for i in group], block, pad_token_id=0)
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in built.items() if k in MODEL_INPUT_KEYWORDS}
    return {"inputs": inputs, "labels": built["labels"].to(device)}


def padded_batch(examples: list[tuple[list[int], list[int]]], group: list[int], device: str) -> dict[str, Any]:
    rows = [examples[i] for i in group]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(rows):
        n = len(row_ids)
        ids[r, :n] = torch.tensor(row_ids)
        mask[r, :n] = 1
        labels[r, 1:n] = torch.tensor(row_labels[1:])  # as the packed layout: the first token never counts
    inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    return {"inputs": inputs, "labels": labels.to(device)}


# ---------------------------------------------------------------------------------------------- train ---
def token_loss(model: Any, inputs: dict[str, Any], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    # The chunked loss multiplies in one dtype: the head in the activations' (bf16 under autocast), as FSDP2's
    # mixed precision hands it to the product's loss; the cast is differentiable, master weights stay fp32.
    return linear_cross_entropy(h, model.lm_head.weight.to(h.dtype), labels[:, 1:].reshape(-1))


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: Any, evalset: list[tuple[list[int], list[int]]], device: str, dtype: torch.dtype) -> float:
    model.eval()
    total, count = 0.0, 0
    for ids, labels in evalset:
        inputs = {"input_ids": torch.tensor([ids], device=device)}
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum, n = token_loss(model, inputs, torch.tensor([labels], device=device))
        total += float(loss_sum)
        count += int(n)
    model.train()
    return total / count


def train_variant(variant: str, args: argparse.Namespace, config: Any, data: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device, dtype = args.device, (torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    config._attn_implementation = data["attention"] if variant == "packed" else "sdpa"
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    examples, groups = data["train"], data["groups"]
    curve, evals = [], []
    start = time.perf_counter()
    # Where the time goes, so a slow run explains itself: the first step pays Triton compile/autotune per new
    # kernel config; eval runs one unpadded example at a time (each a new length).
    timing = {"first_step_s": 0.0, "eval_s": 0.0}
    real_tokens = padded_tokens = 0
    step_times, step_tokens = [], []  # training only (no eval): what bench/lib/step_stats.py summarises
    for step, group in enumerate(groups):
        step_start = time.perf_counter()
        batch = packed_batch(examples, group, args.block, device) if variant == "packed" \
            else padded_batch(examples, group, device)
        real_tokens += sum(len(examples[i][0]) for i in group)
        padded_tokens += batch["inputs"]["input_ids"].numel()
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, len(groups), args.warmup, args.lr)
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum, count = token_loss(model, batch["inputs"], batch["labels"])
        loss = loss_sum / count.clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(round(float(loss.detach()), 5))  # a host sync per step: both variants pay it alike
        step_times.append(time.perf_counter() - step_start)
        step_tokens.append(sum(len(examples[i][0]) for i in group))
        if step == 0:
            timing["first_step_s"] = time.perf_counter() - start
        if (step + 1) % args.eval_every == 0 or step + 1 == len(groups):
            eval_start = time.perf_counter()
            evals.append({"step": step + 1, "eval_loss": round(evaluate(model, data["eval"], device, dtype), 5)})
            timing["eval_s"] += time.perf_counter() - eval_start
            print(json.dumps({"variant": variant, **evals[-1], "train_loss": curve[-1],
                              "elapsed_s": round(time.perf_counter() - start, 1),
                              **{k: round(v, 1) for k, v in timing.items()}}), flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    # The steady training time: wall minus the first step (compile/autotune) and the evals.
    timing["steady_train_s"] = wall - timing["first_step_s"] - timing["eval_s"]
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
    stats = steady_stats(step_times, warmup=1)  # step 0 pays Triton compile/autotune
    return {"step_stats": stats.to_dict(), "tokens_per_s": round(steady_rate(stats, step_tokens), 1),
            "train_loss": curve, "eval": evals, "final_eval_loss": evals[-1]["eval_loss"], "wall_s": round(wall, 1),
            "real_tokens": real_tokens, "tensor_tokens": padded_tokens,
            "padding": round(1 - real_tokens / padded_tokens, 4), "attention": config._attn_implementation,
            **{k: round(v, 1) for k, v in timing.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = proxy_config(args)
    lifted = []
    if args.device == "cuda":
        from kernelguard.resolution.fla_refusal import lift_fla_hopper_refusal

        try:
            lifted = lift_fla_hopper_refusal()  # key head dim 128: outside fla #640's tile-64 bug (bench/RESULTS.md)
        except ImportError:
            lifted = []
    pins = ""
    if args.device == "cuda":
        from kernelguard.resolution.fla_autotune import pin_for_this_gpu

        pins = pin_for_this_gpu()  # the recorded fla autotune choices: no minutes of autotuning per variant
        print(pins, flush=True)
    from kernelguard.runtime.attention import register_varlen_attention

    attention = register_varlen_attention(device_type=args.device)
    train = make_dataset(args.examples, args.seed, args.block, args.median, args.alphabet)
    evalset = make_dataset(args.eval_examples, args.seed + 1, args.block, args.median, args.alphabet)
    data = {"train": train, "eval": evalset, "groups": step_groups(train, args.block, args.steps, args.seed),
            "attention": attention}
    results = {v: train_variant(v, args, config, data) for v in ("packed", "padded")}
    packed, padded = results["packed"]["final_eval_loss"], results["padded"]["final_eval_loss"]
    summary = {
        "bench": "quality_packing", "config": vars(args), "fla_refusal_lifted_in": lifted, "fla_pins": pins,
        "versions": _versions(), "steps": len(data["groups"]),
        "final_eval_loss": {"packed": packed, "padded": padded},
        "relative_difference": round(abs(packed - padded) / padded, 5),
        "within_1_percent": abs(packed - padded) / padded <= 0.01,
        "wall_s": {v: results[v]["wall_s"] for v in results},
        "tokens_per_s": {v: results[v]["tokens_per_s"] for v in results},
        "time_split_s": {v: {k: results[v][k] for k in ("first_step_s", "eval_s", "steady_train_s")} for v in results},
        "padding": {v: results[v]["padding"] for v in results}, "results": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality_packing.json").write_text(json.dumps(summary, indent=1))
        _plot(results, out / "quality_packing.png")
    return 0


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "triton", "fla-core", "causal-conv1d"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _plot(results: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant, style in (("packed", "-"), ("padded", "--")):
        r = results[variant]
        ax.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], style, alpha=0.35, label=f"{variant} train")
        ax.plot([e["step"] for e in r["eval"]], [e["eval_loss"] for e in r["eval"]], style + "o",
                label=f"{variant} eval ({r['wall_s']} s)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss per assistant token")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model and data for a CPU smoke run")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--block", type=int, default=8192)
    p.add_argument("--examples", type=int, default=4200)
    p.add_argument("--eval-examples", type=int, default=48)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--median", type=int, default=1100)
    p.add_argument("--alphabet", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    for name, default in (("layers", 8), ("hidden", 2048), ("intermediate", 6144), ("attn-heads", 16),
                          ("kv-heads", 2), ("head-dim", 128), ("linear-key-heads", 16), ("linear-value-heads", 32),
                          ("linear-head-dim", 128), ("vocab", 151936)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    if args.tiny:
        args.__dict__.update(layers=4, hidden=64, intermediate=128, attn_heads=4, kv_heads=2, head_dim=16,
                             linear_key_heads=2, linear_value_heads=4, linear_head_dim=16, vocab=2048, block=512,
                             median=80, examples=max(args.examples if args.examples != 4200 else 0, 120),
                             eval_examples=8, eval_every=2, dtype="fp32", alphabet=64, warmup=2)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
