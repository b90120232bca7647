"""The one episode loop every environment kind runs under: the `EpisodeHook` the bridge's rollout
loop drives, over whatever `Connector.open(task) -> episode` gives (`served`, `in_process`,
`tool_class`; a rollout function runs its own loop, `rollout_fn`). One loop, so that prompts,
tool-call parsing, masks and error handling cannot drift apart between kinds.

The first prompt is reset's observation as the user message, or, for a task in TRL's dataset
format (a `prompt` field), that prompt with the observation appended to its last message
(`first_prompt`). In the tool modes the parser reads the reply decoded without special tokens
but with its tool-call delimiters, which some tokenizers mark special (`hidden_special_ids`); a
turn without a tool call is the model's final answer. Malformed calls, unknown tools, bad
arguments and tools that raise come back to the model as `Error: ...` tool results (counted in
the episode's `tool_errors`), never as a crash; in text mode an action the environment refuses
comes back as an `Error: ...` user turn (counted in `action_errors`) and the episode goes on.
Everything the environment says is rendered with the model's chat template and appended with
loss mask 0.

A lost session (`SessionLost`) or an unreachable endpoint (`EndpointUnavailable`) is raised out
of the hook: the bridge replays the whole episode from `reset()` on a fresh session.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from bridge.envs.spec import task_prompt
from bridge.rollout import TurnResult
from bridge.tool_calls import format_tool_results

if TYPE_CHECKING:
    from bridge.envs.openenv_episode import SessionConnector, SessionEpisode
    from bridge.envs.runtime import EnvRuntime
    from bridge.envs.tool_class import ToolClassConnector, ToolClassEpisode


@dataclasses.dataclass
class EpisodeRecord:
    """What reward functions see of an episode's environment (`environments[i]` for remote ones)."""

    env: str
    task: dict[str, Any]
    observations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    done: bool = False

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))

    @property
    def last_observation(self) -> dict[str, Any]:
        return self.observations[-1] if self.observations else {}


@dataclasses.dataclass
class Step:
    """The environment's answer to one action: what the model reads, whether the episode ended, and
    whether it was an error (counted in the episode's metrics)."""

    text: str
    done: bool = False
    error: bool = False


def first_prompt(prompt: Any, observation: str, system_prompt: str = "", action_hint: str | None = None
                 ) -> list[dict[str, Any]]:
    """An episode's first prompt as chat messages. A task with a `prompt` (TRL's dataset format: a
    string or chat messages) gets reset's text appended to its last message, with no separator,
    as TRL's GRPOTrainer does; a task without one has reset's text as its user message. The
    spec's system prompt goes first unless the prompt has its own; `action_hint` (what a text-mode
    reply is) ends the system message, whichever it is."""
    if prompt is None:
        messages = [{"role": "user", "content": observation}]
    else:
        messages = task_prompt(prompt)
        if observation:
            last = messages[-1]
            content = last.get("content")
            if isinstance(content, list):  # content parts (multimodal prompts)
                content = content + [{"type": "text", "text": observation}]
            else:
                content = (content or "") + observation
            messages[-1] = {**last, "content": content}
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if action_hint:
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": action_hint})
        elif isinstance(messages[0].get("content"), str):
            messages[0] = {**messages[0], "content": "\n\n".join(filter(None, [messages[0]["content"], action_hint]))}
    return messages


def empty_prompt_warning(episode: Any) -> str:
    """What to say of an episode whose first user turn came out empty, naming what reset did send."""
    observation = episode.record.observations[0] if getattr(episode, "record", None) else {}
    sent = ", ".join(f"{k}[{', '.join(map(repr, v))}]" if k == "metadata" and isinstance(v, dict) else k
                     for k, v in observation.items() if v not in (None, "", [], {})) or "nothing"
    return (f"reset's observation shows the model nothing (it sent: {sent}), and the task has no prompt: the first "
            "user turn is empty. Set observation_template (e.g. '{metadata[...]}' for what the server puts in "
            "metadata) or observation_field, or give the tasks a prompt (data.train_file)")


class EnvEpisodeHook:
    """Drives one episode: reset -> prompt, model turns -> actions, observations -> tokens."""

    def __init__(self, runtime: EnvRuntime, connector: SessionConnector | ToolClassConnector, task: dict[str, Any],
                 group_id: str | None = None):
        self.runtime = runtime
        self.connector = connector
        self.spec = connector.spec
        self.task = task
        self.group_id = group_id
        self.episode: SessionEpisode | ToolClassEpisode | None = None
        self.closed = False
        self.metrics = {"tool_calls": 0.0, "tool_errors": 0.0, "env_steps": 0.0}
        self.prompt: list[dict[str, Any]] = []  # the first prompt's messages
        self.conversation: list[dict[str, Any]] = []  # the model's turns and the answers, as messages

    async def start(self) -> list[int]:
        self.episode = await self.connector.open(self.task)
        self.metrics.update(self.episode.metrics)
        self.prompt = first_prompt(self.task.get("prompt"), self.episode.first_text, self.spec.system_prompt,
                                   getattr(self.connector, "action_hint", None))
        if not str(self.prompt[-1].get("content") or "").strip():
            self.runtime.warn_once(self.spec.name, "empty_prompt", empty_prompt_warning(self.episode))
        if self.runtime.groups.mixed(self.spec, self.group_id, self.prompt):
            self.metrics["groups_mixed"] = 1.0
        return self.runtime.render.prompt_ids(self.prompt, self.episode.tools)

    async def turn(self, completion_ids: list[int]) -> TurnResult:
        tok = self.runtime.tokenizer
        if getattr(self.episode, "mode", None) == "tool_class" or self.connector.mode != "text":
            hidden = self.runtime.hidden_ids
            parsed = self.runtime.parser.parse(tok.decode([i for i in completion_ids if i not in hidden]))
            self.conversation.append(parsed.to_message())
            if not parsed.calls and not parsed.errors:
                return TurnResult([], done=False)  # the final answer
            self.metrics["tool_errors"] += len(parsed.errors)
            results, done = [], False
            for call in parsed.calls:
                if done:
                    results.append("Error: the episode ended before this call.")
                    self.metrics["tool_errors"] += 1
                    continue
                step = await self.episode.call_tool(call.name, call.arguments)
                self.metrics["tool_calls"] += 1
                self.metrics["env_steps"] += 1
                self.metrics["tool_errors"] += step.error
                results.append(step.text)
                done = step.done
            messages = format_tool_results(parsed.calls, results, parsed.errors)
        else:
            reply = tok.decode(completion_ids, skip_special_tokens=True).strip()
            self.conversation.append({"role": "assistant", "content": reply})
            step = await self.episode.act_text(reply)
            self.metrics["env_steps"] += 1
            self.metrics["action_errors"] = self.metrics.get("action_errors", 0.0) + step.error
            done = step.done
            messages = [{"role": "user", "content": step.text}]
        self.conversation += messages
        if done:
            return TurnResult([], done=True)
        return TurnResult(self.runtime.render.answer_ids(completion_ids, messages), done=False)

    async def finish(self, trajectory) -> dict[str, float]:
        """The episode's rewards by name (functions answering None leave theirs out); the trajectory
        takes the runtime's warnings about this environment not yet handed on."""
        if self.episode is None:
            return {}
        trajectory.notices = self.runtime.take_notices(self.spec.name)
        await self.close()
        return await self.runtime.rewards.score(self, trajectory)

    async def close(self) -> None:
        if self.episode is not None and not self.closed:
            self.closed = True
            await self.episode.close()
