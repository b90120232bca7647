"""What the model is shown of an environment: observations as text, schemas with their references
inlined, tools in the chat templates' form."""

from __future__ import annotations

import pytest

from bridge.envs.openenv_episode import resolve_action_mode
from bridge.envs.render import RenderCache, RenderError, answer_ids, as_function_tool, inline_refs, observation_text, prompt_ids
from bridge.envs.spec import EnvSpec


def schema(props, required):
    return {"type": "object", "properties": props, "required": required}


def test_observation_text_and_tool_specs():
    assert observation_text({"text": "hi", "reward": 1}) == "hi"
    assert observation_text({"board": [1, 2], "done": False}) == "board: [1, 2]"
    # Every field that says something, the text-like one first; empty ones and bookkeeping left out.
    assert observation_text({"x": 0, "y": 3, "message": "Keep going...", "hint": None, "log": [], "note": "",
                             "won": False, "metadata": {"a": 1}}) == "Keep going...\nx: 0\ny: 3\nwon: false"
    assert observation_text({"a": "x", "b": 3}, "b") == "3"
    assert observation_text({"x": 1, "y": 2, "message": "hi"}, template="({x}, {y}) {message}") == "(1, 2) hi"
    with pytest.raises(RenderError, match="'{z}'.*KeyError: 'z'"):
        observation_text({"x": 1}, template="{z}")
    tool = as_function_tool({"name": "add", "input_schema": schema({"a": {"type": "integer"}}, ["a"])})
    assert tool["function"]["parameters"]["required"] == ["a"] and tool["type"] == "function"


def test_references_are_inlined_with_their_siblings_and_recursion_stops():
    schema = {"$defs": {"Move": {"enum": ["UP", "DOWN"], "type": "string"},
                        "Tree": {"description": "a tree", "type": "object",
                                 "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}}}}},
              "properties": {"move": {"$ref": "#/$defs/Move", "description": "where"}, "tree": {"$ref": "#/$defs/Tree"},
                             "definitions": {"type": "string"}}}
    assert inline_refs(schema) == {"properties": {
        "move": {"enum": ["UP", "DOWN"], "type": "string", "description": "where"},
        "tree": {"description": "a tree", "type": "object", "properties": {
            "kids": {"type": "array", "items": {"type": "object", "description": "a tree"}}}},
        "definitions": {"type": "string"}}}  # a field may be called "definitions"
    assert resolve_action_mode(EnvSpec("e", url="http://127.0.0.1:1"),
                               {"$defs": schema["$defs"], "properties": {"move": {"$ref": "#/$defs/Move"}},
                                "required": ["move"]}) == ("tool", None)  # an enum is not free text


def test_the_render_cache_gives_the_renderings_ids_and_renders_each_input_once():
    from jaxrl.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer()
    cache = RenderCache(tok, {}, size=2)
    tools = [as_function_tool({"name": "guess", "description": "Guess.", "parameters": schema({"n": {"type": "integer"}},
                                                                                            ["n"])})]
    first = [{"role": "user", "content": "Guess my number."}]
    assert cache.prompt_ids(first, tools) == prompt_ids(tok, first, tools, {}) == cache.prompt_ids(first, tools)
    answer = [{"role": "tool", "name": "guess", "content": "higher"}]
    for turn in ([5, 6, tok.eos_token_id], [5, 6]):  # a turn that wrote its end, and one cut short
        assert cache.answer_ids(turn, answer) == answer_ids(tok, turn, answer, {})
    assert cache.stats == {"hits": 1, "misses": 3}
    ids = cache.answer_ids([7, tok.eos_token_id], answer)  # the same answer after another turn: a hit
    ids.append(0)  # the caller's list is its own
    assert cache.answer_ids([7, tok.eos_token_id], answer) == answer_ids(tok, [7, tok.eos_token_id], answer, {})
    assert cache.stats == {"hits": 3, "misses": 3} and len(cache._ids) == 2  # bounded: the prompt was evicted
