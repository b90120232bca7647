"""The bundled environments: in-process semantics, solvers, and real servers over WebSocket /ws."""

import asyncio
import os
import subprocess
import sys
import json
import urllib.request

import pytest
from openenv.core.env_server import Action, Environment, Observation
from openenv.core.generic_client import GenericEnvClient
from openenv.core.env_server.serialization import serialize_observation
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from bridge.envs.bundled import BUNDLED, NAMES, UnknownEnvironmentError, echo, guess_number, wordle
from bridge.envs.bundled._base import EpisodeOver, split_of
from jaxrl.run.processes import EnvServerProcess

# -- registry ---------------------------------------------------------------------------------


def test_registry_lists_three_openenv_environments():
    assert list(BUNDLED) == ["echo", "wordle", "guess_number"] == list(NAMES)
    for name, spec in BUNDLED.items():
        assert spec.name == name
        assert issubclass(spec.env_cls, Environment)
        assert spec.env_cls.SUPPORTS_CONCURRENT_SESSIONS is True
        assert issubclass(spec.action_cls, Action) and issubclass(spec.observation_cls, Observation)
        assert spec.env_cls().get_metadata().name == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownEnvironmentError, match="'chess'; known: echo, wordle, guess_number"):
        BUNDLED["chess"]
    assert "chess" not in BUNDLED


@pytest.mark.parametrize("name", NAMES)
def test_tasks_are_deterministic_and_splits_disjoint(name):
    spec = BUNDLED[name]
    assert spec.task_for_seed(7, "train") == spec.task_for_seed(7, "train")
    train, test = spec.tasks("train", 40), spec.tasks("test", 40)
    assert len({json.dumps(t, sort_keys=True) for t in train}) > 10  # seeds give different tasks
    assert not {json.dumps(t, sort_keys=True) for t in train} & {json.dumps(t, sort_keys=True) for t in test}
    with pytest.raises(ValueError, match="split must be one of 'train', 'test'"):
        spec.task_for_seed(0, "validation")

    # reset(seed) plays task_for_seed(seed); equal seeds give equal episodes in fresh instances.
    a, b = spec.env_cls(), spec.env_cls(seed=5, instance=3)
    assert a.reset(seed=11, split="test") == b.reset(seed=11, split="test")
    assert a.state.task == spec.task_for_seed(11, "test")
    # Unseeded resets follow the instance's own stream: reproducible, and instances differ.
    def draws(env):
        seeds = []
        for _ in range(3):
            env.reset()
            seeds.append(env.state.seed)
        return seeds

    assert draws(spec.env_cls(seed=1, instance=0)) == draws(spec.env_cls(seed=1, instance=0))
    assert draws(spec.env_cls(seed=1, instance=0)) != draws(spec.env_cls(seed=1, instance=1))


@pytest.mark.parametrize("name", NAMES)
def test_step_outside_an_episode_and_bad_task_fields_are_errors(name):
    env = BUNDLED[name].env_cls()
    assert env.state.step_count == 0  # /state on a fresh instance must work
    with pytest.raises(EpisodeOver, match="before reset"):
        env.step(None)
    with pytest.raises(ValueError, match="unknown task field.*'bogus'"):
        env.reset(seed=0, bogus=1)
    episode = BUNDLED[name].demonstration(seed=0)
    env = BUNDLED[name].env_cls()
    env.reset(seed=0)
    for action in episode.actions:
        env.step(action)
    with pytest.raises(EpisodeOver, match="episode is over"):
        env.step(episode.actions[-1])


@pytest.mark.parametrize("name", NAMES)
def test_the_solver_solves_every_held_out_task(name):
    spec = BUNDLED[name]
    held_out = spec.tasks("test") if name == "wordle" else spec.tasks("test", 200)
    if name == "wordle":
        assert len(held_out) == len(wordle.answers("test"))
    for task in held_out:
        episode = spec.demonstration(split="test", **task)
        assert episode.done and episode.total_reward == 1.0, (task, episode.observations[-1])
        assert episode.task == task
        limit = task.get("max_guesses", task.get("max_steps"))
        assert len(episode.steps) <= limit


# -- echo ---------------------------------------------------------------------------------------


