"""Learner throughput and memory: our jitted train step against PyTorch on the same weights.

    python -m experiments.bench.learner [--tiny] [--batch 8 --prompt-len 64 ...]

Figures (last line, JSON):
  train_tokens_per_s   real prompt + completion tokens / median `Learner.update` wall time
  ratio_vs_torch       median transformers (PyTorch) step time / median `Learner.update` wall
                       time; above 1 = we are faster.
                       Both run the same GRPO step (forward, clipped loss over completion
                       tokens, entropy metric, backward, grad clipping, AdamW) on the same
                       weights and batch, interleaved, with the same number of threads, in
                       one process under the malloc settings `jaxrl train` runs with
                       (jaxrl/host_memory.py; JAXRL_SYSTEM_MALLOC=1: glibc's defaults).
  host_overhead_ms     `Learner.update` wall time outside the jitted call and its metric fetch
                       (batch checks, transfers, finite check)
  jax_page_faults_per_step  minor page faults of the process during one `Learner.update`
                       (memory the step touches for the first time since the last), the median;
                       `_by_step` each timed step's, `_warmup` those of the untimed rounds before
                       (run until one faults nothing in, at most WARMUP_ROUNDS)
  jax_step_s_by_step, torch_step_s_by_step  each timed step, in order
  cpu                  the CPU's model name (/proc/cpuinfo): the ratio differs between CPUs of one machine kind
  cpu_vector_units     which of AVX2, AVX-512 (and its bf16) and AMX the CPU has: a virtual machine's
                       model name ("AMD EPYC") does not tell the generations apart, whose kernels differ
  peak_mem_mb          XLA's compiled memory analysis of the train step (see `compiled_peak_mb`)
  logp_peak_mem_*_mb   XLA temp memory of the gradient of summed completion logprobs at a
                       >= 100k vocabulary, chunked over the sequence vs all positions at once
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.advantages import compute_advantages
from jaxrl.host_memory import restart_tuned
from jaxrl.learner import Learner
from jaxrl.logprobs import completion_logprobs
from jaxrl.models import Decoder, positions_from_mask, save_pretrained
from jaxrl.sharding import MeshConfig, batch_sharding, make_mesh, put_batch
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig, jit_train_step

MB = 1 << 20
# Sizes meant for a 2-core CPU (about a minute in all); --tiny keeps CI to seconds.
DEFAULTS = dict(batch=8, prompt_len=64, completion_len=192, steps=5, vocab=8192, hidden=256,
                layers=4, group_size=4, logp_vocab=131072, logp_chunk=64)
TINY = dict(batch=4, prompt_len=8, completion_len=32, steps=2, vocab=512, hidden=64,
            layers=2, group_size=2, logp_vocab=131072, logp_chunk=8)
# Attention and MLP widths; 0 derives them from --hidden (head_dim 32, two query heads per KV
# head, intermediate 3 x hidden). The tool-episode workload: --hidden 128 --heads 4
# --kv-heads 2 --intermediate 384 --vocab 1000 --prompt-len 350 --completion-len 128
# --group-size 8.
SHAPE = dict(heads=0, kv_heads=0, head_dim=0, intermediate=0)
# Untimed rounds of both steps after the first, at most: until a step of ours faults no page in.
WARMUP_ROUNDS = 5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="shrink every size (CI smoke run)")
    p.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3"])
    for key in DEFAULTS:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"default {DEFAULTS[key]} (--tiny: {TINY[key]})")
    for key in SHAPE:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=0,
                       help="default: derived from --hidden")
    args = p.parse_args(argv)
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def model_config(args, vocab: int):
    # head_dim 32 (vLLM's CPU minimum); two query heads per KV head as in the tiny models.
    head_dim = args.head_dim or 32
    heads = args.heads or max(args.hidden // head_dim, 1)
    return tiny_config(args.family, vocab_size=vocab, hidden_size=args.hidden,
                       intermediate_size=args.intermediate or 3 * args.hidden,
                       num_layers=args.layers, num_heads=heads, head_dim=head_dim,
                       num_kv_heads=args.kv_heads or max(heads // 2, 1))


def make_batch(args, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Left-padded prompts and right-padded completions of random lengths, one reward each."""
    rng = np.random.default_rng(seed)
    B, P, C = args.batch, args.prompt_len, args.completion_len
    prompt_len_B = rng.integers(P // 2, P + 1, B)
    completion_len_B = rng.integers(C // 2, C + 1, B)
    prompt_mask = (np.arange(P)[None] >= P - prompt_len_B[:, None]).astype(np.int32)
    completion_mask = (np.arange(C)[None] < completion_len_B[:, None]).astype(np.int32)
    return {
        "prompt_BxP": rng.integers(0, vocab, (B, P)) * prompt_mask,
        "prompt_mask_BxP": prompt_mask,
        "completion_BxC": rng.integers(0, vocab, (B, C)) * completion_mask,
        "completion_mask_BxC": completion_mask,
        "loss_mask_BxC": completion_mask,
        "rewards_BxR": rng.random((B, 1)).astype(np.float32),
    }


def compiled_peak_mb(compiled) -> float:
    """Peak device memory XLA planned for one call: arguments + outputs + scratch (temp),
    less outputs that reuse donated argument buffers. Weights, optimiser state and batch
    are arguments; unlike max RSS it leaves out the runtime, Python and PyTorch.
    """
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return (total + m.temp_size_in_bytes) / MB


class TorchStep:
    """The same GRPO update in PyTorch on a transformers model loaded from our weights."""

    def __init__(self, model: Decoder, batch: dict[str, np.ndarray], cfg: LearnerConfig):
        import torch
        import transformers

        self.torch, self.cfg = torch, cfg
        transformers.utils.logging.disable_progress_bar()  # keeps the output to our figures
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, tmp)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        self.model.train()
        opt = cfg.optimizer
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=opt.learning_rate,
                                     betas=(opt.b1, opt.b2), eps=opt.eps,
                                     weight_decay=opt.weight_decay)
        ids = np.concatenate([batch["prompt_BxP"], batch["completion_BxC"]], 1)
        mask = np.concatenate([batch["prompt_mask_BxP"], batch["completion_mask_BxC"]], 1)
        adv_B, _ = compute_advantages(batch["rewards_BxR"], cfg.group_size, cfg.advantages)

        def as_t(x):
            return torch.tensor(np.asarray(x))

        self.inputs = dict(input_ids=as_t(ids), attention_mask=as_t(mask),
                           position_ids=as_t(positions_from_mask(jnp.asarray(mask))))
        self.completion = as_t(batch["completion_BxC"])
        self.loss_mask = as_t(batch["loss_mask_BxC"]).float()
        self.adv_Bx1 = as_t(adv_B)[:, None]

    def __call__(self) -> dict[str, float]:
        """One update; returns its metrics."""
        torch, cfg = self.torch, self.cfg
        C = self.completion.shape[1]
        # logits_to_keep: the head runs on completion positions only, as ours does.
        logits = self.model(**self.inputs, logits_to_keep=C + 1).logits[:, :-1].float()
        logp_all = torch.log_softmax(logits / cfg.temperature, -1)
        logp = logp_all.gather(-1, self.completion[..., None])[..., 0]
        with torch.no_grad():  # the entropy metric, as our step logs it
            entropy_BxC = -(logp_all.exp() * logp_all).sum(-1)
            entropy = (entropy_BxC * self.loss_mask).sum() / self.loss_mask.sum()
        rho = torch.exp(logp - logp.detach())
        clipped = rho.clamp(1 - cfg.loss.eps_low, 1 + cfg.loss.eps_high)
        pg = -torch.minimum(rho * self.adv_Bx1, clipped * self.adv_Bx1)
        n_B = self.loss_mask.sum(1)
        # loss_type grpo: mean over sequences of token means.
        loss = ((pg * self.loss_mask).sum(1) / n_B.clamp(min=1)).sum() / (n_B > 0).sum()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optimizer.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"grad_norm": float(norm), "entropy": float(entropy)}


