"""The engine interface: token ids in, token ids and per-token logprobs out; weights swapped in place.

Logprobs are those of the sampled token under `log_softmax(logits / temperature)` over the whole
vocabulary, the quantity the learner recomputes (top-p / top-k truncation only shapes sampling).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import math
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a hash of `parts` (BLAKE2b of their repr), so that seeds derived from
    neighbouring parts (group 3 and 4, turn 0 and 1) share no random streams, as `seed + i` would."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EngineError(RuntimeError):
    """Generation or weight loading failed inside an engine."""


class PromptTooLong(ValueError):
    """A prompt that leaves the engine no room to generate: `tokens` of at most `limit` - 1."""

    def __init__(self, index: int, tokens: int, limit: int):
        self.tokens, self.limit = tokens, limit
        super().__init__(f"prompt {index} has {tokens} tokens, but the engine holds {limit} tokens per sequence "
                         "(prompt and completion), which leaves no room to generate; shorten the prompt or raise "
                         "the engine's max_seq_len")


class SnapshotRefused(EngineError):
    """A snapshot that cannot be served (wrong shape, damaged); the old weights keep serving."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    # The same seed and prompts sample the same completions (the jax engine: completion r of a
    # call, prompt-major, with derive_seed(seed, r)); None: the engine draws one.
    seed: int | None = None
    # An episode's limits, here so that they travel from the config to the episode loop with the
    # turn's: model turns, and tokens of all turns with the environment's (None: max_tokens).
    # An engine samples one turn and reads neither.
    max_turns: int = 1
    max_total_tokens: int | None = None

    def __post_init__(self):
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if not 0 <= self.temperature < math.inf:  # NaN included
            problems.append(f"temperature={self.temperature} must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0")
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if self.max_turns < 1:
            problems.append(f"max_turns={self.max_turns} must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            problems.append(f"max_total_tokens={self.max_total_tokens} must be >= 1 (None: max_tokens)")
        if problems:
            raise ValueError("sampling params: " + "; ".join(problems))


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    # The weights that sampled the first token: the oldest of `token_versions` (a completion
    # under way when new weights arrive goes on with them).
    policy_version: int
    token_versions: list[int] | None = None  # each token's policy version; None: all policy_version
    # An MoE model's expert ids, from an engine that records them: the route of every token the model
    # was fed, the prompt's and the completion's but the last, (len(prompt) + len(token_ids) - 1, MoE
    # layers x top-k), layer by layer (vLLM's `routed_experts` convention); None otherwise.
    routes: np.ndarray | None = None

    def __post_init__(self):
        if self.token_versions is None:
            self.token_versions = [self.policy_version] * len(self.token_ids)


class Engine(Protocol):
    """What the bridge needs from a generation backend."""

    name: str
    policy_version: int

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt; concurrent calls are batched together."""

    async def load_snapshot(self, path: str, version: int) -> float:
        """Serves the snapshot's weights from now on; returns load seconds. Raises SnapshotRefused."""

    async def close(self) -> None:
        """Frees the engine's resources."""


async def read_off_loop(fn: Callable, *args):
    """`await fn(*args)` run on a daemon thread of its own, for snapshot reads.

    A read stuck on storage (an object store that stopped answering) must not keep the bridge
    from exiting once its parent is gone: the default executor's threads are joined at exit.
    """
    future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # the awaiting task was cancelled first
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to the awaiting task
            future.set_exception(e)

    threading.Thread(target=run, name="snapshot-read", daemon=True).start()
    return await asyncio.wrap_future(future)
