"""This machine's floor for a decode step, measured in the same run as the figure it judges.

A decode step of `rows` sequences must at least read every weight once and each row's keys and values
once, and do its matmuls. `machine()` measures the memory bandwidth (a large numpy copy: bytes read +
written per second) and `decode_floor` times, with XLA's float32 dot on this machine, each matmul
of one decode step at the model's shapes (projections, MLP, the output head; attention over the rows'
contexts at the best of those rates; an MoE layer's experts as one matmul of its token-expert
pairs); the step's floor is the larger of the two times: bytes / bandwidth, or the matmuls' sum.
Softmaxes, norms, sampling and the step's bookkeeping are left out: whatever an engine spends on them
is what its figure over the floor shows.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np


def _best_s(fn, repeats: int, min_s: float = 0.02) -> float:
    """The fastest of `repeats` timings of fn, each averaged over enough calls to last min_s."""
    fn()
    calls, start = 1, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s:
        fn()
        calls += 1
    calls = max(calls, 1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a large float32 copy (each byte read once and written once)."""
    src = np.ones(mib << 18, np.float32)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_s(lambda: np.copyto(dst, src), repeats, min_s=0.0)


def matmul_s(m: int, k: int, n: int, repeats: int = 5, inner: int = 32) -> float:
    """Seconds of one float32 (m, k) @ (k, n) matmul on this machine: XLA's CPU dot (OpenBLAS's threads,
    numpy's, stall for tens of milliseconds on a shared machine). A chain x @ (k, n) @ (n, k) ... of
    2 * `inner` dots in one loop, as a model's layers chain them, so that dispatch does not count;
    the (m, n) @ (n, k) half does the same work."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(x, a, b):
        return jax.lax.fori_loop(0, inner, lambda _, x: (x @ a) @ b, x)

    rng = np.random.default_rng(0)
    x, a, b = (jnp.asarray(rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]))
               for shape in ((m, k), (k, n), (n, k)))
    return _best_s(lambda: run(x, a, b).block_until_ready(), repeats) / (2 * inner)


@dataclasses.dataclass(frozen=True)
class Floor:
    rows: int
    context: int  # tokens each row attends to
    shared: int  # of them, the tokens that each group of `group` rows shares (its prompt: read once)
    group: int
    bytes: int  # weights + keys and values read once
    flops: int
    memory_s: float  # bytes / bandwidth
    matmul_s: float  # the step's matmuls, each at its measured time
    bandwidth: float  # bytes/s

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.matmul_s)

    @property
    def tok_s(self) -> float:
        return self.rows / self.step_s

    def figures(self) -> dict:
        return {"rows": self.rows, "context": self.context, "shared": self.shared, "group": self.group,
                "bytes": self.bytes, "flops": self.flops,
                "bandwidth_gb_s": round(self.bandwidth / 1e9, 2), "memory_ms": round(1e3 * self.memory_s, 4),
                "matmul_ms": round(1e3 * self.matmul_s, 4), "matmul_gflop_s": round(self.flops / self.matmul_s / 1e9, 2),
                "bound": "memory" if self.memory_s >= self.matmul_s else "matmul", "tok_s": round(self.tok_s, 1)}


def decode_floor(cfg, rows: int, context: int, bandwidth: float, param_count: int, repeats: int = 5,
                 shared: int = 0, group: int = 1) -> Floor:
    """The floor of one decode step of `rows` rows that each attend to `context` cached tokens, for a
    model of `cfg` (a jaxrl ModelConfig) with `param_count` parameters; the first `shared` of those
    tokens are the same for each `group` rows (a GRPO group's prompt), whose keys and values are read
    once for the group. An MoE layer's experts count as one matmul of every token-expert pair (no
    grouped matmul does less), and its experts that no row routes to (expected, routes uniform) as
    weights not read."""
    D, F, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    item = np.dtype(cfg.jnp_dtype).itemsize
    attention = [(rows, D, N * H), (rows, D, K * H), (rows, D, K * H), (rows, N * H, D)]
    mlp = {False: [(rows, D, F), (rows, D, F), (rows, F, D)],
           True: [(rows, D, E), (rows * k, D, I), (rows * k, D, I), (rows * k, I, D)]}
    layers = [attention + mlp[cfg.is_moe(i)] for i in range(L)]
    shapes = {shape for layer in layers for shape in layer} | {(rows, D, V)}
    timed = {shape: matmul_s(*shape, repeats=repeats) for shape in shapes}
    best_rate = max(2 * m * k_ * n / s for (m, k_, n), s in timed.items())
    # Attention (each query head against its row's keys, then values) at the best rate measured: its
    # many small products are no harder than the projections, and the floor should not excuse them.
    attention_flops = 2 * 2 * rows * N * H * context
    seconds = sum(sum(timed[s] for s in layer) + attention_flops / best_rate for layer in layers) + timed[(rows, D, V)]
    flops = 2 * (sum(m * k_ * n for layer in layers for m, k_, n in layer) + rows * D * V) + L * attention_flops
    kv_bytes = (rows * (context - shared) + -(-rows // group) * shared) * L * 2 * K * H * item
    unread = len(cfg.moe_layers) * E * (1 - k / E) ** rows * 3 * D * I if E else 0
    total = (param_count - unread) * np.dtype(cfg.jnp_param_dtype).itemsize + kv_bytes
    return Floor(rows, context, shared, group, int(total), flops, total / bandwidth, seconds, bandwidth)
