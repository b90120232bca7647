"""vLLM engine: `vllm.LLM` in-process, token ids in and out, weights replaced in place.

vLLM is imported only here, so the default (JAX) path never needs it. Its `LLM` is synchronous:
one worker thread runs it, and the requests that arrive while it is busy are sent together as the
next `llm.generate` batch. Weights change only between batches, under the same lock, so every
completion carries the one policy version that generated it.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, the log-softmax of the logits
after temperature (the default `raw_logprobs` ignores temperature). vLLM's processed logprobs also
apply top-p / top-k truncation, which is not the full-vocabulary `log_softmax(logits / T)` the
learner recomputes, so truncated sampling is refused rather than reported wrongly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import warnings
from pathlib import Path

import numpy as np

from bridge.engines.base import Completion, EngineError, SamplingParams, SnapshotRefused, read_off_loop

# For CPU (tests, laptops); also set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine.
# Without kv_cache_memory_bytes vLLM reserves ~12 GiB of KV cache; dtype "auto" is bf16 on CPU.
CPU_ENGINE_KWARGS = {
    "distributed_executor_backend": "uni",
    "enforce_eager": True,
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 << 20,
}

# Config keys that fix the tensors' shapes: a snapshot must agree on all of them.
_SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
)


def _shape_config(hf: dict) -> dict:
    """The shape keys of an HF config dict, with transformers' defaults filled in."""
    out = {k: hf.get(k) for k in _SHAPE_KEYS}
    heads = out["num_attention_heads"]
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = heads
    if out["head_dim"] is None and heads:
        out["head_dim"] = out["hidden_size"] // heads
    out["tie_word_embeddings"] = bool(out["tie_word_embeddings"])
    return out


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the model directory's safetensors headers (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _to_torch(x: np.ndarray):
    import torch

    if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, which torch cannot take directly
        x = x.view(np.int16)
        dtype = torch.bfloat16
    else:
        dtype = None
    with warnings.catch_warnings():
        # Snapshots are read-only memory maps; the weights are only copied from, never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(x)
    return t.view(dtype) if dtype is not None else t


