"""An OpenEnv server whose agent harness plays the episodes (the `WS /harness` route of production
mode, OpenEnv RFC 005), written only for tests with openenv's own classes: a HarnessEnvironment over a
scripted agent loop that calls its model through an OpenAI-compatible endpoint.

Usage: OPENAI_API_KEY=KEY harness_server.py --llm-port PORT
Prints `ENV_LISTENING http://127.0.0.1:PORT` once serving. The agent calls its model with the key of
$OPENAI_API_KEY, as OpenAI clients do (none: it calls without a key).

The agent asks the model for `ANSWER: <digit>` up to three times. A reply it cannot read is an error
turn for the model: a recoverable `error` event, and the reason sent back to the model as a user
message before it asks again. The turn completes with the environment's reward in `turn_complete`
(1.0 for the right digit, else the share of digits in the last reply: a number that varies). A task
message containing `rewrite history` makes the agent drop its first exchange before its second call.
"""

import argparse
import os
import re
import socket
from typing import AsyncIterator, Optional

import httpx
import uvicorn
from openenv.core.env_server import Observation, create_app
from openenv.core.harness import (AgenticHarnessAdapter, HarnessAction, HarnessConfig, HarnessEnvironment,
                                  HarnessEvent, HarnessEventType)

SECRET = "7"
CALLS = 3


class ScriptedAgent(AgenticHarnessAdapter):
    """The harness: no process of its own; each turn is a short loop of model calls."""

    def __init__(self, llm_url: str, api_key: Optional[str]):
        super().__init__(HarnessConfig(name="scripted-agent", command=["in-process"], session_timeout_s=120))
        self.llm_url = llm_url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.running = False

    async def start(self, working_directory: str) -> None:
        self.running = True

    async def stop(self) -> None:
        self.running = False

    async def inject_tools(self, tools, bridge_url: Optional[str] = None) -> None:
        pass  # the agent has no tools: it answers in text

    async def is_alive(self) -> bool:
        return self.running

    async def send_message_streaming(self, message: str) -> AsyncIterator[HarnessEvent]:
        messages = [{"role": "system", "content": "Reply with ANSWER: and one digit."},
                    {"role": "user", "content": message}]
        reply = ""
        async with httpx.AsyncClient(timeout=120, trust_env=False, headers=self.headers) as client:
            for call in range(CALLS):
                if call == 1 and "rewrite history" in message:
                    messages = messages[:2] + messages[4:]
                yield HarnessEvent(type=HarnessEventType.LLM_REQUEST, data={"messages": messages, "model": "policy"})
                answer = await client.post(self.llm_url + "/chat/completions",
                                           json={"model": "policy", "messages": messages, "max_tokens": 16})
                answer.raise_for_status()
                reply = answer.json()["choices"][0]["message"]["content"]
                yield HarnessEvent(type=HarnessEventType.LLM_RESPONSE, data={"content": reply})
                messages.append({"role": "assistant", "content": reply})
                found = re.search(r"ANSWER:\s*(\d)", reply)
                if found:
                    reward = float(found.group(1) == SECRET)
                    break
                problem = "your reply has no 'ANSWER: <digit>'; answer again"
                yield HarnessEvent(type=HarnessEventType.ERROR, data={"message": problem, "recoverable": True})
                messages.append({"role": "user", "content": problem})
            else:
                reward = sum(c.isdigit() for c in reply) / max(len(reply), 1)
        yield HarnessEvent(type=HarnessEventType.TURN_COMPLETE,
                           data={"response": reply, "done": True, "reward": reward})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llm-port", type=int, required=True)
    args = parser.parse_args()
    llm_url = f"http://127.0.0.1:{args.llm_port}/v1"
    api_key = os.environ.get("OPENAI_API_KEY")
    app = create_app(lambda: HarnessEnvironment(ScriptedAgent(llm_url, api_key)), HarnessAction, Observation,
                     mode="production")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"ENV_LISTENING http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
