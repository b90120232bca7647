"""Function tools: schemas from hints and docstrings, as TRL renders them, and the errors of
functions that cannot be tools."""

from __future__ import annotations

import json
from typing import Literal, Optional

import pytest

from bridge.envs.function_tool import ToolSchemaError, tool_schema
from bridge.envs.tools import ToolEnvironment


def move(direction: Literal["up", "down"], steps: int = 1, run: bool = False) -> str:
    """Move the player.

    Args:
        direction: Where to go.
        steps: How many squares,
            at most 3.
        run: Whether to run.

    Returns:
        What the player sees.
    """


def scale(values: list[float], factor: float, label: Optional[str] = None) -> list[float]:
    """Scale numbers.

    Args:
        values: The numbers.
        factor: The factor.
        label: A label, or nothing.
    """


def tag(words: list[str], counts: dict[str, list[int]] | None = None, pair: tuple[int, str] = (1, "a")):
    """Tag words.

    Args:
        words: The words.
        counts: Counts per word.
        pair: A pair.
    """


def test_schema_shape_literal_default_bool():
    schema = tool_schema(move)
    assert schema == {
        "type": "function",
        "function": {
            "name": "move",
            "description": "Move the player.",
            "parameters": {
                "type": "object",
                "properties": {
                    "direction": {"type": "string", "enum": ["up", "down"], "description": "Where to go."},
                    "steps": {"type": "integer", "description": "How many squares, at most 3."},
                    "run": {"type": "boolean", "description": "Whether to run."},
                },
                "required": ["direction"],
            },
            "return": {"type": "string", "description": "What the player sees."},
        },
    }


def test_schema_lists_floats_optional():
    props = tool_schema(scale)["function"]["parameters"]
    assert props["required"] == ["values", "factor"]
    p = props["properties"]
    assert p["values"] == {"type": "array", "items": {"type": "number"}, "description": "The numbers."}
    assert p["factor"] == {"type": "number", "description": "The factor."}
    assert p["label"] == {
        "type": "string",
        "nullable": True,
        "description": "A label, or nothing.",
    }


def test_schema_nested_dict_tuple():
    p = tool_schema(tag)["function"]["parameters"]["properties"]
    assert p["words"]["items"] == {"type": "string"}
    assert p["counts"]["additionalProperties"] == {"type": "array", "items": {"type": "integer"}}
    assert p["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    assert "default" not in p["pair"]  # TRL's schema (get_json_schema) shows no defaults


def test_schema_no_parameters_and_method():
    class Env:
        def look(self) -> str:
            """Look around."""

    schema = tool_schema(Env().look)
    assert schema["function"]["name"] == "look"
    assert schema["function"]["parameters"] == {"type": "object", "properties": {}}


class Vault:
    """A TRL `environment_factory` class whose tools document what they return."""

    def reset(self, **row) -> str:
        return "Open the vault."

    def try_code(self, code: int, hint: Literal["digits", "sum"] | None = None) -> str:
        """Try a code on the lock.

        Args:
            code: A four-digit code.
            hint: Which hint to get back when the code is wrong.

        Returns:
            "open", or the hint asked for.
        """

    def inspect_lock(self) -> dict[str, int]:
        """Look at the lock.

        Returns:
            The lock's digits and how many tries are left.
        """


def test_tool_schemas_are_trls_byte_for_byte():
    from transformers.utils import get_json_schema

    vault = Vault()
    tools = ToolEnvironment(vault).tools
    # TRL renders `getattr(env, name)` for the class's public functions in `inspect.getmembers` order.
    trl = [get_json_schema(getattr(vault, n)) for n in ("inspect_lock", "try_code")]
    assert [json.dumps(t) for t in tools] == [json.dumps(t) for t in trl]
    assert tools[1]["function"]["return"] == {"type": "string", "description": '"open", or the hint asked for.'}


def _undocumented_param(a: int, b: int):
    """Adds.

    Args:
        a: First.
    """


def _unhinted(a, b: int):
    """Adds.

    Args:
        a: First.
        b: Second.
    """


class Board:
    pass


def _custom_type(board: Board):
    """Uses a board.

    Args:
        board: The board.
    """


def _int_keys(table: dict[int, str]):
    """Uses a table.

    Args:
        table: The table.
    """


def _var_kwargs(a: int, **rest: int):
    """Takes more.

    Args:
        a: First.
        rest: More.
    """


def _no_doc(a: int):
    pass


def _typed_in_doc(a: int):
    """Adds.

    Args:
        a (int): First.
    """


@pytest.mark.parametrize(
    "fn, needles",
    [
        (_undocumented_param, ["_undocumented_param", "'b'", "Args:"]),
        (_unhinted, ["_unhinted", "'a'", "no type hint"]),
        (_custom_type, ["_custom_type", "'board'", "unsupported type Board"]),
        (_int_keys, ["_int_keys", "'table'", "dict[str, T]"]),
        (_var_kwargs, ["_var_kwargs", "'**rest'"]),
        (_no_doc, ["_no_doc", "no docstring"]),
        (_typed_in_doc, ["_typed_in_doc", "'a'", "a: <what it is>"]),
    ],
)
def test_schema_errors_name_function_and_parameter(fn, needles):
    with pytest.raises(ToolSchemaError) as info:
        tool_schema(fn)
    for needle in needles:
        assert needle in str(info.value)
