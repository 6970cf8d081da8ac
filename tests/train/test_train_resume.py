"""End to end on CPU with 2 gloo ranks: eval loss equals a hand computation over the held-out blocks; a damaged
newest checkpoint is named and skipped and the resumed run is still exact; retention; a different run or an
occupied folder is refused through the CLI without touching the folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, EVAL_FRACTION = 6, 3, 0.1


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return h.write_train_assets(tmp_path_factory.mktemp("resume"))


def _args(assets: dict[str, Path], output: Path, *extra: str) -> list[str]:
    return [
        "--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
        "--output-dir", str(output), "--block-size", "256", "--param-dtype", "fp32", "--learning-rate", "3e-3",
        "--schedule-steps", "8", "--warmup-steps", "1", "--no-progress", "--no-plot", "--allow", "attention",
        "--eval-fraction", str(EVAL_FRACTION), "--eval-every", str(EVAL_EVERY), *extra,
    ]  # fmt: skip


def _records(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def full_run(assets: dict[str, Path]) -> Path:
    out = assets["root"] / "full"
    r = h.run_train(_args(assets, out, "--max-steps", str(STEPS)))
    assert r.returncode == 0, r.stderr
    return out


def test_eval_loss_equals_a_hand_computed_loss_on_the_eval_blocks(
    assets: dict[str, Path], full_run: Path, fake_providers: Any
) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from kernelguard.resolution.packed_batch import IGNORE_INDEX
    from kernelguard.train.inputs.data import load_examples
    from kernelguard.train.inputs.tokenizer import load_tokenizer
    from kernelguard.train.step.packing import build_packed_block, pack_best_fit_decreasing

    evals = [r for r in _records(full_run) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [EVAL_EVERY, STEPS]
    assert evals[0]["eval_loss"] > evals[1]["eval_loss"]  # it learns, measured on rows it never trained on

    tok = load_tokenizer(str(assets["tok"]))
    examples, _ = load_examples(
        data=str(assets["data"]),
        tokenizer=tok,
        max_length=256,
        eval_fraction=EVAL_FRACTION,
        seed=0,
        take="eval",
    )
    model = AutoModelForCausalLM.from_pretrained(str(full_run / "final"), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for block in pack_best_fit_decreasing(examples.lengths(), 256, seed=0):  # as the run packs its eval set
            b = build_packed_block([examples[i] for i in block], 256, tok.pad_token_id)
            inputs = {k: v for k, v in b.items() if k not in ("labels", "num_real_tokens")}
            logits = model(**inputs, use_cache=False).logits[0, :-1].float()
            labels = b["labels"][0, 1:]
            total += float(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
            count += int((labels != IGNORE_INDEX).sum())
    assert evals[-1]["eval_tokens"] == count
    assert abs(evals[-1]["eval_loss"] - total / count) <= 1e-5 * total / count, (evals[-1], total / count)


def test_damaged_checkpoint_falls_back_and_resume_stays_exact(
    assets: dict[str, Path], full_run: Path
) -> None:
    from safetensors.torch import load_file

    out = assets["root"] / "resumed"
    r = h.run_train(_args(assets, out, "--max-steps", "4", "--save-every", "1", "--save-total-limit", "2"))
    assert r.returncode == 0, r.stderr
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]  # retention: the 2 newest
    shard = max((root / "step_4").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    r = h.run_train(_args(assets, out, "--max-steps", str(STEPS), "--save-every", "1", "--save-total-limit", "2",
                          "--resume"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"checkpoint step_4 is unusable: {shard} does not match its sha256 in the manifest" in r.stderr
    assert "falling back to step_3, the newest checkpoint that verifies" in r.stderr
    assert f"resumed from {root / 'step_3'} at step 3" in r.stderr
    a, b = _records(full_run), _records(out)
    assert [(x["step"], "eval_loss" in x) for x in a] == [(x["step"], "eval_loss" in x) for x in b]
    for x, y in zip(a, b):
        key = "eval_loss" if "eval_loss" in x else "loss"
        assert abs(x[key] - y[key]) <= 1e-6, (x, y)
    pa, pb = (load_file(str(o / "final" / "model.safetensors")) for o in (full_run, out))
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) <= 1e-6
    assert sorted(p.name for p in root.iterdir()) == ["step_5", "step_6"]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ("--resume", "--seed", "1"),
            ["belongs to a different run", "world_size: was 2, now 1", "seed: was 0, now 1"],
        ),
        (
            (),
            [
                "already holds a run (run.json, train_config.json, checkpoints, final, metrics.jsonl)",
                "--overwrite",
            ],
        ),
    ],
    ids=["different-run", "occupied"],
)
def test_cli_refuses_without_touching_the_run(
    full_run: Path, assets: dict[str, Path], capsys: pytest.CaptureFixture[str], extra: tuple[str, ...],
    expected: list[str],
) -> None:  # fmt: skip
    from kernelguard.train.__main__ import main

    before = _snapshot(full_run)
    assert main(_args(assets, full_run, "--max-steps", "8", *extra)) == 2
    err = capsys.readouterr().err
    assert all(e in err for e in expected), err
    assert "Traceback" not in err
    assert _snapshot(full_run) == before


def test_two_ranks_refuse_together_with_one_message(full_run: Path, assets: dict[str, Path]) -> None:
    """Preflight runs on rank 0 and its refusal reaches every rank: no rank waits in a collective, the
    launcher (`kernelguard train --nproc-per-node 2`) exits 2 with the message once; the folder is untouched."""
    before = _snapshot(full_run)
    args = ["--nproc-per-node", "2", *_args(assets, full_run, "--max-steps", "8")]
    r = h.run_train(args, nproc=0, timeout=120)
    assert r.returncode == 2, r.stderr
    message = f"--output-dir {full_run} already holds a run (run.json, train_config.json, checkpoints, final"
    assert r.stderr.count(message) == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert _snapshot(full_run) == before
