"""Mixture of experts: the learner's step against PyTorch's Qwen3-MoE, the grouped matmul against the dense
way, the JAX engine's MoE decode against a dense model of the same active parameters, and what recording
routes costs.

    python -m experiments.bench.moe [--tiny] [--experts 16 --top-k 2 --hidden 256 --moe-intermediate 256 ...]

Ratios (first in the last line's JSON object):
  learner_over_torch       seconds of transformers' `Qwen3MoeForCausalLM` step (PyTorch, its default attention and
                           experts implementations) over ours, medians: above 1 = ours is faster. The GRPO step of
                           experiments.bench.learner (forward, clipped loss, entropy metric, backward, clipping,
                           AdamW) on the same weights (ours, saved and loaded by transformers) and batch, interleaved,
                           with as many threads, in one process under `jaxrl train`'s malloc settings; the batch
                           carries no recorded routes, so each side's routers choose.
  grouped_over_dense       one MoE layer's experts over the learner batch's tokens, forward and backward: seconds of
                           every expert on every token (`moe.every_expert_forward`) over the grouped path's
                           (`moe.experts_forward`)
  grouped_over_ragged_dot  the same layer's token-expert pairs, sorted by expert, through their experts forward and
                           backward: seconds of `moe.ragged_experts` (two `jax.lax.ragged_dot`s, which XLA:CPU lowers
                           to products with every expert) over the CPU's `moe.blocked_experts`
  moe_decode_over_dense    the engine's decode tokens/s on the MoE over those on a dense model of the same active
                           parameters (hidden size, layers and attention the same; an MLP of width top_k x
                           moe_intermediate_size), the same prompts, sampling and lengths
  route_recording_ratio    the MoE engine's decode seconds recording every token's route (its cache's route buffer,
                           read back as rows end) over the same engine's without the buffer in the same round, the
                           median over rounds (target: under 1.05)
Then each part's work and figures: tokens and FLOPs, each side's rate against this machine's matmul rate (XLA's
float32 dot at the step's shapes, measured in the same run), each engine against its decode floor
(experiments.bench.roofline). Decode figures: tokens over the engine's decode calls' device time (inserts and
the host's scheduling left out), medians of `--repeats` rounds of the engines in turn after one warm-up round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.engines.base import SamplingParams
from bridge.engines.jax_engine import JaxEngine
from bridge.engines.slots import Slots
from experiments.bench.engines import random_prompts
from experiments.bench.gpu import median_s, num_params, route_recording_ratio
from experiments.bench.learner import TorchStep, cpu_model, cpu_vector_units, interleaved_steps, make_batch
from experiments.bench.roofline import decode_floor, matmul_s, memory_bandwidth
from jaxrl.compilation import compiles
from jaxrl.host_memory import restart_tuned
from jaxrl.learner import Learner
from jaxrl.models import Decoder, ModelConfig, moe, save_pretrained
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig

# Sizes for a 2-core CPU (a few minutes in all); --tiny keeps CI to seconds.
DEFAULTS = dict(batch=8, prompt_len=64, completion_len=192, steps=5, vocab=8192, hidden=256, layers=4, experts=16,
                top_k=2, moe_intermediate=256, group_size=4, logp_chunk=64, sequences=16, new_tokens=64, repeats=9)
TINY = dict(batch=4, prompt_len=8, completion_len=32, steps=2, vocab=512, hidden=64, layers=2, experts=4, top_k=2,
            moe_intermediate=32, group_size=2, logp_chunk=8, sequences=4, new_tokens=8, repeats=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="shrink every size (CI smoke run)")
    for key in DEFAULTS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"default {DEFAULTS[key]} (--tiny: {TINY[key]})")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def moe_config(args) -> ModelConfig:
    """A Qwen3-MoE with every layer's MLP a mixture; attention as experiments.bench.learner's (heads of 32, two
    query heads per KV head)."""
    heads = max(args.hidden // 32, 1)
    return tiny_config("qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=heads, num_kv_heads=max(heads // 2, 1), head_dim=32, num_experts=args.experts,
                       num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate)


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """The dense Qwen3 with `cfg`'s active parameters (every layer of `cfg` a mixture): its attention, and an MLP
    as wide as a token's experts together, top_k x moe_intermediate_size."""
    return cfg.replace(model_type="qwen3", intermediate_size=cfg.num_experts_per_tok * cfg.moe_intermediate_size,
                       num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, mlp_only_layers=(),
                       norm_topk_prob=False)