def test_echo():
    env = echo.EchoEnvironment()
    first = env.reset(target="blue river", max_steps=2)
    assert (first.text, first.steps_left, first.done, first.reward) == (
        "Repeat exactly: blue river", 2, False, None)
    obs = env.step(echo.EchoAction(message="blue lake"))
    assert (obs.echoed_message, obs.message_length, obs.reward, obs.done, obs.steps_left) == (
        "blue lake", 9, 0.0, False, 1)
    obs = env.step(echo.EchoAction(message="  blue river\n"))
    assert (obs.reward, obs.done) == (1.0, True)
    assert env.state.total_reward == 1.0 and env.state.step_count == 2

    env.reset(target="blue river", reward_mode="similarity")
    assert 0.5 < env.step(echo.EchoAction(message="blue rivers")).reward < 1.0
    for bad, match in [({"target": ""}, "non-empty"), ({"max_steps": 0}, "max_steps"),
                       ({"reward_mode": "length"}, "reward_mode")]:
        with pytest.raises(ValueError, match=match):
            env.reset(seed=0, **bad)


# -- wordle -------------------------------------------------------------------------------------


def test_wordle_word_list():
    assert len(wordle.WORDS) >= 300
    assert len(set(wordle.WORDS)) == len(wordle.WORDS)
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in wordle.WORDS)
    train, test = set(wordle.answers("train")), set(wordle.answers("test"))
    assert not train & test and train | test == set(wordle.WORDS)
    assert 0.1 < len(test) / len(wordle.WORDS) < 0.3
    assert all(split_of(f"wordle:{w}") == "test" for w in test)


@pytest.mark.parametrize("answer,guess,pattern", [
    ("shade", "shade", "GGGGG"),
    ("shade", "ratio", "-Y---"),
    ("apple", "papal", "YYG-Y"),   # one 'a' in the answer: the second 'a' is gray
    ("crane", "eerie", "--Y-G"),   # the green 'e' uses the answer's only 'e': the others are gray
    ("abbey", "kebab", "-YGYY"),   # two 'b's: one green, one yellow
    ("sheep", "geese", "-YGY-"),   # two 'e's in the answer, three in the guess
    ("lemon", "level", "GG---"),   # the second 'l' has no copy left
    ("teeth", "eeeee", "-GG--"),
])
def test_wordle_feedback_with_repeated_letters(answer, guess, pattern):
    assert wordle.score(guess, answer) == pattern


def test_wordle_episode_and_invalid_guesses():
    env = wordle.WordleEnvironment()
    first = env.reset(answer="shade")
    assert (first.guesses_left, first.guesses, first.done) == (6, [], False) and "5-letter" in first.text
    obs = env.step(wordle.WordleAction(guess="cat"))
    assert not obs.valid and "exactly 5 letters" in obs.error and obs.guesses == []
    assert obs.guesses_left == 5 and obs.reward == 0.0 and not obs.done  # an invalid guess uses a try
    obs = env.step(wordle.WordleAction(guess="abcde"))
    assert not obs.valid and "not in the word list" in obs.error and obs.guesses_left == 4
    obs = env.step(wordle.WordleAction(guess=" RaTiO "))
    assert obs.valid and obs.guesses == ["ratio"] and obs.patterns == ["-Y---"]
    assert obs.text.startswith("RATIO: -Y---")
    obs = env.step(wordle.WordleAction(guess="shade"))
    assert (obs.solved, obs.done, obs.reward, obs.answer) == (True, True, 1.0, "shade")
    assert env.state.step_count == 4 and env.state.done


def test_wordle_out_of_tries_and_partial_credit():
    env = wordle.WordleEnvironment()
    env.reset(answer="shade", max_guesses=2)
    assert env.step(wordle.WordleAction(guess="ratio")).answer == ""  # not revealed mid-episode
    obs = env.step(wordle.WordleAction(guess="share"))  # GGG-G
    assert (obs.done, obs.solved, obs.reward, obs.answer) == (True, False, 0.0, "shade")
    assert "the word was SHADE" in obs.text

    env.reset(answer="shade", max_guesses=2, partial_credit=True)
    env.step(wordle.WordleAction(guess="ratio"))
    assert env.step(wordle.WordleAction(guess="share")).reward == pytest.approx(0.5 * 4 / 5)
    with pytest.raises(ValueError, match="'answer' must be a word"):
        env.reset(answer="zzzzz")


