"""The offline tokenizer: exact byte-level round trips, stable ids, and the chat template."""

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxrl.tiny_tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]

TEXTS = [
    "Hello, world!",
    "spaces before punctuation , . ! ? and it 's , do n't",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n\n\nand  double  spaces",
    "unicode: café, naïve, Straße, 日本語, Ελληνικά, русский",
    "emoji: 🎲🦊👩‍💻 and flags 🇫🇷",
    '{"name": "guess", "arguments": {"word": "crane", "n": [1, 2.5, -3e4], "ok": null}}',
    "0123456789 3.14159 -42 1e-3 $19.99",
    "combining: e\u0301 vs \u00e9, zero width: a\u200bb, nul: a\x00b",
    "",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "Paris 21, Rome 25."},
    {"role": "user", "content": "Thanks"},
]

TOOLS_SYSTEM = (
    "<|im_start|>system\n"
    "Be brief.\n\n"
    "# Tools\n\n"
    "You can call the functions described below. "
    "Their JSON schemas are listed inside <tools></tools>:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", '
    '"description": "Get the weather in a city.", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\n"
    "To call a function, answer with one JSON object per call inside <tool_call></tool_call>:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-object>}\n'
    "</tool_call><|im_end|>\n"
)

TURNS = (
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n"
    '<tool_response>\n{"temp": 21}\n</tool_response>\n'
    '<tool_response>\n{"temp": 25}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nParis 21, Rome 25.<|im_end|>\n"
    "<|im_start|>user\nThanks<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_merges_were_learned(tok):
    assert len(tok) == 512
    assert len(tok.encode("the answer is")) < len("the answer is")


@pytest.mark.parametrize("token", SPECIAL_TOKENS + TAG_TOKENS)
def test_added_tokens_are_single_ids(tok, token):
    ids = tok.encode(f"a{token}b")
    assert len(ids) == 3
    assert tok.convert_ids_to_tokens(ids[1]) == token


def test_special_ids_and_skipping(tok):
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id == tok.convert_tokens_to_ids(EOS_TOKEN)
    assert tok.pad_token_id == tok.convert_tokens_to_ids(PAD_TOKEN)
    assert tok.eos_token_id != tok.pad_token_id
    assert sorted(tok.all_special_tokens) == sorted(SPECIAL_TOKENS)
    body = '<think>\nhm\n</think>\n<tool_call>\n{"a": 1}\n</tool_call>'
    text = f"<|im_start|>assistant\n{body}<|im_end|>"
    # Control tokens go; the tags a tool-call parser reads stay.
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == f"assistant\n{body}"


def test_build_is_deterministic(tmp_path):
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    # A fresh process has fresh hash seeds: the trainer and the bridge must agree on ids.
    code = "import sys, jaxrl.tiny_tokenizer as t; t.build_tokenizer(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], cwd=ROOT, check=True)
    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="vocab_size=100"):
        build_tokenizer(vocab_size=100)


def test_save_and_reload_offline(tok, tmp_path):
    build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TEXTS + [TURNS]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.chat_template == CHAT_TEMPLATE
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert loaded.decode(loaded.encode("<tool_call>x"), skip_special_tokens=True) == "<tool_call>x"
    rendered = loaded.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert rendered == TOOLS_SYSTEM + TURNS


def test_template_full_conversation(tok):
    rendered = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert rendered == TOOLS_SYSTEM + TURNS + "<|im_start|>assistant\n"


def test_template_system_without_tools(tok):
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n" + TURNS


def test_template_tools_without_system(tok):
    rendered = tok.apply_chat_template(CONVERSATION[1:], tools=TOOLS, tokenize=False)
    assert rendered == TOOLS_SYSTEM.replace("Be brief.\n\n", "") + TURNS


def test_template_plain_chat(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_tool_call_without_content(tok):
    # A call without the OpenAI "function" wrapper renders the same.
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [{"name": "guess", "arguments": {}}]},
        {"role": "tool", "content": "wrong"},
        {"role": "user", "content": "again"},
        {"role": "tool", "content": "right"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        '<|im_start|>assistant\n<tool_call>\n{"name": "guess", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nwrong\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nright\n</tool_response><|im_end|>\n"
    )


def test_template_tokenized_round_trip(tok):
    encoded = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True
    )
    ids = encoded["input_ids"]
    text = TOOLS_SYSTEM + TURNS + "<|im_start|>assistant\n"
    assert ids == tok.encode(text)
    assert tok.decode(ids) == text
    # The rendered turn markers are single special ids, not spelled-out bytes.
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 7
    assert ids.count(tok.eos_token_id) == 6
    # Two calls plus the two mentions in the tools instructions.
    assert ids.count(tok.convert_tokens_to_ids("<tool_call>")) == 4
