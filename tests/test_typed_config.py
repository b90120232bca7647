"""Typed configs: YAML -> dataclasses, overrides, messages that name the key, described defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest
import yaml

from jaxrl.run.typed_config import (
    ConfigError,
    apply_overrides,
    describe,
    dump_yaml,
    from_dict,
    load,
    parse_overrides,
    read_yaml,
    to_dict,
)


@dataclasses.dataclass(frozen=True)
class Learner:
    lr: float = dataclasses.field(default=1e-6, metadata={"help": "Peak learning rate."})
    beta: float = 0.0
    max_grad_norm: float | None = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    weights: tuple[float, ...] = ()

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class Env:
    url: str
    name: str = "echo"
    max_turns: int = 4


@dataclasses.dataclass(frozen=True)
class Rollout:
    mode: Literal["sync", "async"] = dataclasses.field(default="sync", metadata={"help": "How to overlap."})
    group_size: int = 8
    stop: list[str] = dataclasses.field(default_factory=lambda: ["</answer>"])


@dataclasses.dataclass
class Config:
    model: str = dataclasses.field(metadata={"help": "Hugging Face model directory."})
    learner: Learner = dataclasses.field(default_factory=Learner)
    rollout: Rollout = dataclasses.field(default_factory=Rollout)
    envs: list[Env] = dataclasses.field(default_factory=list)
    reward_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    eval: Rollout | None = None
    run_dir: Path = Path("runs/default")
    seed: int = 0
    bf16: bool = True


def test_missing_keys_take_defaults_and_types_are_converted():
    cfg = from_dict(Config, {
        "model": "m",
        "learner": {"lr": 1, "betas": [0.8, 0.9], "weights": [1, 2.5]},
        "envs": [{"url": "ws://a"}, {"url": "ws://b", "max_turns": 2}],
        "reward_weights": {"format": 1},
        "eval": {"mode": "async"},
        "run_dir": "runs/x",
    })
    assert cfg.learner == Learner(lr=1.0, betas=(0.8, 0.9), weights=(1.0, 2.5))
    assert isinstance(cfg.learner.lr, float) and isinstance(cfg.reward_weights["format"], float)
    assert cfg.envs == [Env("ws://a"), Env("ws://b", max_turns=2)]
    assert cfg.rollout == Rollout() and cfg.eval == Rollout(mode="async")
    assert cfg.run_dir == Path("runs/x")


def test_empty_section_takes_defaults_and_optional_takes_null():
    cfg = from_dict(Config, {"model": "m", "learner": None, "eval": None})
    assert cfg.learner == Learner() and cfg.eval is None


@pytest.mark.parametrize(
    "data,message",
    [
        ({"learner": {"lr": "fast"}}, r"^config key 'learner\.lr': expected a float, got 'fast'$"),
        ({"learner": {"lr": True}}, r"^config key 'learner\.lr': expected a float, got True$"),
        ({"seed": 1.5}, r"^config key 'seed': expected an int, got 1\.5$"),
        ({"seed": True}, r"^config key 'seed': expected an int, got True$"),
        ({"bf16": "yes please"}, r"^config key 'bf16': expected a bool \(true or false\), got 'yes please'$"),
        ({"model": 3}, r"^config key 'model': expected a string, got 3$"),
        ({"rollout": {"mode": "fast"}}, r"^config key 'rollout\.mode': 'fast' is not one of 'sync', 'async'$"),
        ({"learner": {"max_grad_norm": "x"}},
         r"^config key 'learner\.max_grad_norm': expected a float or null, got 'x'$"),
        ({"learner": {"betas": [0.9]}}, r"^config key 'learner\.betas': expected a list of 2 items, got 1: \[0\.9\]$"),
        ({"learner": {"weights": [1, "a"]}}, r"^config key 'learner\.weights\.1': expected a float, got 'a'$"),
        ({"rollout": {"stop": "</a>"}}, r"^config key 'rollout\.stop': expected a list, got '</a>'$"),
        ({"reward_weights": [1]}, r"^config key 'reward_weights': expected a mapping, got \[1\]$"),
        ({"reward_weights": {"f": "high"}}, r"^config key 'reward_weights\.f': expected a float, got 'high'$"),
        ({"reward_weights": {1: 1.0}}, r"^config key 'reward_weights': keys must be strings, got 1$"),
        ({"envs": [{"url": "a"}, {"url": "b", "max_turns": "x"}]},
         r"^config key 'envs\.1\.max_turns': expected an int, got 'x'$"),
        ({"envs": [{"name": "a"}]}, r"^missing required config key 'envs\.0\.url' \(a string\)$"),
        ({"envs": ["ws://a"]}, r"^config key 'envs\.0': expected a mapping of Env keys, got 'ws://a'$"),
        ({"learner": 3}, r"^config key 'learner': expected a mapping of Learner keys, got 3$"),
        ({"eval": {"mode": "x"}}, r"^config key 'eval\.mode': 'x' is not one of 'sync', 'async'$"),
        ({"eval": 1}, r"^config key 'eval': expected a mapping of Rollout keys or null, got 1$"),
        ({"learner": {"lr": -1}}, r"^config key 'learner': lr=-1\.0 must be > 0$"),
        ({"learner": {"lrr": 1}},
         r"^unknown config key 'learner\.lrr' \(did you mean 'learner\.lr'\? known keys under 'learner': "
         r"lr, beta, max_grad_norm, betas, weights\)$"),
        ({"zzz": 1}, r"^unknown config key 'zzz' \(known top-level keys: model, learner, rollout, envs, "),
    ],
)
def test_errors_name_the_key_the_value_and_what_is_allowed(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Config, {"model": "m"} | data)


def test_missing_required_key_names_it_with_its_help():
    message = r"^missing required config key 'model' \(a string\): Hugging Face model directory\.$"
    with pytest.raises(ConfigError, match=message):
        from_dict(Config, {})
    with pytest.raises(ConfigError, match=r"^config: expected a mapping of Config keys, got \[1\]$"):
        from_dict(Config, [1])


def test_parse_overrides_reads_yaml_values():
    pairs = parse_overrides(["learner.lr=1e-5", "bf16=false", "rollout.stop=[a, b]", "eval=null",
                             "model=a=b", "seed=3", "learner.beta=3E4", "learner.lr=.5e-3"])
    assert pairs == [("learner.lr", 1e-5), ("bf16", False), ("rollout.stop", ["a", "b"]), ("eval", None),
                     ("model", "a=b"), ("seed", 3), ("learner.beta", 3e4), ("learner.lr", 0.5e-3)]
    assert isinstance(pairs[0][1], float)


@pytest.mark.parametrize("item,message", [
    ("learner.lr", r"^bad override 'learner\.lr': expected dotted\.key=value, e\.g\. learner\.lr=1e-5$"),
    ("=3", r"^bad override '=3': expected dotted\.key=value"),
    ("a..b=1", r"^bad override 'a\.\.b=1': expected dotted\.key=value"),
    ("a=[1,", r"^bad override 'a=\[1,': the value is not valid YAML \("),
])
def test_malformed_overrides_are_named(item, message):
    with pytest.raises(ConfigError, match=message):
        parse_overrides([item])


def test_apply_overrides_copies_creates_and_indexes_lists():
    data = {"learner": {"lr": 1.0}, "envs": [{"url": "a"}, {"url": "b"}]}
    out = apply_overrides(data, [("learner.lr", 2.0), ("rollout.mode", "async"), ("envs.1.url", "c"),
                                 ("envs.0", {"url": "z"})])
    assert out == {"learner": {"lr": 2.0}, "rollout": {"mode": "async"}, "envs": [{"url": "z"}, {"url": "c"}]}
    assert data == {"learner": {"lr": 1.0}, "envs": [{"url": "a"}, {"url": "b"}]}  # not mutated


@pytest.mark.parametrize("key,message", [
    ("envs.2.url",
     r"^cannot set config key 'envs\.2\.url': 'envs' is a list of 2 items, so 'envs\.2' needs an index from 0 to 1$"),
    ("envs.url", r"'envs' is a list of 2 items, so 'envs\.url' needs an index"),
    ("seed.x", r"^cannot set config key 'seed\.x': 'seed' is 3, not a mapping$"),
])
def test_bad_override_paths_are_named(key, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides({"seed": 3, "envs": [{}, {}]}, [(key, 1)])


def test_load_applies_overrides_and_round_trips_through_dump(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nlearner:\n  lr: 1e-5\nenvs:\n  - url: ws://a\n")
    cfg = load(Config, path, ["learner.beta=0.1", ("envs.0.name", "wordle")])
    assert cfg.learner.lr == 1e-5 and cfg.learner.beta == 0.1
    assert cfg.envs == [Env("ws://a", name="wordle")]
    out = dump_yaml(cfg, tmp_path / "run" / "config.yaml")
    plain = yaml.safe_load(out.read_text())
    assert plain == to_dict(cfg) and plain["learner"]["betas"] == [0.9, 0.999] and plain["run_dir"] == "runs/default"
    assert load(Config, out) == cfg


def test_load_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file .*nope\.yaml not found$"):
        load(Config, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nlearner:\n  lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:4:1: invalid YAML: "):
        load(Config, bad)
    bad.write_text("model: m\nseed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3:1: invalid YAML: duplicate key 'seed'$"):
        read_yaml(bad)
    bad.write_text("- a\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: expected a mapping of config keys at the top level, got \['a'\]"):
        load(Config, bad)
    bad.write_text("model: m\nlearner: {lr: fast}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: config key 'learner\.lr': expected a float, got 'fast'$"):
        load(Config, bad)
    bad.write_text("")
    with pytest.raises(ConfigError, match=r"missing required config key 'model'"):
        load(Config, bad)


def test_describe_documents_every_key_and_reads_back_as_the_defaults():
    text = describe(Config)
    assert text.startswith("# Hugging Face model directory.\nmodel:  # required, str\nlearner:\n")
    assert "  # Peak learning rate.\n  lr: 1.0e-06  # float\n" in text
    assert "  max_grad_norm: 1.0  # float | null\n  betas: [0.9, 0.999]  # tuple[float, float]\n" in text
    assert "  # How to overlap.\n  mode: sync  # 'sync' | 'async'\n" in text
    # A list of sections and an unset optional section show their entries' keys, commented.
    assert "envs: []  # list[Env]\n#   url:  # required, str\n#   name: echo  # str\n" in text
    assert "eval: null  # Rollout | null\n#   # How to overlap.\n#   mode: sync" in text
    assert "run_dir: runs/default  # Path\n" in text
    data = yaml.safe_load(text)
    data["model"] = "m"
    assert from_dict(Config, data) == Config(model="m")


@dataclasses.dataclass
class Prompted:
    envs: list[Env] = dataclasses.field(default_factory=lambda: [Env("ws://a"), Env("ws://b", max_turns=2)])
    system: str = "Answer in <answer> tags.\nThink first: # not a comment"


def test_describe_output_is_valid_yaml_for_listed_sections_and_multiline_strings():
    text = describe(Prompted)
    assert "envs:  # list[Env]\n- {url: 'ws://a', name: echo, max_turns: 4}\n" in text
    assert from_dict(Prompted, yaml.safe_load(text)) == Prompted()


@dataclasses.dataclass
class Needs:
    learner: Learner
    envs: list[Env]


def test_describe_shows_the_keys_of_required_sections():
    text = describe(Needs)
    assert text.startswith("learner:  # required\n  # Peak learning rate.\n  lr: 1.0e-06  # float\n")
    assert "envs:  # required, list[Env]\n#   url:  # required, str\n" in text