def test_wordle_solver_reads_plain_dicts_and_solves_every_word_in_four():
    first = wordle.solve([wordle.WordleObservation()]).guess
    assert wordle.solve([{"guesses": [], "patterns": []}]).guess == first
    history = [{"guesses": ["arise"], "patterns": [wordle.score("arise", "shade")]}]
    assert "shade" in wordle.candidates(["arise"], history[0]["patterns"])
    assert wordle.solve(history).guess in wordle.WORDS  # possibly not a candidate: it splits them best
    worst = max(len(wordle.demonstration(answer=w).steps) for w in wordle.WORDS[::7])
    assert worst <= 4


# -- guess_number -------------------------------------------------------------------------------


def call(n=None, tool="guess", **extra):
    arguments = {} if n is None else {"n": n}
    return guess_number.GuessNumberAction(tool=tool, arguments={**arguments, **extra})


def test_guess_number_episode():
    env = guess_number.GuessNumberEnvironment()
    first = env.reset(low=1, high=100, secret=37, max_guesses=5)
    assert first.tools == guess_number.TOOLS and first.tools[0]["name"] == "guess"
    assert (first.low, first.high, first.guesses_left, first.done) == (1, 100, 5, False)
    obs = env.step(call(50))
    assert (obs.result, obs.reward, obs.done, obs.guesses_left, obs.tools) == ("lower", 0.0, False, 4, [])
    assert env.step(call(20)).result == "higher"
    obs = env.step(call("37"))  # a string of an integer is accepted
    assert (obs.result, obs.reward, obs.done, obs.guesses, obs.results) == (
        "correct", 1.0, True, [50, 20, 37], ["lower", "higher", "correct"])


@pytest.mark.parametrize("action,error", [
    (call(5, tool="peek"), "unknown tool 'peek'; the tools are: guess"),
    (call(), "missing argument n"),
    (call("abc"), "n must be an integer, got 'abc'"),
    (call(True), "n must be an integer, got True"),
    (call(4.5), "n must be an integer"),
    (call(0), "n must be between 1 and 10, got 0"),
    (call(5, m=1), "unexpected argument(s) 'm'"),
])
def test_guess_number_invalid_calls_get_an_error_observation_and_use_a_guess(action, error):
    env = guess_number.GuessNumberEnvironment()
    env.reset(low=1, high=10, secret=3, max_guesses=2)
    obs = env.step(action)
    assert (obs.result, obs.reward, obs.done, obs.guesses_left, obs.guesses) == ("error", 0.0, False, 1, [])
    assert error in obs.error and obs.text.startswith("error: ")
    obs = env.step(call(9))
    assert (obs.done, obs.reward) == (True, 0.0) and "the number was 3" in obs.text


def test_guess_number_bad_tasks():
    env = guess_number.GuessNumberEnvironment()
    for bad, match in [({"low": 5, "high": 1}, "low <= high"),
                       ({"secret": 10**7}, "'secret' must be in"),
                       ({"max_guesses": 0}, "'max_guesses' must be in"),
                       ({"low": "1"}, "must be an integer")]:
        with pytest.raises(ValueError, match=match):
            env.reset(seed=0, **bad)


# -- over a real server, WebSocket /ws sessions -------------------------------------------------

CAPACITY = 8


@pytest.fixture(scope="module", params=NAMES)
def server(request):
    with EnvServerProcess.start(request.param, max_concurrent_envs=CAPACITY, timeout=120) as proc:
        yield proc


def _expected(name, seed, split="train"):
    """The in-process solver episode: (observation dicts, rewards, dones) per step."""
    episode = BUNDLED[name].demonstration(seed=seed, split=split)
    obs = [serialize_observation(o)["observation"] for o in episode.observations]  # as the server sends them
    rewards = [None] + [o.reward for _, o in episode.steps]
    return episode, obs, rewards, [False] + [o.done for _, o in episode.steps]


