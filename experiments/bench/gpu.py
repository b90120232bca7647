"""The GPU figures: learner, JAX engine, weight sync and a real run at Qwen3-0.6B / 1.7B shapes; a Qwen3-MoE.

    python -m experiments.bench.gpu [--only PART,...] [--budget-s 470] [--out DIR] [--tiny]

Models are random (nothing downloaded), of the exact shapes of Qwen3-0.6B (hidden 1,024, 28 layers,
16 query / 8 KV heads of 128, MLP 3,072, vocab 151,936, tied) and Qwen3-1.7B (hidden 2,048, MLP
6,144); weights are served in bfloat16, the learner keeps float32 parameters and AdamW state and
computes in bfloat16 (a bfloat16 checkpoint loaded with model.dtype float32, as `jaxrl train` does).
`--tiny`: every part at toy sizes on whatever JAX finds (CI runs it on the CPU).

Each part runs in a process of its own (its own device memory, its own time limit), in this order,
until `--budget-s` is spent; a part that fails or runs out of time records its error and the rest
go on. `--out DIR` gets `gpu.json` (rewritten after every part) and `gpu.log` (the parts' output).

  peaks          the card's own ceilings: an n x n x n bfloat16 matmul's FLOP/s, a device copy's
                 bytes/s (bytes read + written) and a sum's (bytes read), medians of 10 after a
                 warm-up; memory floors use the faster of the two.
  learner        the GRPO train step (forward, backward, AdamW; grpo loss) jitted once, at 64 x 1,024
                 tokens (prompt 512 + completion 512, no padding; `learner_long`: 16 x 8,192, prompt
                 1,024), gradients accumulated over micro-batches of 16 x 1,024 (1 x 8,192); tokens/s
                 (median of 3 after one), MFU = 6 N tokens/s over the peak (N: every parameter, the tied
                 embedding once), peak device memory.
  torch_learner  the same step, loss, batch and micro-batches in PyTorch (transformers' Qwen3, float32
                 weights under bfloat16 autocast, SDPA attention, fused AdamW) on the same card
                 (`torch_learner_long`: at learner_long's size).
  engine         `JaxEngine` generation at 64 and 256 slots, 512 prompt + 512 sampled tokens each (no
                 stop), one warm-up run then one timed; against the floor: parameter + live KV bytes
                 of every decode step over the copy rate, plus the prefill's FLOPs over the matmul
                 rate. `agreement`: |engine logprob - learner logprob| of the sampled tokens of the
                 64-slot run (engine bfloat16; learner float32 weights computing in bfloat16).
  hf_generate    transformers' `generate` (bfloat16, sampling, the same prompts and lengths).
  sync           a snapshot published by a learner (float32 params on the device -> bfloat16 Orbax
                 snapshot) and loaded by a JAX engine in a second process, seconds each way, 0.6B and
                 1.7B, on disk and in /dev/shm.
  run            `jaxrl train` for 20 steps: a model of 0.6B's body (the bundled tokenizer's
                 vocabulary), the bundled echo environment, bridge and learner on one card (JAX
                 allocating on demand in both); s/step and its phases (medians after step 1).
  learner_long, torch_learner_long   (see learner)
  lora           experiments.bench.lora at 0.6B (rank 16): learner memory and adapter sync against
                 full fine-tuning.
  multiturn      experiments.bench.multiturn's episodes on the JAX engine at 0.6B: multi-turn tokens/s
                 over one full batch's.
  moe_learner    a Qwen3-MoE of 16 layers, hidden 1,024, attention as 0.6B's, 64 experts of width 512, top 8
                 (1.87B parameters, 0.46B active; float32 parameters and AdamW state computing in bfloat16, as
                 learner): one layer's experts over a micro-batch's tokens, forward and backward, grouped
                 (`jax.lax.ragged_dot`) against every expert on every token (experiments.bench.moe); then the
                 GRPO step at 32 x 1,024 tokens in micro-batches of 8 x 1,024, MFU = 6 N tokens/s over the
                 peak with N the active parameters.
  torch_moe_learner  the same step in PyTorch (transformers' `Qwen3MoeForCausalLM`, its default experts
                 implementation): as torch_learner, and with bfloat16 weights and AdamW state (its grouped_mm
                 runs in the weights' dtype: float32 under autocast); the faster is the baseline.
  moe_engine     `JaxEngine` on the MoE (bfloat16) at 64 slots, 512 prompt + 256 sampled tokens, recording
                 routes and without its caches' route buffer (experiments.bench.moe), in turn after a warm-up
                 round: against the floor (prefill FLOPs of the active parameters) and what recording costs.
                 Not measured yet: an expert-sharded step (the experts over two virtual shards of the card),
                 which waits for expert parallelism.

Last line: one JSON object: `goals` first (each goal's figure and whether it is met), then each
part's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1 << 30
PARTIAL = "partial figures: "
SHAPES = {
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32),
    # 1.87B parameters, 0.46B active (the tied embedding once)
    "moe": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=16,
                num_heads=16, num_kv_heads=8, head_dim=128, num_experts=64, num_experts_per_tok=8,
                moe_intermediate_size=512),
    "tiny_moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32),
}
# (rows, prompt, completion, micro-batches): a micro-batch of 16 x 1,024 or 1 x 8,192 tokens keeps
# the attention probabilities the backward pass keeps within an H100's memory; the MoE's of 8 x 1,024
# its token-expert pairs' activations too, beside 30 GB of float32 parameters, gradients and AdamW state.
FULL = dict(model="0.6b", sync_models=("0.6b", "1.7b"), matmul_n=8192, copy_elems=1 << 30,
            learner=(64, 512, 512, 4), learner_long=(16, 1024, 7168, 16), slots=(64, 256), prompt=512, new=512,
            hf_slots=(64, 256), run_steps=20, run_groups=8, repeats=3, moe_model="moe", moe_learner=(32, 512, 512, 4),
            moe_slots=64, moe_new=256)
TINY = dict(model="tiny", sync_models=("tiny",), matmul_n=256, copy_elems=1 << 20,
            learner=(8, 8, 24, 2), learner_long=(4, 16, 48, 4), slots=(4, 8), prompt=16, new=16,
            hf_slots=(4,), run_steps=2, run_groups=1, repeats=2, moe_model="tiny_moe", moe_learner=(8, 8, 24, 2),
            moe_slots=4, moe_new=16)
# Seconds each part may take at most (the whole run: --budget-s); the order is the priority.
BUDGETS = {"peaks": 40, "learner": 240, "torch_learner": 60, "engine": 120, "hf_generate": 60, "sync": 80,
           "run": 150, "learner_long": 120, "torch_learner_long": 60, "lora": 150, "multiturn": 100,
           "moe_learner": 240, "torch_moe_learner": 90, "moe_engine": 240}
PARTS = tuple(BUDGETS)
GOALS = {"learner_mfu": 0.35, "learner_over_torch": 1.5, "engine_over_floor_max": 3.0, "engine_over_hf": 3.0,
         "sync_0.6b_s_max": 1.0, "moe_learner_mfu": 0.2, "moe_learner_over_torch": 1.5,
         "moe_route_recording_ratio_max": 1.05}


def model_config(shape: str, dtype: str = "bfloat16", param_dtype: str | None = None, **extra):
    from jaxrl.models import ModelConfig

    return ModelConfig(**{"model_type": "qwen3", "qk_norm": True, "tie_word_embeddings": True,
                          "max_position_embeddings": 16384, "rope_theta": 1e6, "dtype": dtype,
                          "param_dtype": param_dtype or dtype, **SHAPES[shape], **extra})


def num_params(cfg) -> int:
    import math

    import jax
    from flax import nnx

    from jaxrl.models import Decoder

    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def model_dir(work: Path, shape: str) -> Path:
    """A random bfloat16 model of `shape` as a Hugging Face directory (built once per run)."""
    from flax import nnx

    from jaxrl.models import Decoder, save_pretrained

    path = work / f"model-{shape}"
    if not (path / "config.json").exists():
        save_pretrained(Decoder(model_config(shape), nnx.Rngs(0)), path)
    return path


def median_s(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` (which blocks until its device work is done) after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def partial(figures: dict) -> None:
    """The part's figures so far: what the run keeps if the part fails or runs out of time later."""
    print(PARTIAL + json.dumps(figures), flush=True)


