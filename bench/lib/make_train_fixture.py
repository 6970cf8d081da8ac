#!/usr/bin/env python
"""Write an offline fixture for a real `kernelguard train` run: tokenizer, Qwen3.5-shaped proxy config, chat data.

    python bench/lib/make_train_fixture.py DIR [--examples 3000] [--hidden 2048 --layers 8]

DIR/tokenizer (byte-level, ChatML template), DIR/model/config.json (random init), DIR/chat.jsonl whose
example lengths follow a lognormal (median ~1,100 tokens), the distribution of bench/gpu/train_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(1, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()

    from train_helpers import VOCAB_SIZE, write_tokenizer
    from transformers import Qwen3_5TextConfig

    write_tokenizer(args.dir / "tokenizer")
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)]
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers, layer_types=layer_types, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, pad_token_id=0, eos_token_id=2, use_cache=False,
    )
    (args.dir / "model").mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(args.dir / "model" / "config.json"))

    rng = random.Random(0)
    with (args.dir / "chat.jsonl").open("w") as out:
        for _ in range(args.examples):
            total = min(8000, max(40, int(rng.lognormvariate(7.0, 0.6))))  # bytes ~ tokens here
            user = "".join(rng.choice("abcdefghij ") for _ in range(total // 3))
            answer = "".join(rng.choice("abcdefghij ") for _ in range(total - total // 3))
            out.write(json.dumps({"messages": [{"role": "user", "content": user},
                                               {"role": "assistant", "content": answer}]}) + "\n")
    print(f"wrote {args.dir}: {args.examples} chats, {args.layers} layers, hidden {args.hidden}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
