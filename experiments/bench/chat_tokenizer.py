"""A Hugging Face byte-level BPE tokenizer with a Qwen2.5-style tool chat template, for benchmarks whose
token counts should look like a real model's.

`jaxrl.tiny_tokenizer` is trained on a corpus written around the bundled games (tool-call JSON, "guess",
"higher"), so a tool episode takes few tokens there. This one learns its merges from general English
prose and code (the docstrings of Python's standard library, ~0.4 MB), so the words and JSON of a
tool workload split as they would in a small general vocabulary. Its chat template renders what
Qwen2.5's does for tool use: a system turn listing the tools' JSON schemas inside <tools></tools>
with the call format, `<tool_call>` JSON in assistant turns, `<tool_response>` blocks in a user turn.

Plain `tokenizers` + `transformers` (no jaxrl), so both sides of `experiments.bench.vs_trl` load the
saved directory. The merges depend on the docstrings of the running Python: key cached models by
`corpus_key()`.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Single ids that decoding with skip_special_tokens keeps, as in Qwen's tokenizer: tool-call parsers read them.
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Modules present in every CPython build (no optional C extensions, no GUI toolkits).
CORPUS_MODULES = (
    "os", "re", "json", "collections", "itertools", "functools", "pathlib", "argparse", "logging", "subprocess",
    "asyncio", "typing", "dataclasses", "string", "textwrap", "random", "statistics", "decimal", "fractions",
    "datetime", "calendar", "email", "http.client", "urllib.request", "csv", "threading", "queue", "socket",
    "shutil", "tempfile", "zipfile", "tarfile", "unittest", "doctest", "difflib", "inspect", "contextlib", "abc",
    "enum", "heapq", "bisect", "math", "operator", "pickle", "copy", "pprint", "configparser", "hashlib",
    "base64", "gzip", "io", "codecs", "locale", "gettext", "optparse", "getopt", "cmd", "shlex",
)

CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == "system" else none -%}
{%- if tools -%}
  {{- "<|im_start|>system\\n" + (system if system is not none else "You are a helpful assistant.") -}}
  {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" -}}
  {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" -}}
  {%- for tool in tools -%}{{- "\\n" + (tool | tojson) -}}{%- endfor -%}
  {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " -}}
  {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}
{%- else -%}
  {{- "<|im_start|>system\\n" + (system if system is not none else "You are a helpful assistant.") -}}
  {{- "<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if message.role == "system" and loop.first -%}
  {%- elif message.role == "tool" -%}
    {%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}{{- "<|im_start|>user" -}}{%- endif -%}
    {{- "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" -}}
    {%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}{{- "<|im_end|>\\n" -}}{%- endif -%}
  {%- elif message.role == "assistant" and message.tool_calls -%}
    {{- "<|im_start|>assistant" -}}
    {%- if message.content -%}{{- "\\n" + message.content -}}{%- endif -%}
    {%- for tool_call in message.tool_calls -%}
      {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
      {%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson -%}
      {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + arguments + "}\\n</tool_call>" -}}
    {%- endfor -%}
    {{- "<|im_end|>\\n" -}}
  {%- else -%}
    {{- "<|im_start|>" + message.role + "\\n" + (message.content or "") + "<|im_end|>\\n" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\\n" -}}{%- endif -%}
"""


def corpus() -> list[str]:
    """The docstrings of CORPUS_MODULES and of their public functions and classes, each once, and
    chat transcripts of other tools (`_chat_corpus`)."""
    docs: dict[str, None] = {}
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(v for k, v in sorted(vars(module).items()) if not k.startswith("_"))]:
            if inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    docs[doc] = None
    return list(docs) + _chat_corpus()


def _chat_corpus() -> list[str]:
    """Tool-use transcripts rendered by the template, with tools unlike any benchmark's: a real model's
    vocabulary was trained on much chat and JSON, so its template's words (`user`, `assistant`,
    `"arguments": {`) are single tokens. Repeated so that they win merges over one-off prose."""
    tools = [{"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {arg: {"type": kind, "description": about}},
                       "required": [arg]}}}
        for name, description, arg, kind, about in (
            ("get_weather", "Get the current weather in a city.", "city", "string", "The city name."),
            ("search", "Search the web.", "query", "string", "What to look for."),
            ("add", "Add two numbers.", "x", "number", "The first number."),
            ("open_page", "Open a page by its index.", "index", "integer", "The page's index."))]
    text = []
    for i, tool in enumerate(tools):
        name, arg = tool["function"]["name"], next(iter(tool["function"]["parameters"]["properties"]))
        value = [f'"Paris"', '"jax tutorial"', "17", str(3 + i)][i]
        text.append(_render(tools, [
            {"role": "user", "content": f"Please use {name} to help me."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": f'{{"{arg}": {value}}}'}}]},
            {"role": "tool", "name": name, "content": f"The result for {value} is ready."},
            {"role": "assistant", "content": "Here is what I found."}]))
    return 8 * text


def _render(tools: list[dict], messages: list[dict]) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: __import__("json").dumps(value)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, tools=tools, add_generation_prompt=False)


def corpus_key() -> str:
    """What the trained merges depend on: the corpus text (so, the Python version) and this module."""
    digest = hashlib.sha256("\n\n".join(corpus()).encode())
    digest.update(Path(__file__).read_bytes())
    return f"py{sys.version_info.major}{sys.version_info.minor}-{digest.hexdigest()[:8]}"


def build_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    """Trains the tokenizer (a second or two); saves it to `out_dir` for `AutoTokenizer.from_pretrained`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TAG_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                        extra_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
