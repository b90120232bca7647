"""One task per group, checked: a server whose reset ignores the seed gives a group's episodes
different questions, which the bridge counts and warns of once (or stops on); a group of one task,
and groups of the bundled environments, pass quietly."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from bridge.envs.runtime import EnvRuntime
from bridge.envs.spec import EnvSpec
from bridge.rollout import run_episode
from bridge.tool_calls import get_parser
from episodes import PARAMS, catalogue_spec, scripted, serve_catalogue
from jaxrl.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def quiz():
    with serve_catalogue(["quiz"]) as urls:
        yield urls


def play_groups(tok, spec, task, groups=("g0",), size=4):
    """`size` episodes of `task` in each group of `groups`, on one runtime (as one bridge runs them)."""
    runtime = EnvRuntime([spec], tok, get_parser())
    engine = scripted(tok, ["7"] * size * len(groups))
    params = dataclasses.replace(PARAMS, max_turns=1, max_total_tokens=512)

    async def go():
        await runtime.start()
        try:
            return await asyncio.gather(*(run_episode(engine, g, j, [], params, runtime.hook(spec.name, dict(task), g),
                                                      env=spec.name)
                                          for g in groups for j in range(size)))
        finally:
            await runtime.aclose()

    return asyncio.run(go())


def test_a_server_that_ignores_the_seed_mixes_a_group_and_is_counted_and_warned_of_once(tok, quiz, caplog):
    with caplog.at_level(logging.WARNING, logger="bridge.envs.group_check"):
        trajs = play_groups(tok, catalogue_spec(quiz, "quiz", "served"), {"seed": 3}, ("g0", "g1"))
    assert len({tok.decode(t.prompt_ids) for t in trajs[:4]}) > 1
    assert sum(t.metrics.get("groups_mixed", 0.0) for t in trajs) == 2  # once per group
    [warning] = [r.getMessage() for r in caplog.records if "started from different first prompts" in r.getMessage()]
    assert "environment 'quiz'" in warning and "data.splits" in warning and "env/quiz/groups_mixed" in warning
    trajs = play_groups(tok, catalogue_spec(quiz, "quiz", "served", mixed_groups="error"), {"seed": 3})
    assert any(t.finish_reason == "error" and t.error.startswith("MixedGroupError: environment 'quiz'") for t in trajs)


@pytest.mark.parametrize("where", ["served", "in_process"])
def test_a_group_of_one_task_passes_quietly(tok, quiz, where, caplog):
    with caplog.at_level(logging.WARNING, logger="bridge.envs.group_check"):
        trajs = play_groups(tok, catalogue_spec(quiz, "quiz", where, mixed_groups="error"),
                            {"split": "test", "index": 1})
    assert all(t.finish_reason == "env_done" and "groups_mixed" not in t.metrics for t in trajs), \
        [t.error for t in trajs]
    assert not [r for r in caplog.records if r.name == "bridge.envs.group_check"]


@pytest.mark.parametrize("name", ["echo", "wordle", "guess_number"])
def test_groups_of_the_bundled_environments_are_one_task(tok, name):
    from bridge.envs.bundled import BUNDLED

    bundled = BUNDLED[name]
    spec = EnvSpec(name, env_class=f"{bundled.env_cls.__module__}:{bundled.env_cls.__name__}", mixed_groups="error",
                   action_class=f"{bundled.action_cls.__module__}:{bundled.action_cls.__name__}",
                   observation_field="text")
    trajs = play_groups(tok, spec, {"seed": 11, "split": "train"})
    assert not any(t.error.startswith("MixedGroupError") for t in trajs), [t.error for t in trajs]
    assert len({tok.decode(t.prompt_ids) for t in trajs}) == 1
