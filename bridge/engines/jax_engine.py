"""The JAX engine: jaxrl's own KV-cache sampler over `jaxrl.models`, with continuous batching.

Requests become rows (one per completion) that wait for one of `max_batch` decode slots
(`bridge.engines.slots.Slots`: the host plan of `bridge.engines.scheduler`, the device calls of the
sampler). Each device call advances every live slot `decode_steps` tokens;
between calls, rows that ended are handed back and waiting rows are prefilled into the free slots.
When the engine is idle, requests that arrive within `batch_window_s` of the first start together.
Sequences (prompt + completion) hold at most `max_seq_len` tokens: a longer prompt is refused and a
completion that reaches it ends "length". The only shapes are the powers of two up to `max_batch`,
so with `warm_up` every program is compiled before the first request and none mid-run.

Weights are swapped between two device calls, without draining the slots: a row under way samples
its next tokens with the new weights over the keys and values it has (see the sampler), and every
token records the policy version that sampled it (`Completion.token_versions`).

With `lora` (PEFT's adapter_config of the run's adapters) the engine serves the base model with
adapters applied unmerged, `x W + s (x A) B`, the learner's own computation: they start at zero
(the base model) and a snapshot replaces only them, so the base is loaded once and never copied.
Merging instead (W + s B A into a kept copy of the base, then the plain programs) would rewrite
every targeted weight at each version, several times the work of placing the adapters, and keep a
second copy of those weights; decoding unmerged costs next to nothing where the rank is small beside
a projection's width, and shows only at the tiny CPU default's width (experiments/bench/lora.py;
figures in docs/benchmarks.md). In bfloat16 a merge also rounds away updates smaller than the
weights' last bit, which the learner's unmerged model keeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from bridge.engines.admission import admit
from bridge.engines.base import Completion, EngineError, PromptTooLong, SamplingParams, derive_seed, read_off_loop
from bridge.engines.slots import Shapes, Slots
from bridge.engines.scheduler import Row
from jaxrl.compilation import compiles
from jaxrl.models import ModelConfig, load_pretrained, params_from_hf_tensors
from jaxrl.models.lora import add_lora, config_from_peft, with_adapters

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    rows: list[Row]  # prompt-major, params.n per prompt
    future: asyncio.Future


class JaxEngine:
    name = "jax"

    def __init__(self, model_dir: str | Path, dtype: str | None = None, max_batch: int = 64,
                 batch_window_s: float = 0.005, seed: int = 0, tokenizer=None, max_seq_len: int = 2048,
                 prefill_chunk: int = 128, prefix_cache_rows: int | None = None, decode_steps: int = 16,
                 max_stop_ids: int = 8, prefix_block: int = 16, warm_up: bool = False, lora: dict | None = None):
        model = load_pretrained(model_dir, param_dtype=dtype, dtype=dtype)
        self.cfg: ModelConfig = model.cfg
        self.lora = None if lora is None else config_from_peft(lora, "jax engine lora")
        if self.lora is not None:
            model = add_lora(model, self.lora)
        self.graphdef, params = nnx.split(model)
        # Committed to their devices, as swapped-in snapshots are: jit keys on it, so uncommitted
        # first weights would compile every program again after the first swap.
        self.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params))
        self.policy_version = 0
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk),
                            ("decode_steps", decode_steps), ("max_stop_ids", max_stop_ids), ("prefix_block", prefix_block)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"jax engine: {name}={value!r} must be a positive integer")
        max_seq_len = min(max_seq_len, self.cfg.max_position_embeddings)
        self.shapes = Shapes(max_seq_len, min(prefill_chunk, max_seq_len), max_batch, decode_steps, max_stop_ids)
        # Enough rows for every episode of two full batches to find its last turn again.
        rows = 2 * max_batch if prefix_cache_rows is None else prefix_cache_rows
        if not isinstance(rows, int) or rows < 0:
            raise ValueError(f"jax engine: prefix_cache_rows={rows!r} must be an integer >= 0")
        self.slots = Slots(self.cfg, self.shapes, rows, prefix_block)
        self.prefix = self.slots.prefix
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.tokenizer = tokenizer
        self._rng = np.random.default_rng(seed)
        self._queue: asyncio.Queue[_Request] | None = None
        self._swap_lock = asyncio.Lock()
        self._worker: asyncio.Task | None = None
        self._running: list[_Request] = []
        # busy_s: the ticks' time, device_s: its part in device calls (the rest is host bookkeeping),
        # insert_s: the inserts' part of that (the rest is decoding).
        # shared_decode_calls: decode calls that read each group's shared prompt once (the scheduler's counters).
        self.stats = {"decode_calls": 0, "shared_decode_calls": 0, "insert_calls": 0, "rows": 0, "tokens": 0, "busy_s": 0.0,
                      "device_s": 0.0, "insert_s": 0.0, "compiles": compiles()}
        if warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compiles (or loads from the persistent cache) the programs of every batch size."""
        self.slots.warm_up(self.graphdef, self.params)
        log.info("jax engine: compiled batch sizes up to %d (max_seq_len %d)", self.max_batch, self.shapes.max_seq_len)
        self.stats["compiles"] = compiles()

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer; pass stop_token_ids instead")
        if len(params.stop_token_ids) > self.shapes.max_stop_ids:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids, but the jax engine takes at most "
                             f"{self.shapes.max_stop_ids} (its max_stop_ids)")
        longest = self.shapes.max_seq_len
        for i, p in enumerate(prompts):
            if len(p) >= longest:
                raise PromptTooLong(i, len(p), longest)  # max_seq_len, at most max_position_embeddings
        if self._worker is None or self._worker.get_loop() is not asyncio.get_running_loop():
            # The batching task lives in the caller's event loop (one per asyncio.run).
            # Requests of an earlier loop are gone with it.
            self.slots.drop([row for req in self._running for row in req.rows])
            self._queue = asyncio.Queue()
            self._running = []
            self._worker = asyncio.create_task(self._batch_loop())
        base = int(self._rng.integers(0, 2**63)) if params.seed is None else params.seed
        rows = [Row(list(prompt), min(params.max_tokens, longest - len(prompt)), derive_seed(base, r),
                    params.temperature, params.top_p, params.top_k, params.stop_token_ids)
                for r, prompt in enumerate(p for p in prompts for _ in range(params.n))]
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(prompts, params, rows, future))
        return await future

    async def _batch_loop(self) -> None:
        while True:
            if not self.slots.busy():
                self._start(await self._queue.get())
                deadline = time.monotonic() + self.batch_window_s
                while len(self.slots.waiting) < self.max_batch:
                    try:
                        self._start(await asyncio.wait_for(self._queue.get(), max(deadline - time.monotonic(), 0)))
                    except asyncio.TimeoutError:
                        break
            while not self._queue.empty():
                self._start(self._queue.get_nowait())
            cancelled = [req for req in self._running if req.future.done()]  # no device time for them
            self.slots.drop([row for req in cancelled for row in req.rows])
            self._running = [req for req in self._running if not req.future.done()]
            if not self.slots.busy():
                continue
            async with self._swap_lock:
                params, version = self.params, self.policy_version
                try:
                    await asyncio.to_thread(self._step, params, version)
                except Exception as e:  # one bad call fails the requests under way, not the engine
                    for req in self._running:
                        if not req.future.done():
                            req.future.set_exception(EngineError(f"jax engine generate failed: {e}"))
                    self._running = []
                    self.slots.waiting.clear()
                    self.slots.reset()
                    continue
            done = [req for req in self._running if all(row.finish_reason for row in req.rows)]
            for req in done:
                self._running.remove(req)
                if not req.future.done():
                    req.future.set_result(self._completions(req))
            if done:  # callers woken by their results queue their next turn before the next call starts
                await asyncio.sleep(0)

    def _start(self, req: _Request) -> None:
        if not req.future.done():
            self.slots.add(req.rows)
            self._running.append(req)

    def _step(self, params, version: int) -> None:
        start = time.perf_counter()
        self.slots.step(self.graphdef, params, version)
        self.stats["busy_s"] += time.perf_counter() - start
        self.stats.update(self.slots.stats, device_s=self.slots.device_s, insert_s=self.slots.insert_s,
                          compiles=compiles())
        self.stats.update({f"prefix_{k}": v for k, v in self.prefix.stats.items()})

    def _completions(self, req: _Request) -> list[list[Completion]]:
        n = req.params.n
        return [[self._finish(row, req.params) for row in req.rows[i * n:(i + 1) * n]] for i in range(len(req.prompts))]

    def _finish(self, row: Row, params: SamplingParams) -> Completion:
        end = len(row.tokens)
        reason = row.finish_reason
        if reason != "stop" and params.stop:
            cut = self._stop_string_end(row.tokens, params.stop)
            if cut is not None:
                end, reason = cut, "stop"
        routes = None if row.routes is None else row.routes[:len(row.prompt) + end - 1]
        return Completion(row.tokens[:end], row.logprobs[:end], reason, row.versions[0], row.versions[:end], routes)

    def _stop_string_end(self, tokens, stops) -> int | None:
        """Tokens up to the one that completes the first stop string (token ids stay untouched)."""
        for i in range(len(tokens)):
            if any(s in self.tokenizer.decode(tokens[: i + 1]) for s in stops):
                return i + 1
        return None

    async def load_snapshot(self, path: str, version: int) -> float:
        start = time.perf_counter()
        await self.swap(await read_off_loop(self._read_snapshot, path, version), version)
        return time.perf_counter() - start

    async def swap(self, params, version: int) -> None:
        """Serves `params` (shaped, typed and placed like the served ones) as `version` from the next
        device call on; rows under way go on with them."""
        async with self._swap_lock:
            self.params, self.policy_version = params, version

    def _read_snapshot(self, path: str, version: int):
        """Snapshot `version`'s weights as new params shaped, typed and placed like the served ones
        (nothing is built or initialised); SnapshotRefused if they cannot be served."""
        snapshot = admit(path, version, self.cfg, self.lora)
        if self.lora is not None:
            return with_adapters(self.cfg, self.lora, snapshot.tensors, self.params, str(snapshot.path))
        return params_from_hf_tensors(self.cfg, snapshot.tensors, self.params, str(snapshot.path))

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
