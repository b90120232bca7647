"""A judge reads its rubric filled with the task and the trajectory, answers through an engine, and
its answer's number or verdict is the reward; an answer with neither is no reward, never a crash."""

from __future__ import annotations

import asyncio

import pytest

from bridge.envs.spec import RewardError, RewardSpec
from bridge.judge import Judge, parse_answer, transcript
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine

VERDICTS = {"yes": 1.0, "no": 0.0, "not sure": 0.5}


@pytest.mark.parametrize("answer, verdicts, expected", [
    ("7", None, 7.0),
    ("Score: 8/10", None, 8.0),
    ("Two of 3 words right; I give it 2.5/5.", None, 2.5),  # the last number: a judge's reasoning comes first
    ("The answer repeats 3 words. Final score: -0.5", None, -0.5),
    ("score 1e2", None, 100.0),
    ("+.25", None, 0.25),
    ("no number here", None, None),
    ("", None, None),
    ("1e400", None, None),  # no reward can be that
    ("99999999999", None, None),
    ("Yes.", VERDICTS, 1.0),
    ("At first I thought yes, but no", VERDICTS, 0.0),
    ("NOT SURE", VERDICTS, 0.5),  # the longer verdict, not the "sure" in it
    ("yesterday, nobody", VERDICTS, None),  # whole words only
    ("8", VERDICTS, None),  # with verdicts a number is not one
])
def test_the_answer_gives_its_last_number_or_verdict(answer, verdicts, expected):
    assert parse_answer(answer, verdicts) == expected


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
CONVERSATION = [{"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "say", "arguments": {"word": "hi"}}}]},
    {"role": "tool", "name": "say", "content": "said"}, {"role": "assistant", "content": "Done."}]


def judge(tok, answer, **spec):
    seen = []

    def policy(prompt):
        seen.append(prompt)
        return answer

    spec = {"kind": "judge", "judge": "policy", "template": "Task: {prompt}\nTarget: {target}\n{completion}\nScore:",
            **spec}
    return Judge(RewardSpec(**spec), ScriptedEngine(tok, policy), tok, {}), seen


def test_the_rubric_is_the_judges_one_user_message_and_its_answer_the_reward(tok):
    j, seen = judge(tok, "I would say 4")
    assert asyncio.run(j.score(PROMPT, CONVERSATION, {"target": "hi"})) == 4.0
    rubric = ("Task: Say hi.\nTarget: hi\nassistant: \n{\"name\": \"say\", \"arguments\": {\"word\": \"hi\"}}\n\n"
              "tool: said\n\nassistant: Done.\nScore:")
    assert j.rubric(PROMPT, CONVERSATION, {"target": "hi"}) == rubric
    assert seen == [tok.apply_chat_template([{"role": "user", "content": rubric}], tokenize=False,
                                            add_generation_prompt=True)]
    assert transcript(PROMPT + CONVERSATION).startswith("system: Be brief.\n\nuser: Say hi.\n\nassistant: ")


def test_a_malformed_answer_is_no_reward_counted(tok):
    j, _ = judge(tok, "It is fine, I think.", verdicts={"good": 1, "bad": -1})
    assert asyncio.run(j.score(PROMPT, CONVERSATION, {"target": "hi"})) is None
    assert j.stats == {"episodes": 1, "malformed": 1}


def test_a_rubric_naming_a_field_the_task_lacks_says_which(tok):
    j, _ = judge(tok, "1")
    with pytest.raises(RewardError, match=r"judge 'judge': its template names 'target', which this task does not "
                                          r"have \(it has seed; always: prompt, completion, conversation\)"):
        asyncio.run(j.score(PROMPT, CONVERSATION, {"seed": 3}))


def test_a_rubric_longer_than_the_engine_holds_names_the_judge_and_the_key(tok, tmp_path):
    from bridge.engines.jax_engine import JaxEngine
    from jaxrl.tiny import build_tiny_model

    engine = JaxEngine(build_tiny_model(tmp_path / "m", tokenizer=tok), max_seq_len=32, max_batch=1, tokenizer=tok)
    j = Judge(RewardSpec(kind="judge", judge="policy", template="{conversation}"), engine, tok, {})
    with pytest.raises(ValueError, match=r"^judge 'judge': its rubric filled with the episode has \d+ tokens, but its "
                                         r"engine holds 32 per sequence: raise bridge.engine_kwargs.max_seq_len"):
        asyncio.run(j.score(PROMPT, CONVERSATION, {}))
