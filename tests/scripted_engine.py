"""A generation engine that answers by a policy over the decoded prompt, for environment tests.

It stands in for the model where a test needs chosen replies (tool calls, mistakes): the hook,
the rollout loop and the environments around it are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable

from bridge.engines.base import Completion, SamplingParams

TOKEN = "scripted-bridge-token"  # what `in_process_bridge` bridges require


class ScriptedEngine:
    name = "scripted"

    def __init__(self, tokenizer, policy: Callable[[str], str], delay_s: float = 0.0):
        self.tokenizer = tokenizer
        self.policy = policy
        self.delay_s = delay_s
        self.policy_version = 0
        self.calls = 0

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for prompt in prompts:
            text = self.policy(self.tokenizer.decode(prompt, skip_special_tokens=False))
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens - 1]
            ids.append(self.tokenizer.eos_token_id)
            out.append([Completion(ids, [-0.5] * len(ids), "stop", self.policy_version)] * params.n)
        return out

    async def load_snapshot(self, path: str, version: int) -> float:
        self.policy_version = version
        return 0.0

    async def close(self) -> None:
        pass


def tool_call(name: str, arguments: dict) -> str:
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def guess_number_policy(prompt: str) -> str:
    """Bisects from the task text and the answers so far; a malformed call first when low is odd."""
    low, high = map(int, re.search(r"between (\d+) and (\d+)", prompt).groups())
    answers = re.findall(r"guess\((\d+)\): (higher|lower)", prompt)
    if low % 2 == 1 and "<tool_response>" not in prompt:
        return "<tool_call>\n{not json\n</tool_call>"
    for n, result in answers:
        if result == "higher":
            low = max(low, int(n) + 1)
        else:
            high = min(high, int(n) - 1)
    return tool_call("guess", {"n": (low + high) // 2})


def segments(traj):
    """(loss mask, token ids) runs of a trajectory's completion."""
    out = []
    for t, m in zip(traj.completion_ids, traj.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


@contextlib.contextmanager
def in_process_bridge(engine, envs: dict, tokenizer):
    """A real gRPC bridge over `engine` serving `envs` (an environments-file dict), in a thread;
    it requires TOKEN."""
    import threading

    from bridge.client import BridgeClient
    from bridge.envs.runtime import runtime_from_dict
    from bridge.server import serve

    runtime = runtime_from_dict(envs, tokenizer)
    ready, box = threading.Event(), {}

    def on_listening(address):
        box["address"] = address
        ready.set()

    thread = threading.Thread(target=lambda: asyncio.run(
        serve(engine, on_listening=on_listening, handle_signals=False, grace_s=1.0, envs=runtime, token=TOKEN)),
        daemon=True)
    thread.start()
    assert ready.wait(60), "the in-process bridge did not start"
    try:
        yield box["address"]
    finally:
        with BridgeClient(box["address"], token=TOKEN) as c:
            c.shutdown()
        thread.join(10)
