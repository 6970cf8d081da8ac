"""TRL dataset formats: conversational messages, prompt/completion (strings or message lists) and plain text;
detection from the columns, the override, and the errors for data that fits none."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import qwen_vocab
import train_helpers as h

from kernelguard.errors import ConfigError, DataError
from kernelguard.resolution.packed_batch import IGNORE_INDEX
from kernelguard.train.inputs.data import load_examples
from kernelguard.train.inputs.tokenizer import set_chat_template

USER, ANSWER = {"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(h.write_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return qwen_vocab.load(tmp_path_factory)


def _load(tokenizer: Any, tmp_path: Path, rows: list[Any], **kw: Any) -> tuple[list[Any], Any]:
    data = h.write_jsonl(tmp_path / "d.jsonl", rows)
    kw.setdefault("max_length", 512)
    ex, stats = load_examples(data=str(data), tokenizer=tokenizer, **kw)
    return list(ex), stats


def _trained(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    return tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        ({"messages": [USER, ANSWER], "text": "ignored"}, "messages"),
        ({"prompt": "ab", "completion": "cd"}, "prompt-completion"),
        ({"text": "abcd", "id": 3}, "text"),
    ],
)
def test_format_is_detected_from_the_columns(tokenizer: Any, tmp_path: Path, row: Any, fmt: str) -> None:
    _, stats = _load(tokenizer, tmp_path, [row, row])
    assert stats.format == fmt and stats.examples == 2
    assert stats.render().startswith(fmt)


def test_string_prompt_completion_trains_the_completion_and_eos(tokenizer: Any, tmp_path: Path) -> None:
    ((ids, labels),), stats = _load(tokenizer, tmp_path, [{"prompt": "Q: 2+2=", "completion": " 4"}])
    assert tokenizer.decode(ids) == "Q: 2+2= 4<|im_end|>"
    assert _trained(tokenizer, ids, labels) == " 4<|im_end|>"
    assert stats.loss_tokens == 3 and stats.template == ""
    ((ids, labels),), _ = _load(tokenizer, tmp_path, [{"prompt": "Q", "completion": "A<|im_end|>"}])
    assert tokenizer.decode(ids) == "QA<|im_end|>"  # no second end token


def test_conversational_prompt_completion_trains_the_completion_only(tokenizer: Any, tmp_path: Path) -> None:
    few_shot = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, USER]
    ((ids, labels),), stats = _load(tokenizer, tmp_path, [{"prompt": few_shot, "completion": [ANSWER]}])
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\ncd<|im_end|>\n")
    assert _trained(tokenizer, ids, labels) == "cd<|im_end|>\n"  # not the few-shot answer a1
    assert stats.format == "prompt-completion" and stats.template == "tokenizer"


def test_conversational_prompt_completion_with_the_qwen_training_template(qwen: Any, tmp_path: Path) -> None:
    prompt = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, USER]
    completion = [{"role": "assistant", "reasoning_content": "think", "content": "cd"}]
    ((ids, labels),), stats = _load(qwen, tmp_path, [{"prompt": prompt, "completion": completion}])
    assert _trained(qwen, ids, labels) == "<think>\nthink\n</think>\n\ncd<|im_end|>\n"
    assert stats.template == "qwen3_training"
    # The same conversation as a messages row trains both answers.
    ((ids2, labels2),), _ = _load(qwen, tmp_path, [{"messages": prompt + completion}])
    assert ids2 == ids
    assert _trained(qwen, ids2, labels2) == "<think>\n\n</think>\n\na1<|im_end|>\n" + _trained(
        qwen, ids, labels
    )


def test_text_rows_train_every_token_without_a_chat_template(tokenizer: Any, tmp_path: Path) -> None:
    bare = copy.copy(tokenizer)
    bare.chat_template = None
    set_chat_template(bare)
    ((ids, labels),), stats = _load(bare, tmp_path, [{"text": "hello"}])
    assert labels == ids and tokenizer.decode(ids) == "hello<|im_end|>"
    assert stats.template == "" and stats.format == "text"
    with pytest.raises(ConfigError, match="need a chat template, and the tokenizer has none"):
        _load(bare, tmp_path, [{"messages": [USER, ANSWER]}])


def test_list_of_text_parts_equals_string_content(tokenizer: Any, tmp_path: Path) -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    (ex1,), _ = _load(tokenizer, tmp_path, [{"messages": [parts, ANSWER]}])
    (ex2,), _ = _load(tokenizer, tmp_path, [{"messages": [USER, ANSWER]}])
    assert ex1 == ex2
    image = {"role": "user", "content": [{"type": "image", "url": "x.png"}]}
    strings = {"role": "user", "content": ["not", "parts"]}
    with pytest.raises(
        DataError, match=r"field 'messages\[0\]\.content': part 0 is 'str'; expected text parts"
    ):
        _load(tokenizer, tmp_path, [{"messages": [strings, ANSWER]}])
    with pytest.raises(
        DataError, match=r"row 1, field 'messages\[0\]\.content': part 0 is 'image'; expected text parts"
    ):
        _load(tokenizer, tmp_path, [{"messages": [image, ANSWER]}])


def test_override_picks_a_format_the_columns_would_not(tokenizer: Any, tmp_path: Path) -> None:
    row = {"messages": [USER, ANSWER], "text": "xyz"}
    ((ids, labels),), stats = _load(tokenizer, tmp_path, [row], dataset_format="text")
    assert tokenizer.decode(ids) == "xyz<|im_end|>" and labels == ids and stats.format == "text"


def test_rows_that_fit_no_format_list_formats_and_columns(tokenizer: Any, tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        _load(tokenizer, tmp_path, [{"query": "q", "reply": "a"}])
    assert info.value.message == (
        f"{tmp_path / 'd.jsonl'}, row 1, field 'messages': no column of a known dataset format (columns: query, "
        "reply); known formats: messages (a 'messages' column of chat messages), prompt-completion ('prompt' and "
        "'completion' columns), text (a 'text' column), sharegpt (a 'conversations' column of from/value turns), "
        "question/answer, instruction/input/output, "
        "prompt/response; other columns map to a conversation with --columns user=COLUMN,assistant=COLUMN (a "
        "column of chat messages: --messages-column NAME)")
    assert info.value.fix == "--columns user=query,assistant=reply"
    with pytest.raises(DataError, match=r"row 1, field 'completion': column 'completion' is missing"):
        _load(tokenizer, tmp_path, [{"prompt": "q"}], dataset_format="prompt-completion")
    with pytest.raises(ConfigError, match="unknown dataset format 'chat'"):
        _load(tokenizer, tmp_path, [{"prompt": "q"}], dataset_format="chat")


CHAT = {"messages": [USER, ANSWER]}
PAIR = {"prompt": "q", "completion": "a"}
BAD_ROWS: list[tuple[Any, Any, str, str]] = [
    (PAIR, {"prompt": "q", "completion": [ANSWER]}, "completion", "both be strings or both be message lists"),
    (PAIR, {"prompt": "q", "completion": ""}, "completion", "the completion is empty"),
    (PAIR, {"prompt": [USER], "completion": [USER]}, "completion", "no assistant message"),
    # ("t": its one predicted token would be the end-of-sequence token, which teaches nothing: dropped)
    ({"text": "two words"}, {"text": ""}, "text", "expected a non-empty string"),
    (
        CHAT,
        {"messages": [USER, {**ANSWER, "tool_calls": [{"function": {}}]}]},
        "messages[1].tool_calls[0]",
        "name",
    ),
    (CHAT, {"messages": [{**USER, "tool_calls": []}, ANSWER]}, "messages[0].tool_calls", "only assistant"),
    (
        CHAT,
        {"messages": [USER, {**ANSWER, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
        "messages[1].tool_calls[0].arguments",
        "an object or a JSON object string",
    ),
    (CHAT, {**CHAT, "tools": "[oops"}, "tools", "not valid JSON"),
    (
        CHAT,
        {"messages": [USER, {**ANSWER, "reasoning_content": 3}]},
        "messages[1].reasoning_content",
        "string",
    ),
]


@pytest.mark.parametrize(("good", "row", "field", "problem"), BAD_ROWS)
def test_malformed_rows_of_each_format(
    tokenizer: Any, tmp_path: Path, good: Any, row: Any, field: str, problem: str
) -> None:
    with pytest.raises(DataError) as info:
        _load(tokenizer, tmp_path, [good, row])
    assert f"row 2, field {field!r}" in str(info.value) and problem in str(info.value), str(info.value)
    _, stats = _load(tokenizer, tmp_path, [good, row], skip_bad_rows=True)
    assert stats.examples == 1 and sum(stats.bad_rows.values()) == 1


def test_tool_rows_render_with_their_tools_column(qwen: Any, tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
    }
    row = {"messages": [USER, call, {"role": "tool", "content": "ok"}, ANSWER], "tools": json.dumps(tools)}
    ((ids, labels),), _ = _load(qwen, tmp_path, [row])
    text = qwen.decode(ids)
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert _trained(qwen, ids, labels) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<think>\n\n</think>\n\ncd<|im_end|>\n"
    )


def test_json_string_tool_arguments_render_like_objects(qwen: Any, tmp_path: Path) -> None:
    """OpenAI-style rows carry arguments as a JSON string; Qwen3.5's template can only render an object."""
    qwen35 = copy.copy(qwen)
    set_chat_template(qwen35, "qwen3_5_think_training")

    def row(arguments: Any) -> dict[str, Any]:
        call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]}

    (as_object,), _ = _load(qwen35, tmp_path, [row({"city": "Paris"})])
    (as_string,), stats = _load(qwen35, tmp_path, [row('{"city": "Paris"}')])
    assert as_string == as_object and stats.template == "qwen3_5_think_training"
    assert _trained(qwen35, *as_object) == (
        "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
    )
