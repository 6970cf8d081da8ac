"""Tiny, offline fixtures for the `kernelguard train` tests: a char-level chat tokenizer, a tiny qwen3_5
config.json, and chat data files."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
FAKE_PROVIDERS = TESTS_DIR / "fake_providers"

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 272  # 256 byte-level symbols + 3 specials, rounded up


def write_tokenizer(path: Path) -> Path:
    """Byte-level BPE without merges (one token per byte) + ChatML specials; loads with AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 1 << 20,
            }
        )
    )
    return path


def write_model_config(path: Path, **overrides: Any) -> Path:
    """A tiny qwen3_5 config.json (random init in `kernelguard train`)."""
    import tiny_models

    values: dict[str, Any] = {"vocab_size": VOCAB_SIZE, "pad_token_id": 0, "eos_token_id": 2}
    values.update(overrides)
    config = tiny_models.tiny_config("qwen3_5", **values)
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(path / "config.json"))
    return path / "config.json"


def copy_task_rows(n: int, *, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[dict[str, Any]]:
    """A learnable task: the assistant repeats the user's random lowercase string."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(min_len, max_len)))
        msgs = [{"role": "user", "content": s}, {"role": "assistant", "content": s}]
        if rng.random() < 0.3:
            msgs = [{"role": "system", "content": "copy"}, *msgs]
        rows.append({"messages": msgs})
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_train_assets(root: Path, rows: int = 400) -> dict[str, Path]:
    """The byte-level tokenizer, a tiny model config and ``rows`` copy-task rows under ``root``."""
    return {
        "root": root,
        "tok": write_tokenizer(root / "tok"),
        "model": write_model_config(root / "model"),
        "data": write_jsonl(root / "data.jsonl", copy_task_rows(rows)),
    }


def run_train(
    args: list[str], *, fakes: bool = True, nproc: int = 2, timeout: int = 240, cuda: bool = False,
    fault: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run --nproc-per-node N --standalone -m kernelguard.train ARGS`, on CPU
    unless ``cuda`` (``nproc=0``: plain `python -m kernelguard.train ARGS`, one process); ``fault``: a
    tests/fault_hooks fault (``KERNELGUARD_FAULT``) in every process."""
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(FAKE_PROVIDERS)] if fakes else [])
    if fault:
        paths.append(str(TESTS_DIR / "fault_hooks"))
        env["KERNELGUARD_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"] if nproc else []
    cmd = [sys.executable, *launcher, "-m", "kernelguard.train", *args]
    return subprocess.run(
        cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(REPO)
    )
