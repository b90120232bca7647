"""Generation throughput of each engine on one tiny model, and what the gRPC bridge costs.

    python -m experiments.bench.engines [--sequences 64] [--new-tokens 128] [--hidden 128 --layers 4 ...] [--tiny]

Same model, prompts and sampling (temperature 1, no stop, every sequence runs to
`--new-tokens`) for: the JAX engine in-process, the JAX engine behind a real bridge process
(`bridge_over_inproc` = bridge tokens/s / in-process tokens/s), transformers' `generate`, and
vLLM's CPU build when it is importable (run from `.venv-vllm` for that figure; otherwise null).
Each figure is the median of `--repeats` timed runs after the engines' warm-up and one warm-up run;
in-process and bridge runs alternate. `jax_over_floor`: the in-process figure over the machine's
floor (`experiments.bench.roofline`, measured in the same run) for a decode step of all the
sequences at their mean context (prompt and half the new tokens): 1 would be the machine's limit.
The last line is one JSON object.
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
import numpy as np

from bridge.engines.base import SamplingParams
from bridge.engines.jax_engine import JaxEngine
from experiments.bench.roofline import decode_floor, memory_bandwidth
from jaxrl.host_memory import restart_tuned
from jaxrl.tiny import build_tiny_model
from jaxrl.tiny_tokenizer import build_tokenizer


def _tok_s(run, tokens_per_run: int) -> float:
    start = time.perf_counter()
    produced = run()
    elapsed = time.perf_counter() - start
    assert produced == tokens_per_run, f"expected {tokens_per_run} tokens, got {produced}"
    return tokens_per_run / elapsed


def _median_tok_s(run, tokens_per_run: int, repeats: int) -> float:
    run()  # warm-up: compilation and caches
    return statistics.median(_tok_s(run, tokens_per_run) for _ in range(repeats))


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, rng.integers(8, 33)).tolist() for _ in range(n)]


def jax_inproc_and_bridge(model_dir, prompts, params, repeats, max_batch):
    """Medians of in-process and bridge runs, alternated so machine noise hits both alike."""
    from jaxrl.run.api import BridgeClient, BridgeLaunch, BridgeProcess

    # Every program compiled up front, as the bridge's engine is: one warm-up run does not reach them all
    # (a second run's prefix-cache hits and longer rows pick other cache widths).
    # Sequences as long as the longest prompt and its new tokens, as a run sizes its bridge's engine
    # (rollout.max_prompt_tokens + max_total_tokens), not the engine's default of 2,048.
    max_seq_len = max(map(len, prompts)) + params.max_tokens
    engine = JaxEngine(model_dir, max_batch=max_batch, max_seq_len=max_seq_len, warm_up=True)
    tokens = len(prompts) * params.max_tokens
    bandwidth = memory_bandwidth()

    def inproc():
        out = asyncio.run(engine.generate(prompts, params))
        return sum(len(c.token_ids) for group in out for c in group)

    with BridgeProcess.start(BridgeLaunch(model_dir, engine="jax", max_batch=max_batch,
                                                  engine_kwargs={"max_seq_len": max_seq_len})) as proc:
        client = BridgeClient(proc.address, timeout_s=600, token=proc.token)

        def bridged():
            return sum(len(t.completion_ids) for t in client.rollout(prompts, 1, params))

        inproc(), bridged()  # warm-up: compilation on both sides
        pairs = [(_tok_s(inproc, tokens), _tok_s(bridged, tokens)) for _ in range(repeats)]
    context = round(statistics.mean(map(len, prompts)) + params.max_tokens / 2)
    floor = decode_floor(engine.cfg, len(prompts), context, max(bandwidth, memory_bandwidth()),
                         sum(x.size for x in jax.tree.leaves(engine.params)))
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs), floor


def hf_generate(model_dir, prompts, params, repeats):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def run():
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature,
                top_k=0, max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens,
                pad_token_id=0,
            )
        return int(out[:, width:].numel())

    return _median_tok_s(run, len(prompts) * params.max_tokens, repeats)


def vllm_cpu(model_dir, prompts, params, repeats):
    try:
        import vllm  # noqa: F401

        from bridge.engines.vllm_engine import CPU_ENGINE_KWARGS, VLLMEngine
    except ImportError as e:
        return None, f"vllm not importable here ({e}); run from .venv-vllm"
    # In-process, eager, float32, a small KV cache: the CPU build's settings (FACTS.md).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMEngine(model_dir, engine_kwargs={**CPU_ENGINE_KWARGS, "max_num_seqs": len(prompts)})
    try:
        def run():
            out = asyncio.run(engine.generate(prompts, params))
            return sum(len(c.token_ids) for group in out for c in group)

        return _median_tok_s(run, len(prompts) * params.max_tokens, repeats), None
    finally:
        asyncio.run(engine.close())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--hidden", type=int, default=128, help="vs_trl's model: hidden 128, 4 layers, mlp 256, "
                        "vocab 1000 (0.72M parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--tiny", action="store_true", help="a few sequences and tokens, for CI")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.sequences, args.new_tokens, args.repeats = 4, 8, 1
        args.hidden, args.layers, args.intermediate, args.vocab = 64, 2, 128, 512

    # No stop tokens and no min_tokens games: every sequence produces exactly new_tokens.
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", args.family, tokenizer=build_tokenizer(vocab_size=args.vocab),
                                     hidden_size=args.hidden, num_layers=args.layers,
                                     intermediate_size=args.intermediate)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = random_prompts(args.sequences, vocab)
        figures = {"sequences": args.sequences, "new_tokens": args.new_tokens}
        inproc, bridged, floor = jax_inproc_and_bridge(model_dir, prompts, params, args.repeats, args.sequences)
        figures["jax_tok_s"], figures["jax_bridge_tok_s"] = inproc, bridged
        figures["bridge_over_inproc"] = bridged / inproc
        figures["floor"] = floor.figures()
        figures["jax_over_floor"] = inproc / floor.tok_s
        figures["hf_generate_tok_s"] = None if args.skip_hf else hf_generate(model_dir, prompts, params, args.repeats)
        figures["vllm_cpu_tok_s"], why = vllm_cpu(model_dir, prompts, params, args.repeats)
        if why:
            figures["vllm_note"] = why

    for key, value in figures.items():
        print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    restart_tuned()  # malloc as `jaxrl train` and the bridge run it (jaxrl.host_memory)
    main()