def device_peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# -- parts (each in its own process) --------------------------------------------------------------


def part_peaks(s: dict, work: Path) -> dict:
    import jax
    import jax.numpy as jnp

    n = s["matmul_n"]
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul_s = median_s(lambda: matmul(a, b).block_until_ready(), 10)
    x = jax.random.normal(kc, (s["copy_elems"],), jnp.bfloat16)
    copy = jax.jit(lambda x: x + 1)  # one read and one write of every element
    copy_s = median_s(lambda: copy(x).block_until_ready(), 10)
    read = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))  # one read, as decoding reads weights and KV
    read_s = median_s(lambda: read(x).block_until_ready(), 10)
    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "matmul_flops": 2 * n ** 3 / matmul_s, "matmul_n": n, "copy_bytes_per_s": 2 * x.nbytes / copy_s,
            "read_bytes_per_s": x.nbytes / read_s, "copy_bytes": 2 * x.nbytes}


def full_batch(rows: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    ones = np.ones
    return {"prompt_BxP": rng.integers(10, vocab, (rows, prompt)).astype(np.int32),
            "prompt_mask_BxP": ones((rows, prompt), np.int32),
            "completion_BxC": rng.integers(10, vocab, (rows, completion)).astype(np.int32),
            "completion_mask_BxC": ones((rows, completion), np.int32),
            "loss_mask_BxC": ones((rows, completion), np.int32),
            "rewards_BxR": rng.random((rows, 1)).astype(np.float32)}


def learner_config(shape: str):
    """The learner's model: float32 parameters and AdamW state, computing in bfloat16 (as `jaxrl train` loads
    a bfloat16 checkpoint)."""
    return model_config(shape, dtype="bfloat16", param_dtype="float32")


def part_learner(s: dict, work: Path) -> dict:
    return learner_step(learner_config(s["model"]), *s["learner"], s)


def part_learner_long(s: dict, work: Path) -> dict:
    return learner_step(learner_config(s["model"]), *s["learner_long"], s)


def part_moe_learner(s: dict, work: Path) -> dict:
    """The MoE's experts alone (grouped against every expert on every token, over one micro-batch's tokens),
    then its train step."""
    from experiments.bench import moe

    cfg = learner_config(s["moe_model"])
    rows, prompt, completion, micro = s["moe_learner"]
    out = {"active_params": moe.active_params(cfg),
           "experts": moe.experts_figures(cfg, rows // micro * (prompt + completion), s["repeats"])}
    partial(out)
    return learner_step(cfg, rows, prompt, completion, micro, s, out)


def learner_step(cfg, rows: int, prompt: int, completion: int, micro: int, s: dict, out: dict | None = None) -> dict:
    """The train step's figures, added to `out` (figures measured before it, kept if it fails)."""
    import jax
    from flax import nnx

    from experiments.bench.learner import compiled_peak_mb
    from jaxrl.learner import Learner
    from jaxrl.models import Decoder
    from jaxrl.optim import OptimizerConfig
    from jaxrl.sharding import MeshConfig, batch_sharding, make_mesh, put_batch
    from jaxrl.train_step import LearnerConfig, jit_train_step

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    lcfg = LearnerConfig(group_size=8 if rows % 8 == 0 else 2, grad_accum=micro,
                         optimizer=OptimizerConfig(learning_rate=1e-6))
    learner = Learner(Decoder(cfg, nnx.Rngs(0)), lcfg, mesh)
    arrays = put_batch(full_batch(rows, prompt, completion, cfg.vocab_size), mesh)
    step = jit_train_step(learner.graphdef, lcfg, learner.tx, learner.shardings,
                          {k: batch_sharding(mesh, v.ndim) for k, v in arrays.items()}, 1, learner.frozen_shardings)
    out = {**(out or {}), "params": num_params(cfg), "rows": rows, "tokens": rows * (prompt + completion),
           "micro_batches": micro}
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        compiled = step.lower(learner.state, arrays, learner.frozen).compile()
        out["compile_s"] = time.perf_counter() - start
        out["xla_peak_gb"] = compiled_peak_mb(compiled) / 1024
        partial(out)
        state = learner.state
        learner.state = None  # donated to the step

        def one():
            nonlocal state
            state, metrics = compiled(state, arrays, learner.frozen)
            jax.block_until_ready(metrics)
        out["step_s"] = median_s(one, s["repeats"])
    out["tokens_per_s"] = out["tokens"] / out["step_s"]
    out["device_peak_gb"] = (device_peak_bytes() or 0) / GB
    return out


def part_torch_learner(s: dict, work: Path) -> dict:
    return torch_step(s["model"], *s["learner"], s)


def part_torch_learner_long(s: dict, work: Path) -> dict:
    return torch_step(s["model"], *s["learner_long"], s)


def part_torch_moe_learner(s: dict, work: Path) -> dict:
    """As torch_learner, and again with bfloat16 weights: transformers' grouped_mm runs the experts in their
    weights' dtype, so under autocast with float32 weights they miss the bfloat16 kernel. `step_s`: the faster."""
    out = {"float32": torch_step(s["moe_model"], *s["moe_learner"], s)}
    partial(out)
    out["bfloat16"] = torch_step(s["moe_model"], *s["moe_learner"], s, weights="bfloat16")
    return {**out, "step_s": min(out["float32"]["step_s"], out["bfloat16"]["step_s"])}


def torch_step(shape: str, rows: int, prompt: int, completion: int, micro: int, s: dict,
               weights: str = "float32") -> dict:
    """The GRPO step in PyTorch, `weights` the parameters' (and AdamW state's) dtype, computing in bfloat16."""
    import numpy as np
    import torch
    import transformers

    from jaxrl.advantages import compute_advantages
    from jaxrl.train_step import LearnerConfig

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = model_config(shape)
    hf = cfg.to_hf()
    hf_cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, weights),
                                                              attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    batch = full_batch(rows, prompt, completion, hf_cfg.vocab_size)
    lcfg = LearnerConfig(group_size=8 if rows % 8 == 0 else 2)
    adv_B, _ = compute_advantages(batch["rewards_BxR"], lcfg.group_size, lcfg.advantages)
    ids = torch.tensor(np.concatenate([batch["prompt_BxP"], batch["completion_BxC"]], 1), device=device)
    adv = torch.tensor(np.asarray(adv_B), device=device)[:, None]
    mb = rows // micro

    def one():
        for m in range(micro):
            rows_m = slice(m * mb, (m + 1) * mb)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                logits = model(input_ids=ids[rows_m], logits_to_keep=completion + 1).logits[:, :-1].float()
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, ids[rows_m, prompt:, None])[..., 0]
            with torch.no_grad():  # the entropy metric, as our step logs it
                (-(logp_all.exp() * logp_all).sum(-1)).mean().item()
            rho = torch.exp(logp - logp.detach())
            a = adv[rows_m]
            pg = -torch.minimum(rho * a, rho.clamp(1 - lcfg.loss.eps_low, 1 + lcfg.loss.eps_high) * a)
            (pg.mean(1).sum() / rows).backward()  # grpo: the mean over sequences of token means
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    step_s = median_s(one, s["repeats"])
    return {"torch": torch.__version__, "model": type(model).__name__, "weights": weights,
            "attention": model.config._attn_implementation,
            "experts": model.config._experts_implementation if cfg.num_experts else None, "rows": rows,
            "tokens": rows * (prompt + completion), "micro_batches": micro, "step_s": step_s,
            "tokens_per_s": rows * (prompt + completion) / step_s,
            "device_peak_gb": torch.cuda.max_memory_allocated() / GB if cuda else 0.0}


def route_recording_ratio(decode: dict) -> float:
    """Decode seconds of the MoE engine recording routes over those without, each round's pair (run back to
    back) a ratio: their median, less swayed by the machine's drifts than a ratio of medians."""
    with_s, without_s = (decode[k]["decode_s_by_round"] for k in ("moe", "moe_without_routes"))
    return statistics.median(a / b for a, b in zip(with_s, without_s))


def decode_floor_s(kv_bytes_per_token: int, slots: int, prompt: int, new: int, copy_bytes_per_s: float,
                   matmul_flops: float, params: int, active: int | None = None) -> float:
    """The least time `slots` sequences of `prompt` + `new` tokens can take: every decode step reads
    every weight once and every live key and value once; the prefill does 2 N FLOPs per token (N: the
    `active` parameters of an MoE, whose decode steps at 64 slots route to nearly every expert)."""
    weight_bytes = 2 * params  # bfloat16
    live = sum(prompt + i for i in range(new))
    decode_bytes = new * weight_bytes + slots * live * kv_bytes_per_token
    return decode_bytes / copy_bytes_per_s + 2 * (active or params) * slots * prompt / matmul_flops


def part_engine(s: dict, work: Path) -> dict:
    import numpy as np

    from bridge.engines.base import SamplingParams
    from bridge.engines.jax_engine import JaxEngine
    from jaxrl.compilation import compiles

    path = model_dir(work, s["model"])
    P, C = s["prompt"], s["new"]
    # As many prefix-cache rows as slots (the default keeps twice as many: 64 GB more at 256 slots).
    engine = JaxEngine(path, max_batch=max(s["slots"]), max_seq_len=P + C, prefix_cache_rows=max(s["slots"]))
    vocab, c = engine.cfg.vocab_size, engine.cfg
    out = {"prompt": P, "new": C, "params": num_params(c),
           "kv_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2}
    for slots in s["slots"]:
        prompts = np.random.default_rng(slots).integers(10, vocab, (slots, P)).tolist()

        def generate(tokens: int):
            params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=slots)
            start = time.perf_counter()
            result = asyncio.run(engine.generate(prompts, params))
            return result, time.perf_counter() - start

        first, compile_wall = generate(C)  # compiles this batch size's programs
        if slots == min(s["slots"]):  # before the timing: the figure a time limit must not cost
            out["agreement"] = agreement(path, prompts, first, P, C)
            partial(out)
        before = compiles()
        result, wall = generate(C)
        produced = sum(len(c.token_ids) for [c] in result)
        assert produced == slots * C, (produced, slots * C)
        out[f"slots_{slots}"] = {"tok_s": produced / wall, "wall_s": wall, "compiles": compiles() - before,
                                 "first_run_s": compile_wall}
        partial(out)
    asyncio.run(engine.close())
    return out


def part_moe_engine(s: dict, work: Path) -> dict:
    """`JaxEngine` on the MoE, recording routes and not (experiments.bench.moe), taking turns."""
    import numpy as np

    from bridge.engines.base import SamplingParams
    from bridge.engines.jax_engine import JaxEngine
    from experiments.bench import moe

    path = model_dir(work, s["moe_model"])
    P, C, slots = s["prompt"], s["moe_new"], s["moe_slots"]

    def engine() -> JaxEngine:  # no prefix cache: every round prefills and decodes the same
        return JaxEngine(path, max_batch=slots, max_seq_len=P + C, prefix_cache_rows=0)

    c = model_config(s["moe_model"])
    out = {"prompt": P, "new": C, "slots": slots, "params": num_params(c), "active_params": moe.active_params(c),
           "kv_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2}
    prompts = np.random.default_rng(slots).integers(10, c.vocab_size, (slots, P)).tolist()
    engines = {"moe": engine(), "moe_without_routes": moe.without_routes(engine())}
    out["decode"] = moe.decode_figures(engines, prompts, SamplingParams(temperature=1.0, max_tokens=C, seed=slots),
                                       s["repeats"])
    return out


def agreement(path: Path, prompts, result, P: int, C: int) -> dict:
    """|engine - learner| logprob of the sampled tokens, the learner's float32 weights computing in
    bfloat16 as a run's do (one program: each costs minutes to compile at 28 layers on a GPU)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.logprobs import completion_logprobs
    from jaxrl.models import load_pretrained

    batch = (np.asarray(prompts, np.int32), np.ones((len(prompts), P), np.int32),
             np.asarray([c.token_ids for [c] in result], np.int32), np.ones((len(prompts), C), np.int32))
    engine_logp = np.asarray([c.logprobs for [c] in result], np.float64)
    out = {}
    for dtype in ("bfloat16",):
        graphdef, state = nnx.split(load_pretrained(path, param_dtype="float32", dtype=dtype))
        logp = jax.jit(lambda state, *arrays: completion_logprobs(nnx.merge(graphdef, state), *arrays)[0])(
            state, *batch)
        diff = np.abs(np.asarray(logp, np.float64) - engine_logp)
        out[f"learner_{dtype}"] = {"mean": float(diff.mean()), "p99": float(np.quantile(diff, 0.99)),
                                   "max": float(diff.max())}
        del state, logp
    return out


def part_hf_generate(s: dict, work: Path) -> dict:
    import numpy as np
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    transformers.utils.logging.disable_progress_bar()
    path = model_dir(work, s["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if cuda else torch.float32, local_files_only=True).to(device).eval()
    P, C = s["prompt"], s["new"]
    out = {"torch": torch.__version__}
    for slots in s["hf_slots"]:
        ids = torch.tensor(np.random.default_rng(slots).integers(10, model.config.vocab_size, (slots, P)), device=device)

        def generate(tokens: int) -> float:
            start = time.perf_counter()
            with torch.no_grad():
                produced = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                          temperature=1.0, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens,
                                          pad_token_id=0)
            if cuda:
                torch.cuda.synchronize()
            assert produced.shape == (slots, P + tokens), produced.shape
            return time.perf_counter() - start

        generate(8)  # allocations, kernels
        wall = generate(C)
        out[f"slots_{slots}"] = {"tok_s": slots * C / wall, "wall_s": wall}
        partial(out)
    return out


def part_sync(s: dict, work: Path) -> dict:
    """Publishes from this process; a JAX engine in a child process (`sync_loader`) loads each version."""
    import jax
    from flax import nnx

    from jaxrl.models import Decoder
    from jaxrl.snapshots import SnapshotWriter

    locations = {"disk": work / "snapshots"}
    shm = Path("/dev/shm")
    out = {}
    for shape in s["sync_models"]:
        path = model_dir(work, shape)
        cfg = model_config(shape, dtype="bfloat16", param_dtype="float32")
        params = nnx.state(Decoder(cfg, nnx.Rngs(1)), nnx.Param)
        snapshot_bytes = 2 * num_params(cfg)
        if shm.is_dir() and shutil.disk_usage(shm).free > 3 * snapshot_bytes:
            locations["shm"] = Path(tempfile.mkdtemp(prefix="jaxrl-gpu-bench-", dir=shm))
        else:
            out[f"{shape}_shm"] = {"skipped": f"/dev/shm has {shutil.disk_usage(shm).free / GB:.1f} GiB free"
                                   if shm.is_dir() else "no /dev/shm"}
        loader = subprocess.Popen([sys.executable, "-m", "experiments.bench.gpu", "--part", "sync_loader",
                                   "--model-dir", str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).parents[2])
        try:
            for where, root in list(locations.items()):
                writer = SnapshotWriter(root / shape, cfg, dtype="bfloat16", keep=2)
                publish_s, load_s = [], []
                for version in range(1, 4):  # the first: compiles the cast, warms the loader
                    params = jax.block_until_ready(jax.tree.map(lambda x: x * 1.001, params))
                    start = time.perf_counter()
                    writer.publish(params, version)
                    publish_s.append(time.perf_counter() - start)
                    loader.stdin.write(f"{root / shape} {version}\n")
                    loader.stdin.flush()
                    reply = loader.stdout.readline()
                    if not reply:
                        raise RuntimeError(f"the loader process ended (exit {loader.wait()})")
                    load_s.append(json.loads(reply)["load_s"])
                writer.close()
                figures = {"publish_s": statistics.median(publish_s[1:]), "load_s": statistics.median(load_s[1:]),
                           "snapshot_gb": snapshot_bytes / GB}
                figures["round_trip_s"] = figures["publish_s"] + figures["load_s"]
                out[f"{shape}_{where}"] = figures
                partial(out)
                shutil.rmtree(root / shape, ignore_errors=True)
        finally:
            loader.stdin.close()
            loader.wait(timeout=60)
        del params
    if "shm" in locations:
        shutil.rmtree(locations["shm"], ignore_errors=True)
    return out


def sync_loader(model_path: str) -> None:
    """The second process of `sync`: an engine on the model; each stdin line `ROOT VERSION` loads that
    snapshot (read, verify, place on the device, swap) and answers its seconds."""
    import jax

    from bridge.engines.jax_engine import JaxEngine

    engine = JaxEngine(model_path, max_batch=1, max_seq_len=64)
    for line in sys.stdin:
        root, version = line.split()
        start = time.perf_counter()
        asyncio.run(engine.load_snapshot(root, int(version)))
        jax.block_until_ready(engine.params)
        print(json.dumps({"load_s": time.perf_counter() - start}), flush=True)


def part_run(s: dict, work: Path) -> dict:
    """`jaxrl train` on the bundled echo environment; stopped (by PID) at the part's deadline."""
    import yaml
    from flax import nnx

    from jaxrl.models import Decoder, save_pretrained
    from jaxrl.tiny import tiny_config
    from jaxrl.tiny_tokenizer import build_tokenizer

    path = work / "run-model"
    tokenizer = build_tokenizer()
    body = {k: v for k, v in SHAPES[s["model"]].items() if k != "vocab_size"}
    cfg = tiny_config("qwen3", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, rope_theta=1e6, dtype="bfloat16", param_dtype="bfloat16",
                      **body)
    save_pretrained(Decoder(cfg, nnx.Rngs(0)), path)
    tokenizer.save_pretrained(path)
    run_dir = work / "run"
    config = {
        "run_dir": str(run_dir), "model": {"dir": str(path)},
        "envs": [{"name": "echo", "bundled": "echo", "max_concurrent_envs": 64}],
        "steps": s["run_steps"], "checkpoint_every": 10,
        "rollout": {"groups_per_step": s["run_groups"], "temperature": 1.0, "max_tokens": 32, "max_total_tokens": 32,
                    "max_prompt_tokens": 64},
        "learner": {"group_size": 8, "loss": {"loss_type": "dapo", "eps_high": 0.28},
                    "optimizer": {"learning_rate": 1e-5}},
        "data": {"task_fields": {"echo": {"reward_mode": "similarity"}}},
        "eval": {"episodes": 8 * s["run_groups"]},
    }
    config_path = work / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # The learner and the bridge share the card: each allocates what it uses instead of 75% up front.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    deadline = float(os.environ["JAXRL_GPU_PART_DEADLINE"])
    log = open(work / "run.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config_path)], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env, cwd=Path(__file__).parents[2], start_new_session=True)
    try:  # stopped in time to report what it did and how far it got
        stdout, _ = proc.communicate(timeout=max(10.0, deadline - time.time() - 20))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            stdout, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, _ = proc.communicate()
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if (
        run_dir / "metrics.jsonl").exists() else []
    out = {"exit": proc.returncode, "wall_s": wall, "steps_logged": len(rows)}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        summary = json.loads(lines[-1])
        out.update({k: summary.get(k) for k in ("steps", "wall_s", "startup", "eval_before", "eval_after")})
    later = rows[1:] or rows
    for key in ("time/step_s", "time/rollout_s", "time/generate_s", "time/env_s", "time/learn_s", "time/sync_s"):
        values = [r[key] for r in later if key in r]
        if values:
            out[key.split("/")[1] + "_median"] = statistics.median(values)
    if proc.returncode != 0:
        log.close()
        for name, path in (("train", work / "run.log"), ("bridge", run_dir / "logs" / "bridge.log")):
            if path.exists():  # into the bench's own log: the work directory is deleted
                print(f"---- {name} log, last 40 lines\n" + "\n".join(path.read_text().splitlines()[-40:]))
                out[f"{name}_log_last"] = path.read_text().strip().splitlines()[-1:]
    return out


def part_lora(s: dict, work: Path) -> dict:
    from experiments.bench import lora

    sizes = ["--tiny", "--rank", "4"] if s["model"] == "tiny" else [
        "--rows", "8", "--prompt-len", "256", "--completion-len", "256", "--decode-rows", "16", "--decode-tokens", "64"]
    return lora.run(lora.parse_args(sizes + ["--repeats", "2", "--dir", str(work)]))


def part_multiturn(s: dict, work: Path) -> dict:
    from experiments.bench import multiturn

    argv = ["--skip-hf", "--repeats", "1"] + (["--tiny"] if s["model"] == "tiny" else
                                              ["--model-dir", str(model_dir(work, s["model"]))])
    figures = multiturn.main(argv)
    return {"ratios": figures["ratios"], **{side: figures[side] for side in ("jax", "ceiling", "jax_batch_sync")}}


# -- the whole run --------------------------------------------------------------------------------


def derived(results: dict) -> dict:
    """MFU, floors and ratios from the parts' raw figures, and each goal met or not."""
    peaks, engine, hf = results.get("peaks", {}), results.get("engine", {}), results.get("hf_generate", {})
    # The floor at the fastest memory rate measured: a slow copy kernel must not flatter the engine.
    flops = peaks.get("matmul_flops")
    copy = max(peaks.get("copy_bytes_per_s", 0), peaks.get("read_bytes_per_s", 0)) or None
    out, goals = {}, {}
    for name in ("learner", "learner_long"):
        ours, torch_side = results.get(name, {}), results.get(f"torch_{name}", {})
        if "tokens_per_s" not in ours:
            continue
        label = f"learner_{ours['rows']}x{ours['tokens'] // ours['rows']}"
        if flops:
            out[f"{label}_mfu"] = 6 * ours["params"] * ours["tokens_per_s"] / flops
        if "step_s" in torch_side:
            out[f"{label}_over_torch"] = torch_side["step_s"] / ours["step_s"]
    if "params" in engine and flops and copy:
        for key, figures in engine.items():
            if key.startswith("slots_") and "wall_s" in figures:
                slots = int(key.split("_")[1])
                floor = decode_floor_s(engine["kv_bytes_per_token"], slots, engine["prompt"], engine["new"], copy,
                                       flops, engine["params"])
                out[f"engine_{slots}_floor_tok_s"] = slots * engine["new"] / floor
                out[f"engine_{slots}_over_floor"] = figures["wall_s"] / floor
                if "tok_s" in hf.get(key, {}):
                    out[f"engine_{slots}_over_hf"] = figures["tok_s"] / hf[key]["tok_s"]

    moe_learner, moe_engine = results.get("moe_learner", {}), results.get("moe_engine", {})
    if "experts" in moe_learner:
        out["moe_grouped_over_dense"] = moe_learner["experts"]["dense_s"] / moe_learner["experts"]["grouped_s"]
    if "tokens_per_s" in moe_learner and flops:
        out["moe_learner_mfu"] = 6 * moe_learner["active_params"] * moe_learner["tokens_per_s"] / flops
    if "step_s" in moe_learner and "step_s" in results.get("torch_moe_learner", {}):
        out["moe_learner_over_torch"] = results["torch_moe_learner"]["step_s"] / moe_learner["step_s"]
    if "decode" in moe_engine:
        out["moe_route_recording_ratio"] = route_recording_ratio(moe_engine["decode"])
        if flops and copy:
            e, d = moe_engine, moe_engine["decode"]["moe"]
            floor = decode_floor_s(e["kv_bytes_per_token"], e["slots"], e["prompt"], e["new"], copy, flops,
                                   e["params"], e["active_params"])
            out["moe_engine_over_floor"] = d["tokens"] / d["tok_s"] / floor

    def goal(name: str, suffix: str, worst, bound: float, at_least: bool) -> None:
        values = [v for k, v in out.items() if k.startswith(name) and k.endswith(suffix)]
        if values:
            figure = worst(values)
            goals[f"{name}{suffix}"] = {"figure": figure, "goal": f"{'>=' if at_least else '<='} {bound}",
                                        "met": figure >= bound if at_least else figure <= bound}

    goal("learner", "_mfu", min, GOALS["learner_mfu"], True)
    goal("learner", "_over_torch", min, GOALS["learner_over_torch"], True)
    goal("engine", "_over_floor", max, GOALS["engine_over_floor_max"], False)
    goal("engine", "_over_hf", min, GOALS["engine_over_hf"], True)
    goal("moe_learner", "_mfu", min, GOALS["moe_learner_mfu"], True)
    goal("moe_learner", "_over_torch", min, GOALS["moe_learner_over_torch"], True)
    goal("moe_route_recording", "_ratio", max, GOALS["moe_route_recording_ratio_max"], False)
    trips = [v["round_trip_s"] for k, v in results.get("sync", {}).items()
             if k.startswith(("0.6b", "tiny")) and isinstance(v, dict) and "round_trip_s" in v]
    if trips:
        goals["sync_0.6b_s"] = {"figure": max(trips), "goal": f"<= {GOALS['sync_0.6b_s_max']}",
                                "met": max(trips) <= GOALS["sync_0.6b_s_max"]}
    run = results.get("run", {})
    if "exit" in run:
        goals["run_finishes"] = {"figure": run.get("steps"), "met": run["exit"] == 0}
    return {"goals": goals, "derived": out}


def part_env(name: str, timeout: float) -> dict:
    """The environment of a part's process."""
    env = {**os.environ, "JAXRL_GPU_PART_DEADLINE": str(time.time() + timeout)}
    if name.startswith(("torch", "hf")):
        env["JAX_PLATFORMS"] = "cpu"  # JAX would take most of the card before torch asks for any
    elif name in ("sync", "run", "lora"):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # several JAX processes share the card
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    return env


def run_part(name: str, tiny: bool, work: Path, timeout: float, log) -> dict:
    """Part `name` in a process of its own: its figures, or its error and the figures it had."""
    cmd = [sys.executable, "-m", "experiments.bench.gpu", "--part", name, "--work", str(work)] + ["--tiny"] * tiny
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=part_env(name, timeout), cwd=Path(__file__).parents[2], start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        output += f"\nstopped after its {timeout:.0f} s"
    part_s = round(time.perf_counter() - start, 1)
    log.write(f"==== {name} ({part_s} s, exit {proc.returncode})\n{output}\n")
    log.flush()
    lines = [line for line in output.splitlines() if line.strip()]
    if proc.returncode == 0 and lines and lines[-1].startswith("{"):
        return {**json.loads(lines[-1]), "part_s": part_s}
    partials = [line[len(PARTIAL):] for line in lines if line.startswith(PARTIAL)]
    return {**(json.loads(partials[-1]) if partials else {}), "error": " | ".join(lines[-3:])[-600:], "part_s": part_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"comma-separated parts, run in that order, of: {', '.join(PARTS)}")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all parts together")
    p.add_argument("--out", help="directory for gpu.json and gpu.log")
    p.add_argument("--tiny", action="store_true", help="toy sizes on any backend (the CI check)")
    p.add_argument("--cap", action="append", default=[], metavar="PART=SECONDS",
                   help="another time cap for a part (repeatable), e.g. run=300")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    if args.part == "sync_loader":
        return sync_loader(args.model_dir)
    if args.part:
        figures = globals()[f"part_{args.part}"](sizes, Path(args.work))
        print(json.dumps(figures), flush=True)
        return figures

    parts = [part.strip() for part in args.only.split(",") if part.strip()]
    caps = dict(BUDGETS)
    for cap in args.cap:
        part, _, seconds = cap.partition("=")
        if part not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--cap {cap!r}: give PART=SECONDS with a part of: {', '.join(PARTS)}")
        caps[part] = float(seconds)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {unknown}; parts: {', '.join(PARTS)}")
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    end = time.time() + args.budget_s
    results: dict = {}
    work = Path(tempfile.mkdtemp(prefix="jaxrl-gpu-bench-"))
    log = open(out_dir / "gpu.log", "w") if out_dir else open(os.devnull, "w")
    try:
        for name in parts:  # in the order given: --only is also the priority
            left = end - time.time()
            if left < 20:
                results[name] = {"skipped": "out of time (--budget-s)"}
                continue
            results[name] = run_part(name, args.tiny, work, min(caps[name], left), log)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
            if out_dir:
                (out_dir / "gpu.json").write_text(json.dumps({**derived(results), **results}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        log.close()
    figures = {**derived(results), **results}
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    main()
