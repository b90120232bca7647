"""Building the bridge's environments from an environments file: what is refused at start-up."""

from __future__ import annotations

import pytest

from bridge.envs.runtime import runtime_from_dict
from bridge.envs.spec import EnvConfigError
from jaxrl.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_runtime_errors_at_start_up(tok):
    with pytest.raises(EnvConfigError, match="cannot tell the Action class.*action_class"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "bridge.envs.bundled.echo:EchoEnvironment"}]}, tok)
    with pytest.raises(EnvConfigError, match="cannot import module 'no_such_module'"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "no_such_module:Env"}]}, tok)
    with pytest.raises(EnvConfigError, match="has no 'Nope'"):
        runtime_from_dict({"envs": [{"name": "x", "env_class": "test_runtime:Nope"}]}, tok)
    with pytest.raises(EnvConfigError, match="unknown tool-call parser"):
        runtime_from_dict({"envs": [{"name": "x", "url": "http://127.0.0.1:1"}], "tool_parser": "gpt9"}, tok)
    with pytest.raises(EnvConfigError, match="lists no environments"):
        runtime_from_dict({"envs": []}, tok)
    with pytest.raises(EnvConfigError, match="reward function 'test_runtime:missing'"):
        runtime_from_dict({"envs": [{"name": "x", "url": "http://127.0.0.1:1"}],
                           "rewards": [{"fn": "test_runtime:missing"}]}, tok)