def logp_grad_peak_mb(cfg, batch: dict[str, np.ndarray], chunk: int) -> float:
    """XLA temp memory of d(sum of completion logprobs)/d(params); compiled, never run."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
    keys = ("prompt_BxP", "prompt_mask_BxP", "completion_BxC", "completion_mask_BxC")

    def total_logp(params, *arrays):
        logp, _ = completion_logprobs(nnx.merge(graphdef, params), *arrays, chunk=chunk)
        return (logp * arrays[-1]).sum()

    compiled = jax.jit(jax.grad(total_logp)).lower(params, *(batch[k] for k in keys)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MB


def cpu_vector_units() -> str:
    """The CPU's vector and matrix extensions (/proc/cpuinfo flags): XLA's and PyTorch's kernels for
    AVX2, AVX-512 and AMX differ, and so does the ratio between them."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(flag for flag in wanted if flag in flags) or "none of avx2/avx512/amx"


def cpu_model() -> str:
    """The CPU's name as /proc/cpuinfo gives it (machines of one kind differ: the ratio to PyTorch with them)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_steps(learner: Learner, torch_step: TorchStep, batch: dict[str, np.ndarray], steps: int) -> dict:
    """Our step and PyTorch's on `batch`, alternated: a first one of each (compiles ours; both start
    from the same weights, so their gradient norms must agree), untimed rounds until a step of ours
    faults no page in, then `steps` timed rounds. Each side's seconds by step, ours outside its jitted
    call (`host_s`), and our page faults."""
    jax_norm = learner.update(batch)["grad_norm"]
    torch_norm = torch_step()["grad_norm"]
    # The two sides share the one heap of the malloc settings, which grows over the first rounds to
    # hold both steps' memory, and a step that faults ~250 MB in took 2-3x as long at the defaults
    # (0.8-0.9 s against ~0.3).
    warmup_faults = []
    while len(warmup_faults) < WARMUP_ROUNDS and (not warmup_faults or warmup_faults[-1] > 0):
        before = minor_faults()
        learner.update(batch)
        warmup_faults.append(minor_faults() - before)
        torch_step()
    jax_s, host_s, torch_s, faults = [], [], [], []
    for _ in range(steps):
        faults_before = minor_faults()
        start = time.perf_counter()
        step_s = learner.update(batch)["step_s"]
        jax_s.append(time.perf_counter() - start)
        faults.append(minor_faults() - faults_before)
        host_s.append(jax_s[-1] - step_s)
        start = time.perf_counter()
        torch_step()
        torch_s.append(time.perf_counter() - start)
    return {"jax_norm": jax_norm, "torch_norm": torch_norm, "warmup_faults": warmup_faults, "jax_s": jax_s,
            "host_s": host_s, "torch_s": torch_s, "faults": faults}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    # XLA's CPU client runs one intra-op thread per core it may use; torch gets as many.
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    cfg = LearnerConfig(group_size=args.group_size, logp_chunk=args.logp_chunk)
    batch = make_batch(args, args.vocab)
    tokens = int(batch["prompt_mask_BxP"].sum() + batch["completion_mask_BxC"].sum())

    model = Decoder(model_config(args, args.vocab), nnx.Rngs(0))
    torch_step = TorchStep(model, batch, cfg)  # copies the weights before the learner moves them
    mesh = make_mesh(MeshConfig())
    learner = Learner(model, cfg, mesh)

    timed = interleaved_steps(learner, torch_step, batch, args.steps)
    jax_s, host_s, torch_s, faults = timed["jax_s"], timed["host_s"], timed["torch_s"], timed["faults"]
    jax_med, torch_med = statistics.median(jax_s), statistics.median(torch_s)

    arrays = put_batch(batch, mesh)
    step_fn = jit_train_step(learner.graphdef, cfg, learner.tx, learner.shardings,
                             {k: batch_sharding(mesh, v.ndim) for k, v in arrays.items()})
    with jax.set_mesh(mesh):
        peak_mb = compiled_peak_mb(step_fn.lower(learner.state, arrays, None).compile())

    big_cfg = model_config(args, args.logp_vocab)
    big_batch = make_batch(args, args.logp_vocab)
    chunked = logp_grad_peak_mb(big_cfg, big_batch, args.logp_chunk)
    unchunked = logp_grad_peak_mb(big_cfg, big_batch, args.completion_len)

    figures = {
        "train_tokens_per_s": tokens / jax_med,
        "ratio_vs_torch": torch_med / jax_med,
        "peak_mem_mb": peak_mb,
        "logp_peak_mem_chunked_mb": chunked,
        "logp_peak_mem_unchunked_mb": unchunked,
        "logp_mem_ratio_unchunked_vs_chunked": unchunked / chunked,
        # Linux reports KiB; the whole process, PyTorch's model and both compilations included.
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "jax_step_s": jax_med,
        "torch_step_s": torch_med,
        "host_overhead_ms": 1000 * statistics.median(host_s),
        "jax_page_faults_per_step": statistics.median(faults),
        "jax_page_faults_by_step": faults,
        "jax_page_faults_warmup": timed["warmup_faults"],
        "jax_step_s_by_step": jax_s,
        "torch_step_s_by_step": torch_s,
        "grad_norm_rel_diff": abs(timed["jax_norm"] - timed["torch_norm"]) / timed["torch_norm"],
        "tokens_per_step": tokens,
        "threads": threads,
        "cpu": cpu_model(),
        "cpu_vector_units": cpu_vector_units(),
    }
    mc = model_config(args, args.vocab)
    print(f"learner benchmark: {args.family}, hidden {args.hidden}, {args.layers} layers, "
          f"{mc.num_heads}/{mc.num_kv_heads} heads of {mc.head_dim}, mlp {mc.intermediate_size}, "
          f"vocab {args.vocab}; batch {args.batch} x (prompt {args.prompt_len} + completion "
          f"{args.completion_len}); median of {args.steps} steps; {jax.default_backend()}, "
          f"{threads} threads")
    print(f"logprob memory: vocab {args.logp_vocab}, chunk {args.logp_chunk} vs "
          f"{args.completion_len}")
    for key, value in figures.items():
        shown = (f"{value:>14.4g}" if isinstance(value, (int, float)) else
                 " ".join(f"{v:.4g}" for v in value) if isinstance(value, list) else f"{value:>14}")
        print(f"  {key:<38} {shown}")
    print(json.dumps(figures), flush=True)
    return figures


if __name__ == "__main__":
    restart_tuned()  # malloc as `jaxrl train` and the bridge run it (jaxrl.host_memory)
    main()