def _repack_tied_lm_head(model) -> None:
    """Redoes the LM head's post-load step, which on CPU packs a private copy of its weight.

    reload_weights refills the embedding that a tied head shares but skips the head itself (an
    alias), so on CPU the head would go on computing logits with the old weights.
    """
    from vllm.platforms import current_platform

    head = getattr(model, "lm_head", None)
    if current_platform.is_cpu() and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """`vllm.LLM` serving `model_dir`; `engine_kwargs` go to `vllm.LLM` as they are.

    Building it loads the model and takes seconds: construct it off the event loop if that matters.
    """

    name = "vllm"

    def __init__(
        self, model_dir: str | Path, engine_kwargs: dict | None = None, policy_version: int = 0
    ):
        import vllm

        self.model_dir = Path(model_dir)
        kwargs = dict(engine_kwargs or {})
        mode = kwargs.setdefault("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ValueError(
                f"engine_kwargs logprobs_mode={mode!r}: the vllm engine needs 'processed_logprobs' "
                f"(log_softmax(logits / temperature), what the learner recomputes)"
            )
        self._served_config = _shape_config(json.loads((self.model_dir / "config.json").read_text()))
        self._served_shapes = _checkpoint_shapes(self.model_dir)
        # What every snapshot must carry: not the recomputed rotary tables, nor a tied head.
        self._required = {
            name for name in self._served_shapes
            if not name.endswith("rotary_emb.inv_freq")
            and not (self._served_config["tie_word_embeddings"] and name == "lm_head.weight")
        }
        self.llm = vllm.LLM(model=str(self.model_dir), **kwargs)
        self._max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._vllm = vllm
        self.policy_version = policy_version
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm")
        self._lock: asyncio.Lock | None = None  # created on first use, inside the running loop
        self._pending: list[tuple[list[list[int]], SamplingParams, asyncio.Future]] = []
        self._pump: asyncio.Task | None = None
        self._broken: str | None = None

    def _engine_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuses here what vLLM would refuse, so that one bad request cannot fail its whole batch."""
        if params.temperature > 0 and (params.top_p < 1 or params.top_k > 0):
            raise ValueError(
                f"vllm engine: top_p={params.top_p}, top_k={params.top_k}: vLLM reports logprobs of "
                f"the truncated distribution, not log_softmax(logits / temperature) over the whole "
                f"vocabulary that the learner recomputes; use top_p=1, top_k=0 or the jax engine"
            )
        vocab, max_len = self._served_config["vocab_size"], self._max_model_len
        for i, prompt in enumerate(prompts):
            if not 0 < len(prompt) < max_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; the engine takes 1 to {max_len - 1}"
                )
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_request(prompts, params)
        if not prompts:
            return []
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompts, params, future))
        if self._pump is None or self._pump.done():
            # A task, not a direct call: every request made in this loop iteration joins the batch.
            self._pump = asyncio.create_task(self._run_pending())
        return await future

    async def _run_pending(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            async with self._engine_lock():
                batch, self._pending = self._pending, []
                try:
                    if self._broken:
                        raise EngineError(self._broken)
                    results = await loop.run_in_executor(self._executor, self._generate_batch, batch)
                except Exception as e:
                    if not isinstance(e, EngineError):
                        e = EngineError(f"vllm generate failed: {e!r}")
                    results = [e] * len(batch)
                for (*_, future), result in zip(batch, results):
                    if future.done():  # the caller was cancelled meanwhile
                        continue
                    if isinstance(result, EngineError):
                        future.set_exception(result)
                    else:
                        future.set_result(result)

    def _sampling_params(self, p: SamplingParams):
        # top_p / top_k stay at vLLM's "off": truncated sampling is refused, and for greedy rows
        # truncation would change nothing but their logprobs.
        return self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            max_tokens=p.max_tokens,
            stop_token_ids=list(p.stop_token_ids),
            stop=list(p.stop),
            # Only the caller's stop ids end a completion, as in the jax engine.
            ignore_eos=True,
            seed=p.seed,
            logprobs=0,  # the sampled token's logprob only
            detokenize=bool(p.stop),  # text is needed only to match stop strings
        )

    def _generate_batch(self, batch) -> list[list[list[Completion]]]:
        """Runs in the worker thread: one `llm.generate` for every request of the batch."""
        from vllm.inputs import TokensPrompt

        prompts, sampling = [], []
        for request_prompts, params, _ in batch:
            sp = self._sampling_params(params)
            prompts += [TokensPrompt(prompt_token_ids=list(p)) for p in request_prompts]
            sampling += [sp] * len(request_prompts)
        outputs = iter(self.llm.generate(prompts, sampling, use_tqdm=False))
        version = self.policy_version
        results = []
        for request_prompts, _, _ in batch:
            results.append(
                [[self._completion(c, version) for c in next(outputs).outputs] for _ in request_prompts]
            )
        return results

    @staticmethod
    def _completion(c, version: int) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise EngineError(f"vllm finished a completion with reason {c.finish_reason!r}")
        token_ids = list(c.token_ids)
        logprobs = [step[t].logprob for t, step in zip(token_ids, c.logprobs)]
        return Completion(token_ids, logprobs, c.finish_reason, version)

    async def load_snapshot(self, path: str, version: int) -> float:
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        # Read and check off the lock: generation goes on with the old weights meanwhile.
        weights = await read_off_loop(self._read_snapshot, path, version)
        async with self._engine_lock():
            if self._broken:
                raise EngineError(self._broken)
            await loop.run_in_executor(self._executor, self._swap_weights, weights, version)
        return time.perf_counter() - start

    def _read_snapshot(self, path: str, version: int) -> list:
        from jaxrl.snapshots import SnapshotError, SnapshotReader

        try:
            snapshot = SnapshotReader(path).load(version)
        except SnapshotError as e:
            raise SnapshotRefused(str(e)) from e
        where = f"snapshot {snapshot.path}"
        theirs = _shape_config(snapshot.hf_config)
        differ = [k for k in _SHAPE_KEYS if theirs[k] != self._served_config[k]]
        if differ:
            details = ", ".join(
                f"{k}={theirs[k]!r} (serving {self._served_config[k]!r})" for k in differ
            )
            raise SnapshotRefused(f"{where}: model shape differs from the served model: {details}")
        shapes = {name: tuple(x.shape) for name, x in snapshot.tensors.items()}
        served = self._served_shapes
        missing = sorted(self._required - set(shapes))
        unknown = sorted(set(shapes) - set(served))
        wrong = sorted(n for n in set(shapes) & set(served) if shapes[n] != served[n])
        if missing or unknown or wrong:
            raise SnapshotRefused(
                f"{where}: tensors do not fit the served model (missing {missing[:5]}, unknown "
                f"{unknown[:5]}, wrong shape {wrong[:5]})"
            )
        return [(name, _to_torch(x)) for name, x in snapshot.tensors.items()]

    def _swap_weights(self, weights: list, version: int) -> None:
        """Runs in the worker thread, between generate batches."""
        try:
            # One call with the full list: vLLM fuses q/k/v and gate/up, so each group arrives whole.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self._served_config["tie_word_embeddings"]:
                self.llm.apply_model(_repack_tied_lm_head)
            # Cached prefixes hold KV computed with the old weights.
            if not self.llm.reset_prefix_cache():
                raise EngineError("vllm could not reset its prefix cache")
        except Exception as e:
            self._broken = (
                f"vllm weight reload of version {version} failed; the weights are in an unknown "
                f"state, restart the engine: {e!r}"
            )
            raise EngineError(self._broken) from e
        self.policy_version = version

    async def close(self) -> None:
        async with self._engine_lock():
            self._executor.shutdown(wait=True)
            self._broken = "vllm engine is closed"
            self.llm.llm_engine.engine_core.shutdown()
