"""A tiny byte-level BPE tokenizer with a Qwen-style chat template, built offline.

Tests, CI and CPU runs need a tokenizer without the Hugging Face hub. This one is trained
in a fraction of a second on a corpus embedded below, so every process (trainer, bridge)
that builds it gets the same ids.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
# Control tokens: `skip_special_tokens=True` removes them from decoded text.
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# Single ids but not "special", as in Qwen's tokenizer: decoding with
# `skip_special_tokens=True` (vLLM's default) must keep them, or tool calls and reasoning
# would vanish from the text that the tool-call parser reads.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# Every byte is a base token, so a vocabulary smaller than this has no room for merges.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(TAG_TOKENS)

# Every tag trims whitespace (`-`) so the template's indentation never reaches the output.
# Messages follow the OpenAI shape; tool-call arguments may be a dict or an already
# serialized JSON string, which is kept verbatim.
CHAT_TEMPLATE = """\
{%- if messages and messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system_message = none -%}
  {%- set turns = messages -%}
{%- endif -%}
{%- if tools -%}
  {{- "<|im_start|>system\\n" -}}
  {%- if system_message -%}{{- system_message + "\\n\\n" -}}{%- endif -%}
  {{- "# Tools\\n\\nYou can call the functions described below. " -}}
  {{- "Their JSON schemas are listed inside <tools></tools>:\\n<tools>" -}}
  {%- for tool in tools -%}
    {{- "\\n" + (tool | tojson) -}}
  {%- endfor -%}
  {{- "\\n</tools>\\n\\nTo call a function, answer with one JSON object per call " -}}
  {{- "inside <tool_call></tool_call>:\\n<tool_call>\\n" -}}
  {{- '{"name": <function-name>, "arguments": <arguments-object>}' -}}
  {{- "\\n</tool_call><|im_end|>\\n" -}}
{%- elif system_message is not none -%}
  {{- "<|im_start|>system\\n" + system_message + "<|im_end|>\\n" -}}
{%- endif -%}
{%- for message in turns -%}
  {%- if message.role == "tool" -%}
    {#- Consecutive tool results share one user turn, as Qwen does. -#}
    {%- if loop.first or turns[loop.index0 - 1].role != "tool" -%}
      {{- "<|im_start|>user" -}}
    {%- endif -%}
    {{- "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" -}}
    {%- if loop.last or turns[loop.index0 + 1].role != "tool" -%}
      {{- "<|im_end|>\\n" -}}
    {%- endif -%}
  {%- elif message.role == "assistant" and message.tool_calls -%}
    {{- "<|im_start|>assistant" -}}
    {%- if message.content -%}{{- "\\n" + message.content -}}{%- endif -%}
    {%- for tool_call in message.tool_calls -%}
      {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
      {%- if call.arguments is string -%}
        {%- set arguments = call.arguments -%}
      {%- else -%}
        {%- set arguments = call.arguments | tojson -%}
      {%- endif -%}
      {{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + arguments -}}
      {{- "}\\n</tool_call>" -}}
    {%- endfor -%}
    {{- "<|im_end|>\\n" -}}
  {%- else -%}
    {{- "<|im_start|>" + message.role + "\\n" + (message.content or "") + "<|im_end|>\\n" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- "<|im_start|>assistant\\n" -}}
{%- endif -%}
"""


def _corpus() -> list[str]:
    """Training text: prose, chat and tool-call shapes, JSON, digits and game words."""
    prose = [
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. It is a truth universally acknowledged that a good model needs "
        "good data, and that good data is hard to find.",
        "Reinforcement learning trains a policy to maximize the reward it receives from an "
        "environment. The agent observes the state, chooses an action, and the environment "
        "returns an observation and a reward. Over many episodes the policy improves.",
        "You are a helpful assistant. Please answer the question as well as you can. If you "
        "do not know the answer, say that you do not know. Think step by step before you "
        "answer, and keep the final answer short and clear.",
        "What is the capital of France? The capital of France is Paris. What is the largest "
        "planet in the solar system? Jupiter is the largest planet. How many days are there "
        "in a week? There are seven days in a week.",
        "I think the answer is correct because the numbers add up. Let me check the result "
        "again: the first value is smaller than the second one, so the total should be "
        "larger than both of them. Yes, that is right.",
        "Hello! How are you today? I am fine, thank you. Can you help me with my homework? "
        "Of course, what do you need? I need to write a story about a dragon and a knight.",
    ]
    word_game = [
        "Let's play a word guessing game. I am thinking of a secret word with five letters. "
        "Guess the word. After each guess I tell you which letters are in the right place "
        "and which letters are in the word but in the wrong place.",
        "My guess is CRANE. Feedback: C is absent, R is present, A is correct, N is absent, "
        "E is present. Next guess: SLATE. Feedback: S is absent, L is absent, A is correct, "
        "T is correct, E is correct. Next guess: GRATE. You win! The word was GRATE.",
        "apple bread chair dance eagle flame grape house input joker knife lemon money "
        "night ocean piano queen river stone table under voice water youth zebra words "
        "guess letter secret correct present absent wrong right green yellow gray",
    ]
    number_game = [
        "Let's play a number guessing game. I picked a number between 1 and 100. Guess the "
        "number and I will tell you if it is higher or lower. Guess: 50. Lower. Guess: 25. "
        "Higher. Guess: 37. Higher. Guess: 43. Lower. Guess: 40. Correct! You used 5 guesses.",
        " ".join(str(n) for n in range(0, 128)),
        " ".join(str(n * n) for n in range(0, 64)),
        "3.14159 2.71828 1.41421 0.5 -1 -42 1e-3 2026-11-05 12:30:00 100% 3/4 $19.99 #1",
    ]
    chat = [
        "system\nYou are a helpful assistant.\nuser\nWhat is 2 + 2?\nassistant\n2 + 2 = 4.\n",
        "user\nGuess my number. It is between 1 and 10.\nassistant\nIs it 5?\nuser\nHigher.\n"
        "assistant\nIs it 8?\nuser\nYes!\n",
        "assistant\nThe user wants the weather, so I should call the tool with the city.\n",
    ]
    tool_json = [
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
        '{"name": "guess", "arguments": {"word": "crane"}}',
        '{"name": "guess_number", "arguments": {"number": 42}}',
        '{"type": "function", "function": {"name": "get_weather", "description": "Get the '
        'current weather in a city.", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string", "description": "The city name."}}, "required": ["city"]}}}',
        '{"temperature": 21, "condition": "sunny", "humidity": 0.45, "ok": true, "error": null}',
        '{"feedback": "A is correct, R is present", "done": false, "reward": 0.0, "turn": 3}',
        '[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n{"a": [], "b": {}, "c": "", "d": [true, false]}',
    ]
    code = [
        "def add(a, b):\n    return a + b\n\n\nfor i in range(10):\n    print(i, add(i, i))\n",
        "if x > 0:\n\tprint('positive')\nelse:\n\tprint(\"not positive\")\n",
    ]
    # Repeating the shaped text makes its common pieces win merges over one-off prose.
    return prose + word_game + number_game + 3 * (chat + tool_json) + code


def build_tokenizer(
    out_dir: str | Path | None = None, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer; save it to `out_dir` for `AutoTokenizer.from_pretrained`.

    `vocab_size` counts every token (bytes, merges, added tokens) and is exact up to about
    1,180: past that the embedded corpus has no more pairs to merge and the vocabulary stops
    growing.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the 256 bytes and "
            f"{MIN_VOCAB_SIZE - 256} added tokens need at least {MIN_VOCAB_SIZE}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets covering the spaces that byte-level tokens carry.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        # The tag tokens are added after training and take the last ids.
        vocab_size=vocab_size - len(TAG_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=["<|im_start|>"],
        # Clean-up drops spaces before punctuation and breaks decode(encode(t)) == t.
        # transformers 5.19 already skips it for BPE, but only after a warning, and the
        # saved config should stay exact for any loader.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