def active_params(cfg: ModelConfig) -> int:
    """Parameters a token's forward pass uses: all but the experts it is not routed to (the embedding once)."""
    idle = cfg.num_experts - cfg.num_experts_per_tok
    return num_params(cfg) - len(cfg.moe_layers) * idle * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def step_flops(cfg: ModelConfig, rows: int, slots: int, completion: int) -> int:
    """Matmul FLOPs of one train step over `rows` x `slots` token slots (padding included: both sides compute
    it), the output head on the `completion` slots only: the forward's (2 per multiply-add; causal attention
    half its square; an MoE layer's router and its top-k experts) times 3 for forward and backward."""
    D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = D * (N * H + 2 * K * H) + N * H * D
    mlp = {True: D * cfg.num_experts + 3 * D * cfg.num_experts_per_tok * cfg.moe_intermediate_size,
           False: 3 * D * cfg.intermediate_size}
    per_token = sum(attention + mlp[cfg.is_moe(i)] for i in range(cfg.num_layers))
    scores = cfg.num_layers * 2 * N * H * slots * slots  # q.k and p.v: 2 x (slots^2 / 2) x N x H each
    forward = 2 * rows * (slots * per_token + completion * D * cfg.vocab_size) + 2 * rows * scores
    return 3 * forward


def experts_figures(cfg: ModelConfig, tokens: int, repeats: int, seed: int = 0) -> dict:
    """One MoE layer of `cfg` over `tokens` tokens routed by a random router, forward and backward (the gradients
    of the tokens, their routing weights and the experts): the grouped path (`moe.experts_forward`) and every
    expert on every token; on the CPU also the token-expert pairs sorted by expert through the CPU's
    `moe.blocked_experts` and through `moe.ragged_experts` (`jax.lax.ragged_dot`, the other platforms' path).
    Median seconds and the FLOPs each executes (padding rows and unrouted experts included)."""
    rng = np.random.default_rng(seed)
    D, E, k, I = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, cfg.jnp_dtype)

    x_NxD = normal((tokens, D))
    gate_up_ExDxG, down_ExIxD = normal((E, D, 2 * I), D ** -0.5), normal((E, I, D), I ** -0.5)
    experts_NxK, weights_NxK, _ = moe.route(normal((tokens, E)), k, "softmax", cfg.norm_topk_prob)

    def seconds(f, *args, fixed=()):
        """Median seconds of the gradient of sum(f(*args, *fixed)^2) with respect to `args`."""
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32))), tuple(range(len(args)))))
        return median_s(lambda: jax.block_until_ready(grad(*args, *fixed)), repeats)

    A = tokens * k
    per_row = 2 * (D * 2 * I + I * D)  # the two grouped matmuls' forward FLOPs per token-expert pair
    flat_A = np.asarray(experts_NxK).reshape(-1)
    order_A = np.argsort(flat_A, kind="stable")
    sizes_E = np.bincount(flat_A, minlength=E)
    cpu = jax.default_backend() == "cpu"
    b = moe.blocks(A, E)[1]
    out = {"tokens": tokens, "pairs": A,
           "grouped_s": seconds(lambda x, w, gu, d, e: moe.experts_forward(x, e, w, gu, d, moe.silu_glu),
                                x_NxD, weights_NxK, gate_up_ExDxG, down_ExIxD, fixed=(experts_NxK,)),
           "dense_s": seconds(lambda x, w, gu, d, e: moe.every_expert_forward(x, e, w, gu, d, moe.silu_glu),
                              x_NxD, weights_NxK, gate_up_ExDxG, down_ExIxD, fixed=(experts_NxK,)),
           # The CPU's blocks: each expert's rows padded to whole blocks of b.
           "grouped_flops": 3 * per_row * (int(np.sum(-(-sizes_E // b) * b)) if cpu else A),
           "dense_flops": 3 * per_row * tokens * E}
    if cpu:
        pairs = tuple(jnp.asarray(a, jnp.int32) for a in (order_A // k, flat_A[order_A], sizes_E))

        def sorted_pairs(path):
            return seconds(lambda x, w, gu, d, token, expert, sizes: path(x, token, expert, w, sizes,
                                                                         (gu, d, None, None), moe.silu_glu),
                           x_NxD, weights_NxK.reshape(-1)[order_A], gate_up_ExDxG, down_ExIxD, fixed=pairs)

        out.update(blocked_s=sorted_pairs(moe.blocked_experts), ragged_dot_s=sorted_pairs(moe.ragged_experts),
                   blocked_flops=out["grouped_flops"], ragged_dot_flops=3 * per_row * A * E)
    return out


class _SlotsWithoutRoutes(Slots):
    """The engine's slots with no route buffer in their caches: the same programs without the recording (a dense
    model's caches have none), so that the difference in decode time is what recording costs."""

    def reset(self) -> None:
        super().reset()
        self.state = self.state._replace(cache=self.state.cache._replace(routes_BxSxU=None))
        self.pool = self.pool._replace(routes_BxSxU=None)


def without_routes(engine: JaxEngine) -> JaxEngine:
    """`engine` (not yet used) recording no routes: measured here rather than switched in the engine."""
    engine.slots = _SlotsWithoutRoutes(engine.cfg, engine.shapes, engine.slots.pool_rows)
    engine.prefix = engine.slots.prefix
    return engine


def decode_figures(engines: dict[str, JaxEngine], prompts: list[list[int]], params: SamplingParams,
                   repeats: int) -> dict:
    """Each engine generating every prompt to `params.max_tokens`: one warm-up round, then `repeats` rounds of
    the engines in turn. Per engine: tokens, median wall and decode tokens/s (decode: its decode calls' device
    time, inserts left out), completions carrying routes; and the programs compiled while timed (0 expected)."""

    def run(engine: JaxEngine):
        device, insert = engine.stats["device_s"], engine.stats["insert_s"]
        start = time.perf_counter()
        out = asyncio.run(engine.generate(prompts, params))
        wall = time.perf_counter() - start
        return out, wall, (engine.stats["device_s"] - device) - (engine.stats["insert_s"] - insert)

    for engine in engines.values():
        run(engine)
    before = compiles()
    runs = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runs[name].append(run(engine))
    figures = {"compiles_while_timed": compiles() - before}
    for name, done in runs.items():
        completions = [c for group in done[-1][0] for c in group]
        tokens = sum(len(c.token_ids) for c in completions)
        assert tokens == len(prompts) * params.max_tokens, (name, tokens)
        figures[name] = {"tokens": tokens, "tok_s": tokens / statistics.median(d[1] for d in done),
                         "decode_tok_s": tokens / statistics.median(d[2] for d in done),
                         "decode_s_by_round": [d[2] for d in done],
                         "routed_completions": sum(c.routes is not None for c in completions)}
    return figures


def learner_figures(args, cfg: ModelConfig) -> dict:
    """Our step and PyTorch's on the same weights and batch (experiments.bench.learner's)."""
    lcfg = LearnerConfig(group_size=args.group_size, logp_chunk=args.logp_chunk)
    batch = make_batch(args, cfg.vocab_size)
    model = Decoder(cfg, nnx.Rngs(0))
    torch_step = TorchStep(model, batch, lcfg)  # copies the weights before the learner moves them
    timed = interleaved_steps(Learner(model, lcfg, make_mesh(MeshConfig())), torch_step, batch, args.steps)
    jax_s, torch_s = statistics.median(timed["jax_s"]), statistics.median(timed["torch_s"])
    flops = step_flops(cfg, args.batch, args.prompt_len + args.completion_len, args.completion_len)
    hf = torch_step.model.config
    return {"jax_step_s": jax_s, "torch_step_s": torch_s,
            "tokens": int(batch["prompt_mask_BxP"].sum() + batch["completion_mask_BxC"].sum()),
            "slots": args.batch * (args.prompt_len + args.completion_len), "flops_per_step": flops,
            "jax_gflop_s": flops / jax_s / 1e9, "torch_gflop_s": flops / torch_s / 1e9,
            "grad_norm_rel_diff": abs(timed["jax_norm"] - timed["torch_norm"]) / timed["torch_norm"],
            "jax_step_s_by_step": timed["jax_s"], "torch_step_s_by_step": timed["torch_s"],
            "jax_page_faults_warmup": timed["warmup_faults"],
            "torch_experts": hf._experts_implementation, "torch_attention": hf._attn_implementation}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    # XLA's CPU client runs one intra-op thread per core it may use; torch gets as many.
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    cfg = moe_config(args)
    dense = dense_twin(cfg)
    learner = learner_figures(args, cfg)
    slots = learner["slots"]
    # This machine's matmul rate: the better of XLA's float32 dot at the step's MLP and output-head shapes.
    shapes = [(slots, args.hidden, args.top_k * args.moe_intermediate),
              (args.batch * args.completion_len, args.hidden, args.vocab)]
    matmul_flop_s = max(2 * m * k * n / matmul_s(m, k, n, repeats=3, inner=2) for m, k, n in shapes)
    learner["jax_over_matmul_rate"] = learner["jax_gflop_s"] * 1e9 / matmul_flop_s
    learner["torch_over_matmul_rate"] = learner["torch_gflop_s"] * 1e9 / matmul_flop_s
    experts = experts_figures(cfg, slots, max(args.repeats, 3))

    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=0)
    prompts = random_prompts(args.sequences, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, c in (("moe", cfg), ("dense", dense)):
            dirs[name] = Path(tmp) / name
            save_pretrained(Decoder(c, nnx.Rngs(0)), dirs[name])

        # No prefix cache: every round prefills and decodes the same, and one warm-up round compiles it all.
        def engine(name: str) -> JaxEngine:
            return JaxEngine(dirs[name], max_batch=args.sequences, prefix_cache_rows=0,
                             max_seq_len=max(map(len, prompts)) + args.new_tokens)

        engines = {"moe": engine("moe"), "moe_without_routes": without_routes(engine("moe")), "dense": engine("dense")}
        decode = decode_figures(engines, prompts, params, args.repeats)
    bandwidth = memory_bandwidth()
    context = round(statistics.mean(map(len, prompts)) + args.new_tokens / 2)
    floors = {name: decode_floor(engines[name].cfg, len(prompts), context, bandwidth,
                                 sum(x.size for x in jax.tree.leaves(engines[name].params))) for name in dirs}
    for name in engines:
        floor = floors["dense" if name == "dense" else "moe"]
        decode[name]["floor"] = floor.figures()
        decode[name]["over_floor"] = decode[name]["decode_tok_s"] / floor.tok_s

    figures = {
        "learner_over_torch": learner["torch_step_s"] / learner["jax_step_s"],
        "grouped_over_dense": experts["dense_s"] / experts["grouped_s"],
        "grouped_over_ragged_dot": experts["ragged_dot_s"] / experts["blocked_s"],
        "moe_decode_over_dense": decode["moe"]["decode_tok_s"] / decode["dense"]["decode_tok_s"],
        "route_recording_ratio": route_recording_ratio(decode),
        "model": {"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "layers": args.layers,
                  "moe_intermediate": args.moe_intermediate, "vocab": args.vocab, "params": num_params(cfg),
                  "active_params": active_params(cfg), "dense_twin_params": num_params(dense)},
        # The machine's 1-minute load average before and after (this run's own threads count in the second):
        # PyTorch's threads wait on each other, so a busy machine flatters the ratio to PyTorch.
        "machine": {"load_average": [load_before, os.getloadavg()[0]], "matmul_gflop_s": matmul_flop_s / 1e9,
                    "bandwidth_gb_s": bandwidth / 1e9, "threads": threads,
                    "cpu": cpu_model(), "cpu_vector_units": cpu_vector_units(), "backend": jax.default_backend()},
        "learner": learner, "experts": experts, "decode": decode,
    }
    print(f"moe benchmark: {args.experts} experts, top {args.top_k}, expert width {args.moe_intermediate}, hidden "
          f"{args.hidden}, {args.layers} layers, vocab {args.vocab} ({figures['model']['params']:,} parameters, "
          f"{figures['model']['active_params']:,} active); learner batch {args.batch} x (prompt {args.prompt_len} + "
          f"completion {args.completion_len}), median of {args.steps} steps; decode {args.sequences} x "
          f"{args.new_tokens} tokens, median of {args.repeats}; {jax.default_backend()}, {threads} threads")
    print(f"  matmul rate {matmul_flop_s / 1e9:.1f} GFLOP/s, memory {bandwidth / 1e9:.1f} GB/s, load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"  learner: {learner['tokens']} tokens ({learner['slots']} slots), {learner['flops_per_step'] / 1e9:.2f} "
          f"GFLOP a step each side; ours {learner['jax_step_s']:.3f} s ({learner['jax_gflop_s']:.1f} GFLOP/s), "
          f"PyTorch {learner['torch_step_s']:.3f} s ({learner['torch_gflop_s']:.1f} GFLOP/s, experts "
          f"{learner['torch_experts']}, attention {learner['torch_attention']})")
    print(f"  experts, {experts['tokens']} tokens: grouped {experts['grouped_s'] * 1e3:.1f} ms "
          f"({experts['grouped_flops'] / 1e9:.2f} GFLOP), every expert {experts['dense_s'] * 1e3:.1f} ms "
          f"({experts['dense_flops'] / 1e9:.2f} GFLOP); sorted pairs: blocks {experts['blocked_s'] * 1e3:.1f} ms, "
          f"ragged_dot {experts['ragged_dot_s'] * 1e3:.1f} ms ({experts['ragged_dot_flops'] / 1e9:.2f} GFLOP)")
    for name in engines:
        d = decode[name]
        print(f"  decode {name}: {d['tokens']} tokens, {d['decode_tok_s']:.0f} tok/s decoding ({d['tok_s']:.0f} "
              f"wall), {d['over_floor']:.2f} of its floor ({d['floor']['tok_s']:.0f}, {d['floor']['bound']}-bound), "
              f"{d['routed_completions']} completions with routes")
    for key in ("learner_over_torch", "grouped_over_dense", "grouped_over_ragged_dot", "moe_decode_over_dense",
                "route_recording_ratio"):
        print(f"  {key:<26} {figures[key]:.3f}")
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    restart_tuned()  # malloc as `jaxrl train` and the bridge run it (jaxrl.host_memory)
    main()
