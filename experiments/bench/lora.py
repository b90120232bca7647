"""LoRA against full fine-tuning: learner memory, snapshot bytes, publish + bridge load time.

    python -m experiments.bench.lora [--layers 28] [--rank 16] [--repeats 3] [--tiny] [--dir DIR]

The model is Qwen3-0.6B-shaped (vocab 151,936, width 1,024, MLP 3,072, 16 query / 8 KV heads of
128, tied embeddings, q/k norms; --layers of them, 28 as the real one), float32, random: nothing is
downloaded or trained. LoRA is rank --rank, alpha 2 x rank, on all seven projections. Full fine-tuning,
the baseline, runs in the same invocation on the same model and batch.

  learner memory   each learner in a process of its own (peak RSS only grows): the model built on
                   the device, the Learner (full: params + AdamW moments; LoRA: the frozen base +
                   adapters and theirs), and one train step of --rows sequences (--prompt-len +
                   --completion-len tokens). `*_peak_rss_mb` is the process's peak resident memory
                   (the runtime included); `*_xla_peak_mb` XLA's plan for the step (arguments,
                   outputs and scratch, less donated buffers).
  snapshot bytes   the files of one published snapshot: every weight in the serving dtype
                   (float32, as the run serves this model) against the adapters alone.
  publish + load   `SnapshotWriter.publish` until committed, then the JAX engine's
                   `load_snapshot` (what the bridge's LoadSnapshot runs: read, verify, place, swap)
                   on an engine serving the same model (and for LoRA, adapters of that shape), each
                   in a process of its own; medians of --repeats versions.
  merged vs unmerged  (the JAX engine applies adapters unmerged) `merge_s`: writing W + s B A
                   into a kept copy of the base's targeted weights, as a merging engine would per
                   version; `decode_unmerged_over_plain`: the engine's generation time with the
                   adapters unmerged over the plain model's (--decode-rows rows of --decode-tokens
                   tokens, medians of --repeats, after a compiling run).

Last line: one JSON object, ratios first (LoRA over full: `learner_peak_rss_ratio`,
`snapshot_bytes_ratio`, `publish_load_time_ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MB = 1 << 20
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                 head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 28, Qwen3-0.6B's)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=2, help="sequences in the measured train step (a group of 2)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--decode-rows", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None, help="versions published and loaded (default 3)")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CI smoke run)")
    p.add_argument("--dir", default=None, help="where to write the model and snapshots (default: a temporary one)")
    p.add_argument("--part", choices=["learner", "sync"], help=argparse.SUPPRESS)  # a child's own measurement
    p.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 28)
    args.repeats = args.repeats or (2 if args.tiny else 3)
    return args


def model_config(args):
    from jaxrl.models import ModelConfig

    return ModelConfig(model_type="qwen3", num_layers=args.layers, qk_norm=True, tie_word_embeddings=True,
                       max_position_embeddings=4096, **(TINY if args.tiny else QWEN3_06B))


def lora_config(args):
    from jaxrl.models.lora import LoraConfig

    return LoraConfig(rank=args.rank, alpha=2.0 * args.rank)


def learner_part(args) -> dict:
    """One learner (full or LoRA) and one train step, in this process: its peak memory."""
    import jax
    from flax import nnx

    from experiments.bench.learner import compiled_peak_mb
    from jaxrl.learner import Learner
    from jaxrl.losses import LossConfig
    from jaxrl.models import Decoder
    from jaxrl.optim import OptimizerConfig
    from jaxrl.sharding import MeshConfig, batch_sharding, make_mesh, put_batch
    from jaxrl.train_step import LearnerConfig, jit_train_step

    cfg = LearnerConfig(group_size=2, loss=LossConfig(loss_type="dapo"), optimizer=OptimizerConfig(learning_rate=1e-5),
                        lora=lora_config(args) if args.lora else None)
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    learner = Learner(Decoder(model_config(args), nnx.Rngs(0)), cfg, mesh)
    rng = np.random.default_rng(0)
    B, P, C = args.rows, args.prompt_len, args.completion_len
    vocab = model_config(args).vocab_size
    batch = {"prompt_BxP": rng.integers(0, vocab, (B, P)).astype(np.int32), "prompt_mask_BxP": np.ones((B, P), np.int32),
             "completion_BxC": rng.integers(0, vocab, (B, C)).astype(np.int32),
             "completion_mask_BxC": np.ones((B, C), np.int32), "loss_mask_BxC": np.ones((B, C), np.int32),
             "rewards_BxR": np.arange(B, dtype=np.float32)[:, None]}
    arrays = put_batch(batch, mesh)
    step_fn = jit_train_step(learner.graphdef, cfg, learner.tx, learner.shardings,
                             {k: batch_sharding(mesh, v.ndim) for k, v in arrays.items()}, 1, learner.frozen_shardings)
    with jax.set_mesh(mesh):
        xla_peak = compiled_peak_mb(step_fn.lower(learner.state, arrays, learner.frozen).compile())
    start = time.perf_counter()
    learner.update(batch)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "xla_peak_mb": xla_peak,
            "first_step_s": time.perf_counter() - start,  # compiles the step too
            "trained_params": sum(x.size for x in jax.tree.leaves(learner.state.params))}


def sync_part(args) -> dict:
    """Publish + engine load of --repeats versions (full or LoRA) on the model in --model-dir; for
    LoRA also the merge a merging engine would do and generation unmerged against plain."""
    import jax
    from flax import nnx

    from bridge.engines.jax_engine import JaxEngine
    from jaxrl.models import load_pretrained
    from jaxrl.models.lora import adapter_config, add_lora
    from jaxrl.snapshots import SnapshotWriter

    lora = lora_config(args) if args.lora else None
    engine = JaxEngine(args.model_dir, max_batch=args.decode_rows, max_seq_len=128,
                       lora=None if lora is None else adapter_config(lora))
    model = load_pretrained(args.model_dir)
    if lora is None:
        params = nnx.state(model, nnx.Param)
    else:
        params = nnx.state(add_lora(model, lora), nnx.LoRAParam)
    root = Path(tempfile.mkdtemp(prefix="snapshots-", dir=Path(args.model_dir).parent))
    writer = SnapshotWriter(root, model.cfg, keep=args.repeats + 1, lora=lora)
    publish_s, load_s = [], []
    for version in range(1, args.repeats + 1):
        params = jax.tree.map(lambda x: x * 1.01, params)  # new weights each version
        start = time.perf_counter()
        writer.publish(params, version)
        publish_s.append(time.perf_counter() - start)
        load_s.append(asyncio.run(engine.load_snapshot(str(root), version)))
    writer.close()
    snapshot_bytes = sum(f.stat().st_size for f in (root / "1").rglob("*") if f.is_file())
    out = {"publish_s": statistics.median(publish_s), "load_s": statistics.median(load_s),
           "publish_load_s": statistics.median(p + q for p, q in zip(publish_s, load_s)),
           "snapshot_bytes": snapshot_bytes}
    shutil.rmtree(root)
    if lora is not None:
        out.update(merge_and_decode(args, engine, lora))
    return out


def merge_and_decode(args, engine, lora) -> dict:
    """What merging would cost per version, and what decoding unmerged costs against plain."""
    import jax
    from flax import nnx

    from bridge.engines.base import SamplingParams
    from jaxrl.models.lora import BLOCKS

    graphdef, state = engine.graphdef, engine.params

    @jax.jit
    def merge(state):
        kernels = {}
        for i in range(engine.cfg.num_layers):
            for target in lora.targets:
                node = state["layers"][i][BLOCKS[target]][target]
                kernels[(i, target)] = node["kernel"][...] + lora.scale * (node["lora"]["a"][...] @ node["lora"]["b"][...])
        return kernels

    jax.block_until_ready(merge(state))
    merge_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(merge(state))
        merge_s.append(time.perf_counter() - start)
    plain_model = nnx.merge(graphdef, state)
    for _, module in nnx.iter_modules(plain_model):
        if hasattr(module, "lora") and module.lora is not None:
            module.lora = nnx.data(None)
    plain = nnx.split(plain_model)
    plain = (plain[0], jax.device_put(plain[1], jax.tree.map(lambda x: x.sharding, plain[1])))
    unmerged = (graphdef, state)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 500, 24).tolist() for _ in range(args.decode_rows)]
    sampling = SamplingParams(temperature=1.0, max_tokens=args.decode_tokens, seed=1)

    def generate(which):
        engine.graphdef, engine.params = which
        start = time.perf_counter()
        asyncio.run(engine.generate(prompts, sampling))
        return time.perf_counter() - start

    generate(plain), generate(unmerged)  # compiles
    times = {"plain": [], "unmerged": []}
    for _ in range(args.repeats):
        times["plain"].append(generate(plain))
        times["unmerged"].append(generate(unmerged))
    return {"merge_s": statistics.median(merge_s),
            "decode_plain_s": statistics.median(times["plain"]),
            "decode_unmerged_s": statistics.median(times["unmerged"]),
            "decode_unmerged_over_plain": statistics.median(u / p for u, p in zip(times["unmerged"], times["plain"]))}


def child(args, part: str, lora: bool, model_dir: Path | None = None) -> dict:
    """`part` measured in a process of its own; its figures."""
    cmd = [sys.executable, "-m", "experiments.bench.lora", "--part", part, "--layers", str(args.layers),
           "--rank", str(args.rank), "--rows", str(args.rows), "--prompt-len", str(args.prompt_len),
           "--completion-len", str(args.completion_len), "--decode-rows", str(args.decode_rows),
           "--decode-tokens", str(args.decode_tokens), "--repeats", str(args.repeats)]
    cmd += ["--tiny"] * args.tiny + ["--lora"] * lora + (["--model-dir", str(model_dir)] if model_dir else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    if proc.returncode != 0:
        raise RuntimeError(f"{part} ({'lora' if lora else 'full'}) failed:\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{part} {'lora' if lora else 'full'}: {json.dumps(figures)}", flush=True)
    return figures


def run(args) -> dict:
    from flax import nnx

    from jaxrl.models import Decoder, save_pretrained

    cfg = model_config(args)
    learner = {name: child(args, "learner", name == "lora") for name in ("full", "lora")}
    root = Path(tempfile.mkdtemp(prefix="bench-lora-", dir=args.dir))
    try:
        save_pretrained(Decoder(cfg, nnx.Rngs(0)), root / "model")
        sync = {name: child(args, "sync", name == "lora", root / "model") for name in ("full", "lora")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    full, lora = sync["full"], sync["lora"]
    return {
        "learner_peak_rss_ratio": learner["lora"]["peak_rss_mb"] / learner["full"]["peak_rss_mb"],
        "learner_xla_peak_ratio": learner["lora"]["xla_peak_mb"] / learner["full"]["xla_peak_mb"],
        "snapshot_bytes_ratio": lora["snapshot_bytes"] / full["snapshot_bytes"],
        "publish_load_time_ratio": lora["publish_load_s"] / full["publish_load_s"],
        "decode_unmerged_over_plain": lora["decode_unmerged_over_plain"],
        "merge_s": lora["merge_s"],
        "lora_load_s": lora["load_s"],
        **{f"{name}_{k}": v for name, figures in learner.items() for k, v in figures.items()},
        **{f"{name}_{k}": v for name, figures in sync.items() for k, v in figures.items()
           if k in ("publish_s", "load_s", "publish_load_s", "snapshot_bytes")},
        "layers": args.layers, "rank": args.rank, "params": full_params(cfg),
        "load_average": round(os.getloadavg()[0], 1),
    }


def full_params(cfg) -> int:
    import math

    import jax
    from flax import nnx

    from jaxrl.models import Decoder

    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.part == "learner":
        figures = learner_part(args)
    elif args.part == "sync":
        figures = sync_part(args)
    else:
        figures = run(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
