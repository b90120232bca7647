"""What a run says about its environments and reward functions (the `envs:` / `rewards:` config).

Part of the bridge's public contract (with `bridge.client` and `bridge.wire`): the trainer
resolves `bundled` entries to the `url` of the server it started (`served_at`) and hands the
bridge the rest as plain dicts (`EnvSpec.from_dict`), so the bridge needs no config machinery.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import numbers
import string
import urllib.parse
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from bridge.envs.bundled import NAMES as BUNDLED_NAMES
from bridge.envs.endpoint import CAPACITY_WARN_RATIO
from bridge.envs.session import SessionConfig, backoff_s
from bridge.wire import exposed, is_loopback

ACTION_MODES = ("auto", "text", "tool", "tool_call", "mcp")
ActionMode = Literal["auto", "text", "tool", "tool_call", "mcp"]
ENV_REWARD = "env"  # the reward name of the environment's own (summed) reward


class EnvConfigError(ValueError):
    """An environment or reward entry that cannot work; the message names it and says what to do."""


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One environment of a run. Exactly one of `bundled`, `url`, `env_class`, `rollout_fn`, `harness`
    says where it lives."""

    name: str = dataclasses.field(metadata={"help": "the name dataset rows and metrics use"})
    bundled: str | None = dataclasses.field(
        default=None, metadata={"help": "a bundled environment (echo, wordle, guess_number); the trainer serves it"})
    url: str | None = dataclasses.field(
        default=None, metadata={"help": "a running OpenEnv server, e.g. http://127.0.0.1:8000 (WebSocket /ws)"})
    env_class: str | None = dataclasses.field(
        default=None, metadata={"help": "'module:Class': an openenv Environment run in-process, or a "
                                        "tool-environment class (public documented methods are tools)"})
    rollout_fn: str | None = dataclasses.field(
        default=None, metadata={"help": "'module:function': an async function (task, handle) -> Episode that runs "
                                        "the episode itself in the bridge (see bridge.envs.rollout_fn; its module "
                                        "must be importable there: the working directory or PYTHONPATH)"})
    env_kwargs: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"help": "env_class: keyword arguments of its constructor, e.g. {size: 5, "
                                                "difficulty: hard} (each episode's instance is built with them)"})
    harness: str | None = dataclasses.field(
        default=None, metadata={"help": "a running OpenEnv server whose agent harness plays the episodes (its "
                                        "WS /harness route, production mode), e.g. http://127.0.0.1:8000; the "
                                        "harness calls the model at http://<harness_host>:<harness_port>/v1 "
                                        "(https with harness_tls_cert) with the key of harness_api_key_file "
                                        "(see bridge.envs.harness)"})
    harness_port: int | None = dataclasses.field(
        default=None, metadata={"help": "harness: the port of the bridge's OpenAI-compatible chat completions "
                                        "endpoint, the one the server's harness is configured to call"})
    harness_host: str = dataclasses.field(
        default="127.0.0.1", metadata={"help": "harness: the address the endpoint listens on; beyond loopback "
                                               "(e.g. 0.0.0.0, for a harness in a container or on another host) "
                                               "it needs harness_tls_cert and harness_tls_key, or harness_insecure"})
    harness_api_key_file: str | None = dataclasses.field(
        default=None, metadata={"help": "harness: the file holding the key every call to the endpoint must carry "
                                        "(the harness's OpenAI API key, sent as Authorization: Bearer KEY, e.g. "
                                        "OPENAI_API_KEY); written with a fresh key if it does not exist, refused "
                                        "if other users can read it; default: a fresh key each run, in "
                                        "harness/NAME.key of the run's logs directory (the run prints where)"})
    harness_tls_cert: str | None = dataclasses.field(
        default=None, metadata={"help": "harness: PEM certificate (chain) the endpoint serves HTTPS with, on the "
                                        "bridge's machine; with harness_tls_key"})
    harness_tls_key: str | None = dataclasses.field(
        default=None, metadata={"help": "harness: the private key of harness_tls_cert"})
    harness_insecure: bool = dataclasses.field(
        default=False, metadata={"help": "harness: let the endpoint listen beyond loopback without TLS (its key "
                                         "and the episodes travel in clear text: a network you trust only)"})
    harness_message: str = dataclasses.field(
        default="{prompt}", metadata={"help": "harness: the user message that starts an episode, a Python format "
                                              "string over the task's fields (default: a data file's prompt "
                                              "column)"})
    action_class: str | None = dataclasses.field(
        default=None, metadata={"help": "env_class Environments: 'module:Action' when step() does not annotate it"})
    action: ActionMode = dataclasses.field(
        default="auto", metadata={"help": "how model turns become actions: text (the reply fills one string "
                                          "field), tool (the action is one tool), tool_call ({tool, arguments} "
                                          "actions, tools listed in reset's observation), mcp (ListTools/CallTool); "
                                          "auto picks from the action schema"})
    text_field: str | None = dataclasses.field(
        default=None, metadata={"help": "text mode: the action field the reply fills (default: the only required "
                                        "string field)"})
    tool_name: str | None = dataclasses.field(
        default=None, metadata={"help": "tool mode: the tool's name (default: the environment's name)"})
    observation_field: str | None = dataclasses.field(
        default=None, metadata={"help": "show the model only this observation field (default: every field that "
                                        "says something: a text, prompt, message or content field first, then "
                                        "'name: value' lines; bundled environments: text)"})
    observation_template: str | None = dataclasses.field(
        default=None, metadata={"help": "how observations are shown, as a Python format string over their fields, "
                                        "e.g. 'You are at ({x}, {y}). {message}', '{metadata[question]}' (checked "
                                        "at start against the step and the reset observation schemas)"})
    reset_template: str | None = dataclasses.field(
        default=None, metadata={"help": "how reset's observation (the first user turn) is shown, where its fields "
                                        "differ from the steps' (default: observation_template; checked at start "
                                        "against the reset observation schema where the server states one)"})
    describe_action: bool | None = dataclasses.field(
        default=None, metadata={"help": "text mode: tell the model in the system prompt what its reply is (the "
                                        "action field's description, as tool mode's schema does); default: true, "
                                        "false for bundled environments (their text says it)"})
    system_prompt: str = dataclasses.field(default="", metadata={"help": "system message of every episode"})
    max_concurrent_envs: int = dataclasses.field(
        default=64, metadata={"help": "sessions at once: the bridge's session pool for this environment (bounded "
                                      "lower by session.max_sessions, if set); bundled servers are started with this "
                                      "capacity. Most OpenEnv servers allow 1"})
    seed: int = dataclasses.field(default=0, metadata={"help": "bundled server seed (resets without a seed)"})
    retry_budget_s: float = dataclasses.field(
        default=120.0, metadata={"help": "an episode whose session is lost (server killed, frozen, restarting) "
                                         "is replayed from reset() until this many seconds have passed since "
                                         "it was first lost, then dropped and counted"})
    retry_backoff_s: float = dataclasses.field(
        default=0.5, metadata={"help": "first wait before a replay; it doubles (with jitter) up to twice "
                                       "session.breaker_cooldown_s, so late replays find the breaker half-open"})
    episode_timeout_s: float | None = dataclasses.field(
        default=900.0, metadata={"help": "an episode (all its turns, generation included) that takes longer "
                                         "ends as an error; null: no limit"})
    session: SessionConfig = dataclasses.field(
        default_factory=SessionConfig, metadata={"help": "timeouts, pings, capacity backoff and circuit breaker"})
    mixed_groups: Literal["warn", "error"] = dataclasses.field(
        default="warn", metadata={"help": "when the episodes of one group start from different first prompts (the "
                                          "environment ignores the task's seed, or its reset is random): warn once "
                                          "and count env/NAME/groups_mixed, or stop the run with an error"})
    solver: str | None = dataclasses.field(
        default=None, metadata={"help": "the bundled environment whose solver plays warm-start demonstrations "
                                        "(default: a bundled environment's own)"})

    def __post_init__(self):
        where = [k for k in ("bundled", "url", "env_class", "rollout_fn", "harness") if getattr(self, k)]
        if len(where) != 1:
            raise EnvConfigError(
                f"environment {self.name!r}: set exactly one of bundled, url, env_class, rollout_fn, harness (got "
                f"{', '.join(where) or 'none'})")
        if not self.name:
            raise EnvConfigError("an environment needs a name")
        if self.action not in ACTION_MODES:
            raise EnvConfigError(f"environment {self.name!r}: action {self.action!r} is not one of "
                                 f"{', '.join(ACTION_MODES)}")
        if self.mixed_groups not in ("warn", "error"):
            raise EnvConfigError(f"environment {self.name!r}: mixed_groups {self.mixed_groups!r} is not warn or error")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise EnvConfigError(f"environment {self.name!r}: url {self.url!r} must start with http:// or https://")
        if self.harness and not self.harness.startswith(("http://", "https://")):
            raise EnvConfigError(f"environment {self.name!r}: harness {self.harness!r} must start with http:// or "
                                 "https://")
        if self.harness:
            object.__setattr__(self, "harness", self.harness.rstrip("/"))
            if not isinstance(self.harness_port, int) or not 0 < self.harness_port < 65536:
                raise EnvConfigError(f"environment {self.name!r}: a harness environment needs harness_port, the "
                                     "port (1-65535) its server's harness calls the model on, got "
                                     f"{self.harness_port!r}")
            template_fields(self.harness_message, f"environment {self.name!r}: harness_message")
            self._check_harness_door()
        else:
            given = [f.name for f in dataclasses.fields(self) if f.name.startswith("harness_")
                     and f.name != "harness_message" and getattr(self, f.name) != f.default]
            if given:
                raise EnvConfigError(f"environment {self.name!r} sets {', '.join(given)}, which only harness "
                                     "environments take; set harness too, or drop those keys")
        if self.url:  # `http://host:port/` names the same server; its routes are url + "/health", ...
            object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.env_class and ":" not in self.env_class:
            raise EnvConfigError(f"environment {self.name!r}: env_class {self.env_class!r} must be 'module:Class'")
        if not isinstance(self.env_kwargs, dict) or not all(isinstance(k, str) for k in self.env_kwargs):
            raise EnvConfigError(f"environment {self.name!r}: env_kwargs must map argument names to values, got "
                                 f"{self.env_kwargs!r}")
        if self.env_kwargs and not self.env_class:
            raise EnvConfigError(f"environment {self.name!r}: env_kwargs are passed to env_class's constructor, and "
                                 "it has no env_class; a served environment takes its settings where it is served")
        if self.rollout_fn and ":" not in self.rollout_fn:
            raise EnvConfigError(f"environment {self.name!r}: rollout_fn {self.rollout_fn!r} must be "
                                 "'module:function'")
        if self.episode_timeout_s is not None and not self.episode_timeout_s > 0:
            raise EnvConfigError(f"environment {self.name!r}: episode_timeout_s must be > 0 or null")
        if self.bundled and self.bundled not in BUNDLED_NAMES:
            raise EnvConfigError(f"environment {self.name!r} names bundled environment {self.bundled!r}; "
                                 f"known: {', '.join(BUNDLED_NAMES)}")
        if self.observation_field and self.observation_template:
            raise EnvConfigError(f"environment {self.name!r}: set observation_field or observation_template, "
                                 "not both")
        for key in ("observation_template", "reset_template"):
            if getattr(self, key) is not None:
                template_fields(getattr(self, key), f"environment {self.name!r}: {key}")
        if self.describe_action is None:
            object.__setattr__(self, "describe_action", not self.bundled)
        if self.bundled and self.observation_field is None and self.observation_template is None:
            # Bundled environments render their whole state into `text` themselves.
            object.__setattr__(self, "observation_field", "text")
        if self.solver is None and self.bundled:
            object.__setattr__(self, "solver", self.bundled)
        if self.solver is not None and (self.rollout_fn or self.harness):
            raise EnvConfigError(f"environment {self.name!r}: a {where[0]} environment has no solver to play "
                                 "warm-start demonstrations; leave solver unset")
        if self.solver is not None and self.solver not in BUNDLED_NAMES:
            raise EnvConfigError(f"environment {self.name!r}: solver {self.solver!r} is not a bundled environment "
                                 f"({', '.join(BUNDLED_NAMES)})")
        if not (self.retry_budget_s >= 0 and self.retry_backoff_s > 0) or self.max_concurrent_envs < 1:
            raise EnvConfigError(f"environment {self.name!r}: retry_budget_s must be >= 0, retry_backoff_s > 0 "
                                 "and max_concurrent_envs >= 1")

    def _check_harness_door(self) -> None:
        """The chat endpoint's door: beyond loopback only with TLS or harness_insecure (`wire.exposed`)."""
        what = f"environment {self.name!r}"
        if (self.harness_tls_cert is None) != (self.harness_tls_key is None):
            raise EnvConfigError(f"{what}: harness_tls_cert and harness_tls_key go together (a certificate and its "
                                 "private key); set both, or neither")
        if not isinstance(self.harness_host, str) or not self.harness_host:
            raise EnvConfigError(f"{what}: harness_host must be an address to listen on, e.g. 127.0.0.1 or 0.0.0.0, "
                                 f"got {self.harness_host!r}")
        if exposed(self.harness_host, self.harness_tls_cert is not None, self.harness_insecure):
            raise EnvConfigError(f"{what}: harness_host {self.harness_host} listens beyond loopback, where the "
                                 "harness's key would travel in clear text: set harness_tls_cert and "
                                 "harness_tls_key, or harness_insecure: true on a network you trust")

    @property
    def pool_size(self) -> int:
        """Sessions the bridge holds at once for this environment."""
        bound = self.session.max_sessions
        return self.max_concurrent_envs if bound is None else min(self.max_concurrent_envs, bound)

    def queues_at(self, server_max_sessions: int) -> bool:
        """Whether the pool is so far above the capacity its server states that episodes mostly queue."""
        return self.pool_size >= CAPACITY_WARN_RATIO * server_max_sessions

    def retry_wait_s(self, attempt: int, lost_for_s: float) -> float | None:
        """The wait before replaying an episode lost `attempt + 1` times, the first loss `lost_for_s`
        seconds ago; None once the replay would start past `retry_budget_s`."""
        wait = backoff_s(attempt, self.retry_backoff_s, max(self.retry_backoff_s, 2 * self.session.breaker_cooldown_s))
        return wait if lost_for_s + wait <= self.retry_budget_s else None

    # Keys of earlier versions -> the key that replaced them (the config loaders name it).
    RENAMED: ClassVar[dict[str, str]] = {"max_retries": "retry_budget_s"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EnvSpec:
        data = dict(data)
        old = next((k for k in data if k in cls.RENAMED), None)
        if old is not None:
            raise EnvConfigError(f"environment {data.get('name', '?')!r}: {old} is gone; set {cls.RENAMED[old]} "
                                 "instead")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise EnvConfigError(f"environment {data.get('name', '?')!r}: unknown key(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(sorted(known))}")
        session = data.get("session")
        if isinstance(session, dict):
            try:
                data["session"] = SessionConfig(**session)
            except (TypeError, ValueError) as e:
                raise EnvConfigError(f"environment {data.get('name', '?')!r}: session: {e}") from None
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def served_at(self, url: str) -> EnvSpec:
        """This (bundled) environment as the server at `url` that the trainer started for it."""
        return dataclasses.replace(self, bundled=None, url=url)


REWARD_MODEL_KINDS = ("classifier", "judge")
# What a judge's rubric may name besides the task's fields (see `bridge.judge`).
JUDGE_FIELDS = ("prompt", "completion", "conversation")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A reward function `fn(prompts, completions, completion_ids, environments, **task_fields) ->
    list[float | None]` (as TRL calls them), `env`, or a reward model the bridge serves (`kind`:
    a sequence-classification `model`, or a generative judge: its own `model` or `judge: policy`)."""

    fn: str | None = dataclasses.field(
        default=None, metadata={"help": "'module:function', or 'env' for the environment's own reward; null for a "
                                        "reward model"})
    weight: float = dataclasses.field(default=1.0, metadata={"help": "weight in the summed reward"})
    name: str | None = dataclasses.field(
        default=None, metadata={"help": "metric name (default: the function's, or the reward model's kind)"})
    model: str | None = dataclasses.field(
        default=None, metadata={"help": "a reward model's Hugging Face directory (safetensors, tokenizer with a chat "
                                        "template), loaded by the bridge; with kind"})
    kind: Literal["classifier", "judge"] | None = dataclasses.field(
        default=None, metadata={"help": "classifier: a *ForSequenceClassification checkpoint scores the conversation "
                                        "(its chat template; one score); judge: a generative model answers `template` "
                                        "and its answer is parsed (a number, or a word of `verdicts`)"})
    judge: Literal["policy"] | None = dataclasses.field(
        default=None, metadata={"help": "judges: 'policy' to judge with the policy's own engine (its current "
                                        "weights) instead of a model directory"})
    template: str | None = dataclasses.field(
        default=None, metadata={"help": "judges: the rubric, sent as the user message; {prompt} (the task as the "
                                        "model saw it), {completion} (the model's turns and the answers), "
                                        "{conversation} (both) and task fields by name, e.g. {answer}"})
    verdicts: dict[str, float] | None = dataclasses.field(
        default=None, metadata={"help": "judges: the reward of each verdict word, e.g. {yes: 1, no: 0} (the last "
                                        "such word of the answer counts); null: the answer's last number is the "
                                        "reward. An answer without one is a None reward, counted (judge_malformed)"})
    max_tokens: int = dataclasses.field(
        default=32, metadata={"help": "judges: most tokens of an answer (greedy)"})

    def __post_init__(self):
        what = f"reward {self.key!r}"
        sources = [k for k in ("fn", "model", "judge") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise EnvConfigError(f"{what}: set exactly one of fn (a function or 'env'), model (a reward model's "
                                 f"directory, with kind) or judge: policy (got {', '.join(sources) or 'none'})")
        if self.fn is not None:
            extra = [k for k in ("kind", "template", "verdicts") if getattr(self, k) is not None]
            if extra:
                raise EnvConfigError(f"{what}: a reward function (fn) takes no {', '.join(extra)} (reward models "
                                     "do); leave them out")
            return
        if self.kind not in REWARD_MODEL_KINDS:
            raise EnvConfigError(f"{what}: kind {self.kind!r} is not one of {', '.join(REWARD_MODEL_KINDS)}; a reward "
                                 "model needs one")
        if self.kind == "classifier":
            extra = [k for k in ("judge", "template", "verdicts") if getattr(self, k) is not None]
            if extra:
                raise EnvConfigError(f"{what}: a classifier takes no {', '.join(extra)} (judges do: kind: judge); "
                                     "it scores the conversation itself")
            return
        if not self.template:
            raise EnvConfigError(f"{what}: a judge needs a template (the rubric, with {{completion}} or "
                                 "{conversation} where the trajectory goes)")
        fields = template_fields(self.template, f"{what}: template")
        if not set(fields) & {"completion", "conversation"}:
            raise EnvConfigError(f"{what}: template {self.template!r} shows the judge no trajectory; put "
                                 "{completion} or {conversation} in it")
        if self.verdicts is not None:
            bad = {k: v for k, v in self.verdicts.items()
                   if not (isinstance(k, str) and k.strip() and isinstance(v, numbers.Real) and not isinstance(v, bool)
                           and math.isfinite(v))}
            if not self.verdicts or bad:
                raise EnvConfigError(f"{what}: verdicts must map words to finite numbers, e.g. {{yes: 1, no: 0}}; got "
                                     f"{self.verdicts!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise EnvConfigError(f"{what}: max_tokens={self.max_tokens!r} must be >= 1")

    @property
    def key(self) -> str:
        if self.name:
            return self.name
        if self.fn is None:
            return self.kind or "reward_model"
        return ENV_REWARD if self.fn == ENV_REWARD else self.fn.rsplit(":", 1)[-1]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RewardSpec:
        try:
            return cls(**data)
        except TypeError as e:
            raise EnvConfigError(f"reward {data!r}: {e}") from None


class RewardError(ValueError):
    """A reward that is not a finite number or None: a bug in the function (or environment) that
    produced it, so the run stops on it rather than train on it. An episode scored with one ends
    with finish_reason "error" and an error starting with "RewardError: "."""


class RolloutFnError(ValueError):
    """A rollout function (`rollout_fn`) returned an episode that cannot be trained on (lengths that
    differ, trained tokens it did not generate): a bug in the function, so the run stops on it. An
    episode it ends has finish_reason "error" and an error starting with "RolloutFnError: "."""


class MixedGroupError(ValueError):
    """The episodes of one group started from different prompts (`mixed_groups: error`): their rewards
    compare answers to different tasks, so the run stops. An episode it ends has finish_reason "error"
    and an error starting with "MixedGroupError: "."""


MAX_ABS_REWARD = 1e9  # the learner's float32 arithmetic (weights, sums, squares for the std) stays finite


def reward_value(value: Any, what: str) -> float | None:
    """`value` as a float, None as None; RewardError naming `what` for anything else (strings,
    booleans, NaN, inf, beyond +-MAX_ABS_REWARD, containers)."""
    if value is None:
        return None
    if isinstance(value, bool):  # a predicate returned by mistake: say so rather than count it as 1.0 / 0.0
        raise RewardError(f"{what} returned {value!r}; rewards must be numbers or None (float({value!r}) if "
                          "that is meant)")
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        raise RewardError(f"{what} returned {value!r} ({type(value).__name__}); rewards must be numbers or None")
    if not math.isfinite(value):
        raise RewardError(f"{what} returned {value!r}; rewards must be finite (None: does not apply)")
    if abs(value) > MAX_ABS_REWARD:
        raise RewardError(f"{what} returned {value!r}; rewards must be within +-{MAX_ABS_REWARD:g} (scale it down)")
    return float(value)


def task_prompt(prompt: Any) -> list[dict[str, Any]]:
    """A task's `prompt` field (TRL's dataset format) as chat messages: a string is one user message,
    a list holds messages `{"role": ..., "content": ...}`; ValueError saying what is wrong."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (isinstance(prompt, list) and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)):
        return [dict(m) for m in prompt]
    shown = repr(prompt) if len(repr(prompt)) <= 80 else repr(prompt)[:77] + "..."
    raise ValueError(f"task field 'prompt' must be a string or a non-empty list of chat messages "
                     f"({{\"role\": ..., \"content\": ...}}), got {shown}")


