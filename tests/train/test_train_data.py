"""Chat data: assistant spans, overlong policy, file kinds, and every malformed-input case (one clear error
naming file, row and field; or skipped with a count)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.errors import ConfigError, DataError
from kernelguard.resolution.packed_batch import IGNORE_INDEX
from kernelguard.train.inputs import encode as encode_module
from kernelguard.train.inputs.data import in_eval_split, load_examples


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(h.write_tokenizer(tmp_path_factory.mktemp("tok"))))


def _load(tokenizer: Any, data: Path, **kw: Any) -> tuple[Any, Any]:
    kw.setdefault("max_length", 512)
    return load_examples(data=str(data), tokenizer=tokenizer, **kw)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_assistant_only_labels_cover_exactly_the_assistant_turns(tokenizer: Any, tmp_path: Path) -> None:
    conv = {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "ab"},
            {"role": "assistant", "content": "cd"},
            {"role": "user", "content": "ef"},
            {"role": "assistant", "content": "gh"},
        ]
    }
    ((ids, labels),) = _load(tokenizer, h.write_jsonl(tmp_path / "d.jsonl", [conv]))[0]
    trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == "cd<|im_end|>\ngh<|im_end|>\n"
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels))
    ((ids2, labels2),) = _load(tokenizer, tmp_path / "d.jsonl", assistant_only=False)[0]
    assert ids2 == ids and labels2 == ids


def test_overlong_truncate_and_drop_are_counted(tokenizer: Any, tmp_path: Path) -> None:
    long = {"messages": [{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y" * 100}]}
    data = h.write_jsonl(tmp_path / "d.jsonl", [GOOD, long, GOOD])
    ex, stats = _load(tokenizer, data, max_length=64)
    assert stats.truncated == 1 and stats.examples == 3 and max(len(i) for i, _ in ex) == 64
    ex, stats = _load(tokenizer, data, max_length=64, overlong="drop")
    assert stats.dropped_overlong == 1 and stats.examples == 2


def test_parquet_json_array_and_folder(tokenizer: Any, tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "data"
    folder.mkdir()
    datasets.Dataset.from_list([GOOD, GOOD]).to_parquet(str(folder / "a.parquet"))
    (folder / "b.json").write_text(json.dumps([GOOD]))
    h.write_jsonl(folder / "c.jsonl", [GOOD, GOOD, GOOD])
    _, stats = _load(tokenizer, folder)
    assert stats.rows == 6 and stats.examples == 6
    _, stats = _load(tokenizer, folder / "a.parquet")
    assert stats.examples == 2


def test_configurable_column(tokenizer: Any, tmp_path: Path) -> None:
    data = h.write_jsonl(tmp_path / "d.jsonl", [{"conversation": GOOD["messages"]}])
    assert _load(tokenizer, data, column="conversation")[1].examples == 1


BAD_ROWS: list[tuple[str, Any, str]] = [
    ("missing-column", {"msgs": GOOD["messages"]}, "'messages'"),
    ("empty-messages", {"messages": []}, "'messages'"),
    ("not-a-list", {"messages": "hello"}, "'messages'"),
    (
        "non-string-content",
        {"messages": [{"role": "user", "content": 5}, GOOD["messages"][1]]},
        "'messages[0].content'",
    ),
    (
        "unknown-role",
        {"messages": [{"role": "wizard", "content": "x"}, GOOD["messages"][1]]},
        "'messages[0].role'",
    ),
    ("no-assistant", {"messages": [{"role": "user", "content": "x"}]}, "'messages'"),
    ("not-an-object", [1, 2], "'<row>'"),
]


@pytest.mark.parametrize(("case", "row", "field"), BAD_ROWS, ids=[c for c, _, _ in BAD_ROWS])
def test_malformed_row_names_file_row_and_field(
    tokenizer: Any, tmp_path: Path, case: str, row: Any, field: str
) -> None:
    data = h.write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, row, GOOD])
    with pytest.raises(DataError) as info:
        _load(tokenizer, data)
    text = str(info.value)
    assert str(data) in text and "row 3" in text and f"field {field}" in text, text
    assert info.value.details["row"] == 3
    ex, stats = _load(tokenizer, data, skip_bad_rows=True)
    assert len(ex) == 3 and sum(stats.bad_rows.values()) == 1


def test_non_utf8_bytes_and_invalid_json(tokenizer: Any, tmp_path: Path) -> None:
    good = json.dumps(GOOD).encode()
    data = tmp_path / "d.jsonl"
    data.write_bytes(
        good + b"\n" + b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n' + good + b"\n"
    )
    with pytest.raises(DataError, match=r"d\.jsonl, row 2, field '<line>': not valid UTF-8"):
        _load(tokenizer, data)
    assert _load(tokenizer, data, skip_bad_rows=True)[1].bad_rows["not_utf8"] == 1
    data.write_bytes(good + b"\n" + good[:-3] + b"\n")
    with pytest.raises(DataError, match=r"row 2, field '<line>': invalid JSON"):
        _load(tokenizer, data)


def test_parquet_row_errors_name_the_row(tokenizer: Any, tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(
        [GOOD, {"messages": [{"role": "user", "content": "only a question"}]}]
    ).to_parquet(str(path))
    with pytest.raises(DataError, match=r"d\.parquet, row 1, field 'messages': no assistant message"):
        _load(tokenizer, path)


def test_missing_path_and_no_usable_rows(tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.jsonl: no such file or folder in "):
        _load(tokenizer, tmp_path / "nope.jsonl")
    data = h.write_jsonl(tmp_path / "d.jsonl", [{"messages": []}])
    with pytest.raises(DataError, match="no usable training examples"):
        _load(tokenizer, data, skip_bad_rows=True)


# ------------------------------------------------------------------------------------------- eval split ---
def _contents(ex: Any, tokenizer: Any) -> set[str]:
    return {tokenizer.decode(ids) for ids, _ in ex}


def test_eval_split_is_deterministic_disjoint_and_seeded(tokenizer: Any, tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(200)
    ]
    data = h.write_jsonl(tmp_path / "d.jsonl", rows)
    kw: dict[str, Any] = {"eval_fraction": 0.1, "seed": 7}
    train, tstats = _load(tokenizer, data, take="train", **kw)
    evals, estats = _load(tokenizer, data, take="eval", **kw)
    everything, _ = _load(tokenizer, data, take="all", **kw)
    assert 8 <= len(evals) <= 35 and len(train) + len(evals) == 200
    assert _contents(train, tokenizer) | _contents(evals, tokenizer) == _contents(everything, tokenizer)
    assert not _contents(train, tokenizer) & _contents(evals, tokenizer)
    assert tstats.held_out == len(evals) and estats.held_out == len(train) and estats.rows == len(evals)
    assert estats.take == "eval" and "eval split (" in estats.render()
    # The split depends on (seed, row index) only: not on chunking, and the same in every call.
    again, _ = _load(tokenizer, data, take="eval", chunk=3, **kw)
    assert [e for e in again] == [e for e in evals]
    other, _ = _load(tokenizer, data, take="eval", eval_fraction=0.1, seed=8)
    assert _contents(other, tokenizer) != _contents(evals, tokenizer)
    # Row i is an eval row iff in_eval_split(i): the documented rule the trainer and any tool can recompute.
    got = sorted(int(m[1]) for t in _contents(evals, tokenizer) if (m := re.search(r"user\nq(\d+)<", t)))
    assert got == [i for i in range(200) if in_eval_split(i, seed=7, fraction=0.1)]


def test_rows_of_the_other_split_are_never_parsed(tokenizer: Any, tmp_path: Path) -> None:
    in_eval = next(i for i in range(100) if in_eval_split(i, seed=0, fraction=0.2))
    lines = [json.dumps(GOOD)] * 10
    lines[in_eval] = "{not json"
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n")
    _, stats = _load(tokenizer, data, eval_fraction=0.2, take="train")
    assert stats.bad_rows == {} and stats.held_out >= 1
    with pytest.raises(DataError, match=rf"row {in_eval + 1}, field '<line>': invalid JSON"):
        _load(tokenizer, data, eval_fraction=0.2, take="eval")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"eval_fraction": 1.0}, r"outside \[0, 1\)"),
        ({"eval_fraction": -0.1}, r"outside \[0, 1\)"),
        ({"take": "eval"}, "needs an eval fraction above 0"),
        ({"take": "test"}, "unknown split 'test'"),
    ],
)
def test_bad_split_arguments_are_config_errors(tokenizer: Any, tmp_path: Path, kw: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _load(tokenizer, h.write_jsonl(tmp_path / "d.jsonl", [GOOD]), **kw)


# ------------------------------------------------------------------------------------ all-tokens loss ---
def test_all_tokens_loss_never_locates_assistant_tokens(
    tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*_a: Any, **_k: Any) -> None:
        raise AssertionError("assistant spans computed with assistant_only=False")

    monkeypatch.setattr(encode_module, "assistant_spans", boom)
    monkeypatch.setattr(encode_module, "generation_examples", boom)
    rows = [
        GOOD,
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]},
    ]
    for row in rows:
        ((ids, labels),), _ = _load(
            tokenizer, h.write_jsonl(tmp_path / "d.jsonl", [row]), assistant_only=False
        )
        assert labels == ids
    with pytest.raises(AssertionError, match="assistant spans computed"):
        _load(
            tokenizer, h.write_jsonl(tmp_path / "d.jsonl", [GOOD])
        )  # the patch does bite when spans are needed


def test_stats_carry_format_template_and_split(tokenizer: Any, tmp_path: Path) -> None:
    _, stats = _load(tokenizer, h.write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD]))
    d = stats.to_dict()
    assert (d["format"], d["template"], d["take"], d["held_out"]) == ("messages", "tokenizer", "train", 0)
    assert stats.render().startswith("messages, chat template tokenizer: 2 rows -> 2 examples")


def test_rows_whose_loss_is_only_end_of_turn_tokens_are_dropped_and_counted(tokenizer: Any, tmp_path: Path) -> None:
    """An empty or whitespace answer leaves ``<|im_end|>\\n`` as its only labels: it teaches "stop" and nothing
    else, so it is dropped with its own count, in every format (text and prompt/completion rows too). The
    rule is on the trained tokens, not the row's fields: one real turn elsewhere in the row keeps it."""
    from kernelguard.train.inputs.data import content_checker

    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    blank = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n "}]}
    mixed = {"messages": [*empty["messages"], {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "yo"}]}
    rows = [GOOD, empty, blank, mixed, {"prompt": "p", "completion": "  "}, {"text": " \n"}, {"text": "é"}]
    ex, stats = _load(tokenizer, h.write_jsonl(tmp_path / "d.jsonl", rows[:4]))
    assert (stats.examples, stats.dropped_template_only, stats.dropped_no_loss) == (2, 2, 0)
    assert [tokenizer.decode([t for t in lab if t != IGNORE_INDEX]) for _, lab in ex] == [
        "yo<|im_end|>\n", "<|im_end|>\nyo<|im_end|>\n"]
    assert stats.to_dict()["dropped_template_only"] == 2
    good = {"prompt": "p", "completion": "ok"}, {"text": "ok"}, {"text": "ok"}
    for row, other, kept in zip(rows[4:], good, (0, 0, 1)):  # "é" is two byte tokens: content
        _, stats = _load(tokenizer, h.write_jsonl(tmp_path / "one.jsonl", [row, other]))
        assert (stats.examples, stats.dropped_template_only) == (1 + kept, 1 - kept), row
    teaches = content_checker(tokenizer)
    im_end, newline = tokenizer.convert_tokens_to_ids(["<|im_end|>", "Ċ"])
    assert not teaches(im_end) and not teaches(newline) and teaches(tokenizer.convert_tokens_to_ids("y"))


def test_an_eval_fraction_too_small_for_the_data_names_the_fraction_and_a_fix(tokenizer: Any, tmp_path: Path) -> None:
    """--eval-fraction 1e-6 of 30 rows holds out nothing: the refusal said "no eval examples (?: ...)" with the
    generic data fix; it names the fraction, the row count and a fraction that would hold some out."""
    data = h.write_jsonl(tmp_path / "d.jsonl", [GOOD] * 30)
    with pytest.raises(DataError) as info:
        _load(tokenizer, data, eval_fraction=1e-6, take="eval")
    assert str(info.value).startswith("--eval-fraction 1e-06 holds out none of the 30 rows of")
    assert "raise --eval-fraction to at least 0.5 (about 15 rows), or pass held-out rows as --eval-data" in (
        info.value.fix or "")