async def _play_over_ws(url, name, seed, split="train", state_checks=None):
    """One solver episode over one /ws session with OpenEnv's generic client."""
    solve = BUNDLED[name].solve
    async with GenericEnvClient(base_url=url) as client:
        result = await client.reset(seed=seed, split=split)
        observations, rewards, dones = [result.observation], [result.reward], [result.done]
        first_state = await client.state()
        while not result.done:
            result = await client.step(solve(observations).model_dump(exclude={"metadata"}))
            observations.append(result.observation)
            rewards.append(result.reward)
            dones.append(result.done)
            state = await client.state()  # the session keeps its environment between calls
            assert state["episode_id"] == first_state["episode_id"]
            assert state["step_count"] == len(observations) - 1
            assert state["task"] == first_state["task"]
        return observations, rewards, dones, first_state


def test_an_episode_over_ws_matches_the_in_process_one(server):
    episode, obs, rewards, dones = _expected(server.name, seed=3, split="test")
    got_obs, got_rewards, got_dones, state = asyncio.run(_play_over_ws(server.url, server.name, 3, "test"))
    assert (got_obs, got_rewards, got_dones) == (obs, rewards, dones)
    assert state["env"] == server.name and state["task"] == episode.task and state["split"] == "test"
    assert got_rewards[-1] == 1.0


async def _session(url, seed=0, attempts=100):
    """A client with a reset session, retrying while the server is still freeing closed ones."""
    for _ in range(attempts):
        client = GenericEnvClient(base_url=url)
        try:
            return client, await client.reset(seed=seed)
        except (RuntimeError, ConnectionClosed):  # CAPACITY_REACHED, seen as a frame or a close
            await client.close()
            await asyncio.sleep(0.05)
    raise AssertionError("no free session")


def test_concurrent_sessions_are_independent(server):
    """CAPACITY sessions open at once, stepped in interleaved rounds, each its own episode."""
    name, solve, seeds = server.name, BUNDLED[server.name].solve, range(CAPACITY)
    expected = {seed: _expected(name, seed) for seed in seeds}

    async def run():
        # (retrying while the server still frees the sessions earlier tests closed)
        clients, firsts = zip(*await asyncio.gather(*(_session(server.url, seed=s) for s in seeds)))
        try:
            histories = {s: [r.observation] for s, r in zip(seeds, firsts)}
            rewards = {s: [r.reward] for s, r in zip(seeds, firsts)}
            live = {s: c for s, c in zip(seeds, clients)}
            while live:  # one step of every unfinished episode per round, all in flight at once
                results = await asyncio.gather(*(
                    c.step(solve(histories[s]).model_dump(exclude={"metadata"})) for s, c in live.items()))
                for (s, _), r in zip(list(live.items()), results):
                    histories[s].append(r.observation)
                    rewards[s].append(r.reward)
                    if r.done:
                        del live[s]
            return histories, rewards
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    histories, rewards = asyncio.run(run())
    for seed in seeds:
        _, obs, exp_rewards, _ = expected[seed]
        assert histories[seed] == obs and rewards[seed] == exp_rewards


@pytest.mark.parametrize("server", ["echo"], indirect=True)
def test_capacity_and_schema(server):
    schema = json.load(urllib.request.urlopen(f"{server.url}/schema", timeout=10))
    assert schema["action"]["required"] == ["message"]
    assert "echoed_message" in schema["observation"]["properties"]

    async def run():
        clients = [(await _session(server.url))[0] for _ in range(CAPACITY)]
        try:
            # One more: the handshake succeeds, then the server sends an error frame and closes.
            async with ws_connect(server.ws_url) as ws:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert frame["type"] == "error" and frame["data"]["code"] == "CAPACITY_REACHED"
                data = frame["data"]
                assert (data["active_sessions"], data["max_sessions"]) == (CAPACITY, CAPACITY)
            await clients.pop().close()
            late, _ = await _session(server.url)  # the closed session's slot is free again
            clients.append(late)
            return await late.step({"message": echo.task_for_seed(0)["target"]})
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    assert asyncio.run(run()).reward == 1.0


@pytest.mark.parametrize("web, loaded", [(None, False), ("true", True)])
def test_openenv_web_ui_is_imported_only_when_asked_for(web, loaded):
    # Gradio's import costs seconds in every bridge and environment server.
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    if web:
        env["ENABLE_WEB_INTERFACE"] = web
    probe = ("import sys, bridge.envs.serve, openenv.core.env_server as s; "
             "print('gradio' in sys.modules, s.create_web_interface_app is not None)")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(loaded)] * 2