def template_fields(template: str, what: str) -> list[str]:
    """The observation fields a format string names (`{x}`, `{pos[0]}`, `{x:>3}` -> x, pos, x);
    EnvConfigError naming `what` for a malformed one or a positional `{}`."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise EnvConfigError(f"{what} {template!r}: {e}; write fields as {{name}} and literal braces as {{{{ }}}}") \
            from None
    fields = []
    for _, name, _, _ in parsed:
        if name is None:
            continue
        head = name.split(".", 1)[0].split("[", 1)[0]
        if not head or head.isdigit():
            raise EnvConfigError(f"{what} {template!r}: {{{name}}} names no field; write {{field_name}}")
        fields.append(head)
    return fields


class TaskRefused(EnvConfigError):
    """An environment that cannot start an episode on a task (its reset raised)."""


def env_factory(spec: EnvSpec, cls: type) -> Callable[[], Any]:
    """What builds an instance of `spec`'s env_class `cls`: its constructor with `env_kwargs`;
    EnvConfigError naming the arguments its constructor does not take (checked here, before any
    episode, rather than as every episode's TypeError)."""
    try:
        inspect.signature(cls).bind(**spec.env_kwargs)
    except TypeError as e:
        try:
            takes = ", ".join(p for p in inspect.signature(cls).parameters) or "no arguments"
        except (TypeError, ValueError):
            takes = "?"
        raise EnvConfigError(f"environment {spec.name!r}: env_kwargs {spec.env_kwargs!r} do not fit "
                             f"{cls.__name__}'s constructor ({e}); it takes: {takes}") from None
    except ValueError:  # a constructor whose signature cannot be read (a builtin): its call says it
        pass
    return functools.partial(cls, **spec.env_kwargs)


def reset_fields(spec: EnvSpec) -> frozenset[str] | None:
    """The task fields `spec`'s reset is handed: for an env_class, those its reset's signature names
    (the filter the bridge's connectors and OpenEnv's server apply; an openenv Environment's
    reset_async where it overrides it); None where every field may be read (a reset taking
    **kwargs, a rollout function) or the reset cannot be seen from here (a served environment's
    server drops the fields its reset does not take, unseen)."""
    if not spec.env_class:
        return None
    cls = import_object(spec.env_class, f"environment {spec.name!r}: env_class")
    reset = getattr(cls, "reset", None)
    if hasattr(cls, "reset_async"):  # an openenv Environment (imported only then: it takes seconds)
        from openenv.core.env_server import Environment

        if isinstance(cls, type) and issubclass(cls, Environment) and cls.reset_async is not Environment.reset_async:
            reset = cls.reset_async
    if not callable(reset):
        return frozenset()  # a tool class without reset: the task reaches only the reward functions
    parameters = list(inspect.signature(reset).parameters.values())
    if inspect.isfunction(reset) and not isinstance(inspect.getattr_static(cls, reset.__name__, None), staticmethod):
        parameters = parameters[1:]  # self: read off the class, the method is not bound
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_POSITIONAL)


