"""A reward model of the `judge` kind: a generative model reads a rubric filled with the task and the
trajectory and answers; the answer's score is the reward.

The rubric (`template`) is the judge's one user message, rendered with its tokenizer's chat template
and generated greedily through an engine like any generation: the policy's own (`judge: policy`), or
one the bridge serves over the judge's directory. `parse_answer` takes the score: the answer's last
number, or with `verdicts` its last verdict word. A judge that answers neither gives no reward (None:
the reward does not apply to the episode), never a crash; the caller counts it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from bridge.engines.base import Engine, PromptTooLong, SamplingParams
from bridge.envs.render import prompt_ids
from bridge.envs.spec import JUDGE_FIELDS, MAX_ABS_REWARD, RewardError, RewardSpec

log = logging.getLogger(__name__)

# A number not after "/": "8/10" scores 8.
_NUMBER = re.compile(r"(?<![/\d.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def parse_answer(answer: str, verdicts: Mapping[str, float] | None) -> float | None:
    """The score of a judge's `answer`: with `verdicts`, the reward of the last verdict word in it (whole
    words, any case); without, its last number (of "8/10", 8). None where there is none (or a number beyond what a
    reward may be)."""
    if verdicts:
        words = sorted(verdicts, key=len, reverse=True)  # "not correct" before "correct"
        pattern = r"(?<!\w)(" + "|".join(re.escape(w) for w in words) + r")(?!\w)"
        found = re.findall(pattern, answer, flags=re.IGNORECASE)
        if not found:
            return None
        by_word = {w.lower(): float(v) for w, v in verdicts.items()}
        return by_word[found[-1].lower()]
    numbers = _NUMBER.findall(answer)
    if not numbers:
        return None
    value = float(numbers[-1])
    return value if math.isfinite(value) and abs(value) <= MAX_ABS_REWARD else None


def _text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def transcript(messages: Sequence[Mapping[str, Any]]) -> str:
    """Chat messages as the text a judge reads: `role: content` paragraphs, tool calls as JSON."""
    parts = []
    for m in messages:
        text = f"{m.get('role', '?')}: {_text(m)}"
        for call in m.get("tool_calls") or []:
            text += "\n" + json.dumps(call.get("function", call), default=str)
        parts.append(text)
    return "\n\n".join(parts)


class Judge:
    """Judges episodes with `engine` (whose model `tokenizer` renders for) by the rubric of `spec`."""

    def __init__(self, spec: RewardSpec, engine: Engine, tokenizer: Any, template_kwargs: Mapping[str, Any]):
        self.spec, self.engine, self.tokenizer = spec, engine, tokenizer
        self.template_kwargs = dict(template_kwargs)
        self.params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens,
                                     stop_token_ids=(tokenizer.eos_token_id,))
        self.stats = {"episodes": 0, "malformed": 0}

    def rubric(self, prompt: Sequence[Mapping[str, Any]], conversation: Sequence[Mapping[str, Any]],
               task: Mapping[str, Any]) -> str:
        """The template filled: {prompt} the task's last user message, {completion} what followed it,
        {conversation} both, any other name a task field; RewardError naming a field the task lacks."""
        users = [m for m in prompt if m.get("role") == "user"]
        fields = {**task, "prompt": _text(users[-1]) if users else "",
                  "completion": transcript(conversation), "conversation": transcript([*prompt, *conversation])}
        try:
            return self.spec.template.format(**fields)
        except (KeyError, IndexError, AttributeError) as e:
            raise RewardError(f"judge {self.spec.key!r}: its template names {e}, which this task does not have "
                              f"(it has {', '.join(sorted(task)) or 'no fields'}; always: {', '.join(JUDGE_FIELDS)})"
                              ) from None

    async def score(self, prompt: Sequence[Mapping[str, Any]], conversation: Sequence[Mapping[str, Any]],
                    task: Mapping[str, Any]) -> float | None:
        """The judge's score of the episode; None where its answer holds none."""
        ids = prompt_ids(self.tokenizer, [{"role": "user", "content": self.rubric(prompt, conversation, task)}],
                         None, self.template_kwargs)
        try:
            [[completion]] = await self.engine.generate([ids], self.params)
        except PromptTooLong as e:  # not the episode's prompt: say which sequence and which key sizes it
            raise ValueError(f"judge {self.spec.key!r}: its rubric filled with the episode has {e.tokens} tokens, but "
                             f"its engine holds {e.limit} per sequence: raise bridge.engine_kwargs.max_seq_len, or "
                             "show the judge less ({completion} rather than {conversation})") from None
        answer = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        value = parse_answer(answer, self.spec.verdicts)
        self.stats["episodes"] += 1
        if value is None:
            self.stats["malformed"] += 1
            if self.stats["malformed"] == 1:
                log.warning("judge %r: an answer without a %s (%r): no reward for that episode; judge_malformed "
                            "counts them", self.spec.key, "verdict" if self.spec.verdicts else "number", answer[:200])
        return value
