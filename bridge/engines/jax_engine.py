"""The JAX engine: jaxrl's own KV-cache sampler over `jaxrl.models`, batching concurrent requests.

Requests that arrive within `batch_window_s` of each other run as one device call of at most
`max_batch` rows, padded to a power of two. Sequences (prompt + completion) hold at most
`max_seq_len` tokens: a longer prompt is refused and a completion that reaches it ends "length".
The only shapes are the batch sizes, so with `warm_up` every program is compiled before the first
request and none mid-run. Weights are swapped only between device calls, and every completion
records the policy version that produced it.
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

from bridge.engines.base import (Completion, EngineError, SamplingParams, SnapshotRefused, derive_seed,
                                 read_off_loop)
from bridge.engines.sampler import Generation, PrefixCache, RowParams, Shapes, generate_rows
from jaxrl.compilation import compiles
from jaxrl.models import CheckpointError, ModelConfig, load_pretrained, params_from_hf_tensors
from jaxrl.snapshots import SnapshotError, SnapshotReader

log = logging.getLogger(__name__)

# Config fields that fix parameter shapes: a snapshot must agree on all of them.
SHAPE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
)


@dataclasses.dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    seeds: np.ndarray
    future: asyncio.Future


class JaxEngine:
    name = "jax"

    def __init__(self, model_dir: str | Path, dtype: str | None = None, max_batch: int = 64,
                 batch_window_s: float = 0.005, seed: int = 0, tokenizer=None, max_seq_len: int = 2048,
                 prefill_chunk: int = 64, prefix_cache_rows: int | None = None, warm_up: bool = False):
        model = load_pretrained(model_dir, param_dtype=dtype, dtype=dtype)
        self.cfg: ModelConfig = model.cfg
        self.graphdef, params = nnx.split(model)
        # Committed to their devices, as swapped-in snapshots are: jit keys on it, so uncommitted
        # first weights would compile every program again after the first swap.
        self.params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params))
        self.policy_version = 0
        for name, value in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"jax engine: {name}={value!r} must be a positive integer")
        self.shapes = Shapes(min(max_seq_len, self.cfg.max_position_embeddings), prefill_chunk, max_batch)
        # Enough rows for every episode of two full batches to find its last turn again.
        rows = 2 * max_batch if prefix_cache_rows is None else prefix_cache_rows
        if not isinstance(rows, int) or rows < 0:
            raise ValueError(f"jax engine: prefix_cache_rows={rows!r} must be an integer >= 0")
        self.prefix = PrefixCache(self.cfg, self.shapes, rows)
        self._prefix_version = self.policy_version
        self.max_batch = max_batch
        self.batch_window_s = batch_window_s
        self.tokenizer = tokenizer
        self._rng = np.random.default_rng(seed)
        self._queue: asyncio.Queue[_Request] | None = None
        self._swap_lock = asyncio.Lock()
        self._worker: asyncio.Task | None = None
        self.stats = {"batches": 0, "rows": 0, "tokens": 0, "generate_s": 0.0, "compiles": compiles()}
        if warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compiles (or loads from the persistent cache) the program of every batch size."""
        rows = self.shapes.batches()[-1]
        for n in self.shapes.batches():
            generate_rows(self.graphdef, self.params, [[0]] * n, RowParams(
                temperature=np.ones(n, np.float32), top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                max_tokens=np.ones(n, np.int32), seed=np.arange(n, dtype=np.uint32), stop_ids=[()] * n),
                self.shapes, self.prefix)
        self.prefix.clear()
        log.info("jax engine: compiled batch sizes up to %d (max_seq_len %d)", rows, self.shapes.max_seq_len)
        self.stats["compiles"] = compiles()

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer; pass stop_token_ids instead")
        longest = self.shapes.max_seq_len
        for i, p in enumerate(prompts):
            if len(p) >= longest:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens, but the engine holds {longest} tokens per sequence "
                    f"(max_seq_len, at most the model's max_position_embeddings), which leaves no room to "
                    f"generate; shorten the prompt or raise max_seq_len")
        if self._worker is None or self._worker.get_loop() is not asyncio.get_running_loop():
            # The batching task lives in the caller's event loop (one per asyncio.run).
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._batch_loop())
        rows = len(prompts) * params.n
        base = int(self._rng.integers(0, 2**63)) if params.seed is None else params.seed
        seeds = np.array([derive_seed(base, r) for r in range(rows)], np.uint64)
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Request(prompts, params, seeds, future))
        return await future

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.batch_window_s
            rows = len(batch[0].prompts) * batch[0].params.n
            while rows < self.max_batch:
                try:
                    req = await asyncio.wait_for(self._queue.get(), max(deadline - time.monotonic(), 0))
                except asyncio.TimeoutError:
                    break
                batch.append(req)
                rows += len(req.prompts) * req.params.n
            batch = [req for req in batch if not req.future.done()]  # cancelled: no device time
            if not batch:
                continue
            async with self._swap_lock:
                params, version = self.params, self.policy_version
                try:
                    results = await asyncio.to_thread(self._run, batch, params, version)
                except Exception as e:  # one bad batch fails its requests, not the engine
                    for req in batch:
                        if not req.future.done():
                            req.future.set_exception(EngineError(f"jax engine generate failed: {e}"))
                    continue
            for req, result in zip(batch, results):
                if not req.future.done():
                    req.future.set_result(result)

    def _run(self, batch: list[_Request], params, version: int) -> list[list[list[Completion]]]:
        prompts, fields = [], {k: [] for k in ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids")}
        for req in batch:
            for prompt in req.prompts:
                for _ in range(req.params.n):
                    prompts.append(prompt)
                    for key in fields:
                        fields[key].append(getattr(req.params, key))
                    # A completion that reaches max_seq_len ends "length".
                    fields["max_tokens"][-1] = min(req.params.max_tokens, self.shapes.max_seq_len - len(prompt))
        rows = RowParams(
            temperature=np.asarray(fields["temperature"], np.float32),
            top_p=np.asarray(fields["top_p"], np.float32),
            top_k=np.asarray(fields["top_k"], np.int32),
            max_tokens=np.asarray(fields["max_tokens"], np.int32),
            seed=np.concatenate([req.seeds for req in batch]),
            stop_ids=fields["stop_token_ids"],
        )
        start = time.perf_counter()
        if version != self._prefix_version:  # cached keys and values of other weights
            self.prefix.clear()
            self._prefix_version = version
        out = Generation([], [], [])
        for lo in range(0, len(prompts), self.max_batch):  # one request may bring more rows than a batch
            try:
                part = generate_rows(self.graphdef, params, prompts[lo:lo + self.max_batch],
                                     rows.slice(lo, lo + self.max_batch), self.shapes, self.prefix)
            except Exception:
                self.prefix.clear()
                raise
            out.tokens += part.tokens
            out.logprobs += part.logprobs
            out.finish_reasons += part.finish_reasons
            self.stats["batches"] += 1
        self.stats["generate_s"] += time.perf_counter() - start
        self.stats["rows"] += len(prompts)
        self.stats["tokens"] += sum(len(t) for t in out.tokens)
        self.stats["compiles"] = compiles()
        self.stats.update({f"prefix_{k}": v for k, v in self.prefix.stats.items()})
        results, i = [], 0
        for req in batch:
            per_prompt = []
            for _ in req.prompts:
                group = []
                for _ in range(req.params.n):
                    group.append(self._finish(out.tokens[i], out.logprobs[i], out.finish_reasons[i], req.params, version))
                    i += 1
                per_prompt.append(group)
            results.append(per_prompt)
        return results

    def _finish(self, tokens, logprobs, reason, params: SamplingParams, version: int) -> Completion:
        if reason != "stop" and params.stop:
            end = self._stop_string_end(tokens, params.stop)
            if end is not None:
                return Completion(tokens[:end], logprobs[:end], "stop", version)
        return Completion(tokens, logprobs, reason, version)

    def _stop_string_end(self, tokens, stops) -> int | None:
        """Tokens up to the one that completes the first stop string (token ids stay untouched)."""
        for i in range(len(tokens)):
            if any(s in self.tokenizer.decode(tokens[: i + 1]) for s in stops):
                return i + 1
        return None

    async def load_snapshot(self, path: str, version: int) -> float:
        start = time.perf_counter()
        params = await read_off_loop(self._read_snapshot, path, version)
        async with self._swap_lock:
            self.params, self.policy_version = params, version
        return time.perf_counter() - start

    def _read_snapshot(self, path: str, version: int):
        """Snapshot `version`'s weights as new params shaped, typed and placed like the served ones
        (nothing is built or initialised); SnapshotRefused if they cannot be served."""
        try:
            snapshot = SnapshotReader(path).load(version)
            incoming = ModelConfig.from_hf(snapshot.hf_config, source=f"{snapshot.path} manifest")
        except (SnapshotError, ValueError) as e:
            raise SnapshotRefused(str(e)) from e
        differing = [f"{k}: serving {getattr(self.cfg, k)}, snapshot {getattr(incoming, k)}"
                     for k in SHAPE_FIELDS if getattr(self.cfg, k) != getattr(incoming, k)]
        if differing:
            raise SnapshotRefused(f"{snapshot.path}: a different model shape ({'; '.join(differing)})")
        try:
            return params_from_hf_tensors(self.cfg, snapshot.tensors, self.params, str(snapshot.path))
        except CheckpointError as e:
            raise SnapshotRefused(str(e)) from e

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._worker = None