def task_splits(spec: EnvSpec) -> dict[str, int]:
    """The task splits `spec`'s environment serves and how many tasks each holds: a server's task routes
    (openenv >= 0.10: `/{env}/splits`, `/{env}/num_tasks`), an env_class's list_splits / num_tasks;
    EnvConfigError naming the environment where it has none. A task is then {split, index}, which
    reset(split=, index=) plays."""
    what = f"environment {spec.name!r}"
    if spec.env_class:
        env = env_factory(spec, import_object(spec.env_class, f"{what}: env_class"))()
        try:
            if not callable(getattr(env, "list_splits", None)) or not callable(getattr(env, "num_tasks", None)):
                raise EnvConfigError(f"{what}: {spec.env_class} has no task splits (list_splits, num_tasks); draw "
                                     "its tasks by seed or from data.train_file instead of data.splits")
            names = [_split_name(split) for split in env.list_splits()]
            return {name: int(env.num_tasks(name)) for name in names}
        finally:
            env.close()
    if not spec.url:
        raise EnvConfigError(f"{what}: only url and env_class environments have task splits (data.splits)")
    return _served_splits(spec.url.rstrip("/"), what)


def _split_name(split: Any) -> str:
    """A split descriptor's name: a string, or {"name": ...} as the task routes write them."""
    return split if isinstance(split, str) else str(split["name"] if isinstance(split, dict) else split.name)


