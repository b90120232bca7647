"""The OpenAI-compatible chat completions endpoint a harness calls: served on 127.0.0.1 (or, with TLS,
beyond), to callers with its key only, answers with the token ids and logprobs the engine produced
(as vLLM does with return_token_ids), continues an episode's conversation token for token, and
refuses what it cannot take in one line."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import httpx
import pytest

from bridge.engines.base import PromptTooLong, SamplingParams
from bridge.envs.chat_endpoint import BUDGET_SPENT, ChatEndpoint
from bridge.envs.rollout_fn import GenerationHandle
from bridge.tool_calls import get_parser
from jaxrl.tiny_tokenizer import build_tokenizer
from scripted_engine import ScriptedEngine, tool_call

TOK = build_tokenizer()
PARAMS = SamplingParams(max_tokens=64, stop_token_ids=(TOK.eos_token_id,), seed=3)
KEY = "the-harness-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_then_second(prompt: str) -> str:
    return "first" if "again" not in prompt else "second"


async def served(test, policy=first_then_second):
    """`test(endpoint, client, handle)` against a running endpoint over a scripted engine."""
    endpoint = ChatEndpoint(free_port(), "policy", get_parser(), KEY)
    await endpoint.start()
    handle = GenerationHandle(ScriptedEngine(TOK, policy), TOK, PARAMS)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{endpoint.port}/v1", trust_env=False,
                                     headers=AUTH) as client:
            return await test(endpoint, client, handle)
    finally:
        await endpoint.aclose()


SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Say something."}


def test_a_call_answers_with_the_engines_ids_and_logprobs_and_the_next_one_continues_them():
    async def test(endpoint, client, handle):
        with endpoint.attach(handle) as calls:
            first = (await client.post("/chat/completions", json={"messages": [SYSTEM, USER]})).json()
            reply = first["choices"][0]["message"]
            again = [SYSTEM, USER, reply, {"role": "user", "content": "Try again."}]
            second = (await client.post("/chat/completions", json={"messages": again, "max_tokens": 4})).json()
        return first, second, calls, handle.generations

    first, second, calls, (g1, g2) = asyncio.run(served(test))
    assert first["prompt_token_ids"] == TOK.apply_chat_template([SYSTEM, USER], add_generation_prompt=True,
                                                                tokenize=True)["input_ids"]
    choice = first["choices"][0]
    assert choice["token_ids"] == g1.ids and choice["message"]["content"] == "first"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == g1.logprobs
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in g1.ids]
    assert first["usage"]["completion_tokens"] == len(g1.ids)
    # the second prompt holds the first reply as sampled (its EOS included), then the new message
    assert second["prompt_token_ids"][:len(g1.prompt_ids) + len(g1.ids)] == g1.prompt_ids + g1.ids
    assert "Try again." in TOK.decode(second["prompt_token_ids"][len(g1.prompt_ids) + len(g1.ids):])
    assert second["choices"][0]["token_ids"] == g2.ids and len(g2.ids) <= 4
    assert [c.continues for c in calls] == [True, True]


def test_a_call_that_edits_the_history_is_rendered_afresh_and_marked():
    async def test(endpoint, client, handle):
        with endpoint.attach(handle) as calls:
            first = (await client.post("/chat/completions", json={"messages": [USER]})).json()
            edited = {"role": "assistant", "content": "something I never said"}
            await client.post("/chat/completions", json={"messages": [USER, edited, USER]})
        return first, calls

    first, calls = asyncio.run(served(test))
    assert [c.continues for c in calls] == [True, False]
    assert calls[1].generation.prompt_ids == TOK.apply_chat_template(
        [USER, {"role": "assistant", "content": "something I never said"}, USER], add_generation_prompt=True,
        tokenize=True)["input_ids"]


@pytest.mark.parametrize("body, status, message", [
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0] must be an object with a role among"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content must be a string"),
    ({"messages": [USER], "n": 2}, 400, "n must be 1"),
    ({"messages": [USER], "stream": True}, 400, "stream must be false"),
    ({"messages": [USER], "max_tokens": 0}, 400, "max_tokens must be a whole number >= 1, got 0"),
    ({"messages": [USER], "top_p": 0}, 400, "top_p is 0: temperature must be >= 0 and top_p in (0, 1]"),
    ({"messages": [USER], "stop": [1]}, 400, "stop must be a string or a list of strings"),
    ("not json", 400, "the request body is not JSON"),
    ({"messages": [USER]}, 409, "no episode is running on this endpoint"),
])
def test_what_the_endpoint_cannot_take_is_refused_in_one_line(body, status, message):
    async def test(endpoint, client, handle):
        if isinstance(body, str):
            return await client.post("/chat/completions", content=body)
        return await client.post("/chat/completions", json=body)

    answer = asyncio.run(served(test))
    assert answer.status_code == status and message in answer.json()["error"]["message"]


def test_a_port_in_use_names_the_key_to_change():
    async def test():
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            with pytest.raises(OSError, match="set the environment's harness_port to a free port"):
                await ChatEndpoint(busy.getsockname()[1], "policy", get_parser(), KEY).start()

    asyncio.run(test())


def test_models_lists_the_served_model():
    async def test(endpoint, client, handle):
        return (await client.get("/models")).json()

    assert asyncio.run(served(test))["data"] == [{"id": "policy", "object": "model"}]


def test_sampling_settings_of_the_request_reach_the_engine():
    seen = []

    class Recording(ScriptedEngine):
        async def generate(self, prompts, params):
            seen.append(params)
            return await super().generate(prompts, params)

    async def test(endpoint, client, handle):
        handle = GenerationHandle(Recording(TOK, lambda p: "ok"), TOK, PARAMS)
        with endpoint.attach(handle):
            await client.post("/chat/completions", json={"messages": [USER], "max_completion_tokens": 5,
                                                         "temperature": 0.5, "top_p": 0.9, "stop": "\n"})

    asyncio.run(served(test))
    assert (seen[0].max_tokens, seen[0].temperature, seen[0].top_p, seen[0].stop) == (5, 0.5, 0.9, ("\n",))


def test_replies_keep_to_the_runs_token_limits_and_a_spent_budget_ends_the_loop_unrecorded():
    async def test(endpoint, client, handle):
        handle = GenerationHandle(ScriptedEngine(TOK, lambda p: "a long reply that goes on " * 3), TOK,
                                  SamplingParams(max_tokens=6, stop_token_ids=(TOK.eos_token_id,),
                                                 max_total_tokens=20))
        answers, messages = [], [USER]
        with endpoint.attach(handle) as calls:
            for _ in range(4):
                answer = (await client.post("/chat/completions", json={"messages": messages, "max_tokens": 50})).json()
                answers.append(answer)
                messages = messages + [answer["choices"][0]["message"], {"role": "user", "content": "More."}]
        return answers, calls

    answers, calls = asyncio.run(served(test))
    assert all(len(a["choices"][0]["token_ids"]) <= 6 for a in answers if "token_ids" in a["choices"][0])
    first, last = calls[0].generation, calls[-1].generation
    assert len(last.prompt_ids) + len(last.ids) - len(first.prompt_ids) <= 20  # the episode's budget
    assert [a["choices"][0]["message"]["content"] for a in answers[2:]] == [BUDGET_SPENT] * 2 and len(calls) == 2


def test_a_prompt_the_engine_cannot_hold_is_refused_and_kept_for_the_episodes_error():
    class Short(ScriptedEngine):
        async def generate(self, prompts, params):
            raise PromptTooLong(0, len(prompts[0]), 8)

    async def test(endpoint, client, handle):
        with endpoint.attach(GenerationHandle(Short(TOK, str), TOK, PARAMS)):
            answer = await client.post("/chat/completions", json={"messages": [USER]})
            return answer, list(endpoint.refusals)

    answer, refusals = asyncio.run(served(test))
    assert answer.status_code == 400 and "but the engine holds 8 tokens per sequence" in refusals[-1]
    assert "rollout.max_prompt_tokens + rollout.max_total_tokens" in answer.json()["error"]["message"]


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_with_tools_offered_the_models_calls_come_back_as_tool_calls_and_their_results_continue_it():
    def policy(prompt):
        return tool_call("add", {"a": 2, "b": 3}) if "<tool_response>" not in prompt else "5"

    async def test(endpoint, client, handle):
        with endpoint.attach(handle) as calls:
            first = (await client.post("/chat/completions", json={"messages": [USER], "tools": TOOLS})).json()
            message = first["choices"][0]["message"]
            call = message["tool_calls"][0]
            # a harness re-serialises the arguments and sends the result back
            echoed = {**message, "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"b": 3, "a": 2}'}}]}
            result = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
            second = (await client.post("/chat/completions",
                                        json={"messages": [USER, echoed, result], "tools": TOOLS})).json()
        return first, second, calls

    first, second, calls = asyncio.run(served(test, policy))
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert [c.continues for c in calls] == [True, True]
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "5"}


def test_a_tool_call_that_does_not_parse_comes_back_as_the_models_text():
    async def test(endpoint, client, handle):
        with endpoint.attach(handle):
            return (await client.post("/chat/completions", json={"messages": [USER], "tools": TOOLS})).json()

    message = asyncio.run(served(test, lambda p: "<tool_call>{not json"))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<tool_call>{not json"}


def test_messages_the_chat_template_cannot_render_are_refused_and_kept_for_the_episodes_error():
    async def test(endpoint, client, handle):
        with endpoint.attach(handle):
            answer = await client.post("/chat/completions", json={"messages": [{"role": "tool"}]})
            return answer, list(endpoint.refusals)

    answer, refusals = asyncio.run(served(test))
    assert answer.status_code == 400 and "the model's chat template cannot render these messages" in refusals[-1]


def test_a_request_held_open_does_not_hold_up_the_endpoints_shutdown():
    entered = asyncio.Event()

    class Stuck(ScriptedEngine):
        async def generate(self, prompts, params):
            entered.set()
            await asyncio.Event().wait()  # a generation that never ends

    async def test():
        endpoint = ChatEndpoint(free_port(), "policy", get_parser(), KEY)
        await endpoint.start()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{endpoint.port}/v1", trust_env=False, headers=AUTH,
                                     timeout=None) as client:  # the client waits as long as the server does
            with endpoint.attach(GenerationHandle(Stuck(TOK, str), TOK, PARAMS)):
                call = asyncio.create_task(client.post("/chat/completions", json={"messages": [USER]}))
                await entered.wait()
                async with asyncio.timeout(30):
                    await endpoint.aclose()
            call.cancel()

    asyncio.run(test())


def test_openenvs_own_probe_grades_the_endpoint_trainable_with_tool_support():
    from openenv.core.harness.capture import validate_llm

    async def test(endpoint, client, handle):
        with endpoint.attach(handle):
            return await asyncio.to_thread(validate_llm, f"http://127.0.0.1:{endpoint.port}/v1", "policy", timeout=30,
                                           api_key=KEY)

    # the probe offers a `bash` tool and expects the model to call it
    report = asyncio.run(served(test, lambda p: tool_call("bash", {"command": "ls"}) if "bash" in p else "hello"))
    assert report.ok and report.capture_level == "tokens" and report.tool_support == "ok", report


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}])
def test_a_call_without_the_key_is_refused_and_changes_no_episode(headers):
    async def test(endpoint, client, handle):
        with endpoint.attach(handle):
            chat = await client.post("/chat/completions", json={"messages": [USER]}, headers=headers)
            models = await client.get("/models", headers=headers)
            return chat, models, list(endpoint.calls), list(endpoint.refusals), handle.generations

    async def without_the_default_key(endpoint, client, handle):
        client.headers.pop("Authorization")
        return await test(endpoint, client, handle)

    chat, models, calls, refusals, generations = asyncio.run(served(without_the_default_key))
    assert chat.status_code == models.status_code == 401
    assert chat.headers["www-authenticate"] == "Bearer"
    assert "requires its key as `Authorization: Bearer KEY`" in chat.json()["error"]["message"]
    assert calls == refusals == generations == []


def test_a_call_without_the_key_is_answered_before_its_body_is_read():
    # A body announced but never sent: a route that read it would wait for ever.
    async def test(endpoint, client, handle):
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(10):
            status = await reader.readline()
        writer.close()
        return status

    assert asyncio.run(served(test)).startswith(b"HTTP/1.1 401")


def test_a_certificate_that_cannot_serve_is_named_in_one_line(tmp_path):
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    endpoint = ChatEndpoint(free_port(), "policy", get_parser(), KEY,
                            tls=(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")))
    with pytest.raises(OSError, match=f"cannot serve TLS with harness_tls_cert {tmp_path / 'cert.pem'} and "
                                      f"harness_tls_key {tmp_path / 'key.pem'} .*; give a PEM certificate"):
        asyncio.run(endpoint.start())


def self_signed(tmp_path, address: str) -> tuple[str, str]:
    """A certificate for `address` and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")


def test_beyond_loopback_the_endpoint_serves_https_that_verifies_to_key_holders(tmp_path):
    # Listening on every address (0.0.0.0: beyond loopback, so TLS is required) is reached here through
    # 127.0.0.1, which every machine has; the certificate is for that address and the client verifies it.
    address = "127.0.0.1"
    cert, key = self_signed(tmp_path, address)

    async def test():
        endpoint = ChatEndpoint(free_port(), "policy", get_parser(), KEY, host="0.0.0.0", tls=(cert, key))
        await endpoint.start()
        verify = ssl.create_default_context(cafile=cert)
        try:
            async with httpx.AsyncClient(base_url=f"https://{address}:{endpoint.port}/v1", trust_env=False,
                                         verify=verify) as client:
                with endpoint.attach(GenerationHandle(ScriptedEngine(TOK, lambda p: "hi"), TOK, PARAMS)):
                    chat = await client.post("/chat/completions", json={"messages": [USER]}, headers=AUTH)
                    stranger = await client.get("/models")
            return chat, stranger
        finally:
            await endpoint.aclose()

    chat, stranger = asyncio.run(test())
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "hi"
    assert stranger.status_code == 401
