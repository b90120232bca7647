"""What the model is shown of an environment: observations as text, schemas with their references
inlined, tools in the chat templates' form."""

from __future__ import annotations

import pytest

from bridge.envs.openenv_episode import resolve_action_mode
from bridge.envs.render import RenderError, as_function_tool, inline_refs, observation_text
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
