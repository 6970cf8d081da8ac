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

import chitchat_to_jsonl  # noqa: E402
import compare  # noqa: E402


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
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert label_count(padded) == label_count(packed) == 6
    leaky = build_batch(examples, 12, 0, packing="leaky")
    assert not set(BOUNDARY_KEYS) & set(leaky)
    assert leaky["position_ids"].tolist() == packed["position_ids"].tolist()
    assert leaky["labels"].tolist() == packed["labels"].tolist()


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
    args = ["--packed", str(packed), "--padded", str(padded), "--leaky", str(leaky), "--unigram", str(unigram)]
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