def _served_splits(url: str, what: str) -> dict[str, int]:
    import httpx

    direct = is_loopback(urllib.parse.urlsplit(url).hostname or "")
    try:
        with httpx.Client(trust_env=not direct, timeout=30.0) as client:
            listed = client.get(f"{url}/list_environments")
            if listed.status_code == 404:
                raise EnvConfigError(f"{what}: the server at {url} has no task routes (openenv-core 0.2 / 0.3); "
                                     "draw its tasks by seed or from data.train_file instead of data.splits")
            listed.raise_for_status()
            name = listed.json()[0]
            splits = client.get(f"{url}/{name}/splits")
            if splits.status_code == 501:
                raise EnvConfigError(f"{what}: the server at {url} serves no task splits (its environment has no "
                                     "list_splits / num_tasks); draw its tasks by seed or from data.train_file")
            splits.raise_for_status()
            counts = {}
            for split in splits.json():
                reply = client.post(f"{url}/{name}/num_tasks", json={"split": _split_name(split)})
                reply.raise_for_status()
                counts[_split_name(split)] = int(reply.json()["num_tasks"])
            return counts
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise EnvConfigError(f"{what}: reading the task splits of {url} failed: {type(e).__name__}: {e}") from None


def import_object(path: str, what: str) -> Any:
    """`module:attr` imported; EnvConfigError naming `what` if it cannot be."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise EnvConfigError(f"{what} {path!r} must be written 'module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvConfigError(f"{what} {path!r}: cannot import module {module_name!r} ({e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvConfigError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
