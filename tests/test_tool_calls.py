"""Tool-call parsing from completion text, and the tool-result messages that answer it."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from bridge.tool_calls import (
    ParsedTurn,
    QwenToolCallParser,
    ToolCall,
    available_parsers,
    format_tool_results,
    get_parser,
    hidden_special_ids,
    render_tool_results,
)
from jaxrl.tiny_tokenizer import build_tokenizer


@pytest.fixture
def parser():
    return get_parser("qwen")


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_single_call(parser):
    turn = parser.parse(block('{"name": "guess", "arguments": {"word": "crane"}}'))
    assert turn == ParsedTurn("", [ToolCall("guess", {"word": "crane"})], [])


def test_several_calls_with_surrounding_content(parser):
    text = (
        "<think>\nTwo cities.\n</think>\n\nChecking both.\n"
        + block('{"name": "get_weather", "arguments": {"city": "Paris"}}')
        + "\n"
        + block('{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}')
        + "\nDone."
    )
    turn = parser.parse(text)
    assert turn.calls == [
        ToolCall("get_weather", {"city": "Paris"}),
        ToolCall("get_weather", {"city": "Rome", "unit": "c"}),
    ]
    assert turn.content == "<think>\nTwo cities.\n</think>\n\nChecking both.\nDone."
    assert turn.errors == []


def test_arguments_as_json_string_missing_or_null(parser):
    text = (
        block('{"name": "a", "arguments": "{\\"x\\": 1}"}')
        + block('{"name": "b"}')
        + block('{"name": "c", "arguments": null}')
        + block('{"name": "d", "arguments": ""}')
        + '<tool_call>{"arguments": {}, "name": "e", "id": "call_1"}</tool_call>'  # no newlines, key order
    )
    turn = parser.parse(text)
    assert turn.calls == [ToolCall("a", {"x": 1})] + [ToolCall(n, {}) for n in "bcde"]
    assert turn.errors == []


def test_no_calls(parser):
    assert parser.parse("  The answer is 42.\n") == ParsedTurn("The answer is 42.", [], [])
    assert parser.parse("") == ParsedTurn("", [], [])


@pytest.mark.parametrize(
    "body, needles",
    [
        ('{"name": "guess", "arguments": {"word": "crane"}', ["tool call 1 is not valid JSON"]),
        ("{name: guess}", ["not valid JSON", "{name: guess}"]),
        ("", ["not valid JSON", "(empty)"]),
        ('["guess", {"word": "crane"}]', ["must be a JSON object"]),
        ('{"arguments": {"word": "crane"}}', ['has no "name"']),
        ('{"name": "", "arguments": {}}', ['has no "name"']),
        ('{"name": 3, "arguments": {}}', ['has no "name"']),
        (
            '{"name": "guess", "arguments": "{word: crane}"}',
            ["arguments of tool call 1 ('guess') are not valid JSON"],
        ),
        ('{"name": "guess", "arguments": ["crane"]}', ["must be a JSON object, got: [\"crane\"]"]),
    ],
)
def test_malformed_blocks_become_errors(parser, body, needles):
    turn = parser.parse("Trying.\n" + block(body) + "\n" + block('{"name": "ok", "arguments": {}}'))
    assert turn.content == "Trying."
    assert turn.calls == [ToolCall("ok", {})]  # the good block is still used
    assert len(turn.errors) == 1 and turn.errors[0].startswith("Error: ")
    for needle in needles:
        assert needle in turn.errors[0]


def test_unterminated_tag_at_end(parser):
    text = (
        "Let me guess.\n"
        + block('{"name": "a", "arguments": {}}')
        + '\n<tool_call>\n{"name": "b", "arguments": {}}'
    )
    turn = parser.parse(text)
    assert turn.calls == [ToolCall("a", {})]
    assert turn.content == "Let me guess."
    assert len(turn.errors) == 1
    assert "tool call 2 has no closing </tool_call>" in turn.errors[0] and '{"name": "b"' in turn.errors[0]


def test_unterminated_tag_before_another_call(parser):
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n' + block('{"name": "b", "arguments": {"x": 1}}')
    turn = parser.parse(text)
    assert turn.calls == [ToolCall("b", {"x": 1})]
    assert len(turn.errors) == 1 and "tool call 1 has no closing" in turn.errors[0]


def test_unterminated_allowed_for_stop_string_engines():
    text = 'Go.\n<tool_call>\n{"name": "a", "arguments": {"x": 2}}\n'
    turn = QwenToolCallParser(allow_unterminated=True).parse(text)
    assert turn == ParsedTurn("Go.", [ToolCall("a", {"x": 2})], [])


def test_stray_closing_tag(parser):
    turn = parser.parse('oops</tool_call> then ' + block('{"name": "a"}'))
    assert turn.calls == [ToolCall("a", {})]
    assert turn.content == "oops then"
    assert turn.errors == ["Error: found </tool_call> with no <tool_call> before it"]


def test_registry():
    assert isinstance(get_parser(), QwenToolCallParser)
    assert isinstance(get_parser("hermes"), QwenToolCallParser)
    assert isinstance(get_parser("Qwen"), QwenToolCallParser)
    assert get_parser("qwen", allow_unterminated=True).allow_unterminated
    assert {"qwen", "hermes"} <= set(available_parsers())
    with pytest.raises(ValueError, match="unknown tool-call parser 'llama'.*available: hermes, qwen"):
        get_parser("llama")


def test_to_message():
    turn = ParsedTurn("Checking.", [ToolCall("f", {"x": 1})], [])
    assert turn.to_message() == {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert ParsedTurn("Hi.").to_message() == {"role": "assistant", "content": "Hi."}


def test_format_tool_results():
    calls = [ToolCall("f", {}), ToolCall("g", {"x": 1})]
    errors = ["Error: tool call 3 is not valid JSON"]
    messages = format_tool_results(calls, ["r1", "Error: ValueError: no"], errors)
    assert messages == [
        {"role": "tool", "name": "f", "content": "r1"},
        {"role": "tool", "name": "g", "content": "Error: ValueError: no"},
        {"role": "tool", "content": "Error: tool call 3 is not valid JSON"},
    ]
    with pytest.raises(ValueError, match="2 calls but 1 results"):
        format_tool_results(calls, ["r1"])


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_render_tool_results_with_the_tiny_template(tok):
    messages = format_tool_results([ToolCall("f", {})], ['{"temp": 21}'], ["Error: bad call"])
    after_eos = render_tool_results(tok, messages)
    assert after_eos == (
        "\n<|im_start|>user\n"
        '<tool_response>\n{"temp": 21}\n</tool_response>\n'
        "<tool_response>\nError: bad call\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # A turn cut before its end token gets the assistant turn closed too.
    assert render_tool_results(tok, messages, turn_end="") == "<|im_end|>" + after_eos
    with pytest.raises(ValueError, match="turn_end"):
        render_tool_results(tok, messages, turn_end="</s>")


def test_parse_round_trips_the_template_rendering(tok, parser):
    """What the chat template writes for an assistant's calls, the parser reads back."""
    calls = [ToolCall("get_weather", {"city": "Paris"}), ToolCall("guess", {"n": 3, "tags": ["a"]})]
    message = ParsedTurn("Checking.", calls).to_message()
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, message], tokenize=False)
    body = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    assert parser.parse(body) == ParsedTurn("Checking.", calls, [])


def test_the_parser_reads_its_delimiters_even_where_the_tokenizer_marks_them_special(parser):
    tok = build_tokenizer()
    control = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert hidden_special_ids(tok, parser.delimiters) == control
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>", "<think>")],
                   special_tokens=True)
    hidden = hidden_special_ids(tok, parser.delimiters)
    assert hidden == control | {tok.convert_tokens_to_ids("<think>")}  # special, and not the parser's
    ids = tok.encode("<think>hm</think>" + block('{"name": "f", "arguments": {}}') + "<|im_end|>",
                     add_special_tokens=False)
    assert parser.parse(tok.decode([i for i in ids if i not in hidden])) == ParsedTurn("hm</think>", [ToolCall("f", {})])
