"""Chunked completion log-probabilities against a plain full-logits reference.

Every check is one jit of several variants at once: compiling is what costs time on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.logprobs import completion_logprobs
from jaxrl.models import Decoder, positions_from_mask
from jaxrl.tiny import tiny_config

VOCAB = 97
B, P, C = 3, 5, 7
CHUNKS = (1, 3, 4, C, C + 5)  # 4 does not divide C; C + 5 is more than C


def _model(vocab=VOCAB, tied=True, seed=0, **overrides):
    """A one-layer decoder with every weight randomised large enough for peaked distributions."""
    overrides.setdefault("num_layers", 1)
    model = Decoder(tiny_config("qwen3", tied=tied, vocab_size=vocab, **overrides), nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [
        1 + 0.3 * jax.random.normal(k, x.shape) if x.ndim == 1 else 0.2 * jax.random.normal(k, x.shape)
        for k, x in zip(keys, leaves)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)


def _batch(vocab=VOCAB, b=B, p=P, c=C, seed=0):
    """Left-padded prompts and right-padded completions of different lengths."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, (b, p))
    completion = rng.integers(0, vocab, (b, c))
    prompt_len = ([p, 2, max(p - 1, 1)] + [p] * b)[:b]
    completion_len = ([c, 3, 1] + [c] * b)[:b]
    prompt_mask = np.array([[i >= p - n for i in range(p)] for n in prompt_len])
    completion_mask = np.array([[i < n for i in range(c)] for n in completion_len])
    return tuple(jnp.asarray(x, jnp.int32) for x in (prompt, prompt_mask, completion, completion_mask))


def _reference(model, prompt, prompt_mask, completion, completion_mask, temperature):
    """log p(next token) and entropy -sum p log p from the model's full (B, T, V) logits."""
    tokens = jnp.concatenate([prompt, completion], 1)
    mask = jnp.concatenate([prompt_mask, completion_mask], 1)
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    logits = logits[:, prompt.shape[1] - 1 : -1].astype(jnp.float32) / temperature
    logp_all = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logp_all, completion[..., None], -1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
    return logp, entropy


def test_matches_full_logits_reference():
    model = _model(tied=False)  # the lm_head path; the gradient test covers the tied one
    batch = _batch()
    prompt, prompt_mask, completion, completion_mask = batch
    # Padding holds other ids: masked tokens must change nothing at real positions.
    repadded = (
        jnp.where(prompt_mask.astype(bool), prompt, (prompt + 11) % VOCAB),
        prompt_mask,
        jnp.where(completion_mask.astype(bool), completion, (completion + 13) % VOCAB),
        completion_mask,
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, temperature):  # temperature is traced: one compile for all of them
        m = nnx.merge(graphdef, params, rest)
        ref = _reference(m, *batch, temperature)
        chunked = [
            completion_logprobs(m, *batch, temperature=temperature, chunk=c, with_entropy=True) for c in CHUNKS
        ]
        no_entropy = completion_logprobs(m, *batch, temperature=temperature, chunk=3)[0]
        padded = completion_logprobs(m, *repadded, temperature=temperature, chunk=3)[0]
        return ref, chunked, no_entropy, padded

    results = {}
    for temperature in (1.0, 0.7, 1.6):
        (ref_logp, ref_ent), chunked, no_entropy, padded = run(params, temperature)
        results[temperature] = ref_logp
        # The distributions are far from uniform, so the comparison is not vacuous.
        assert float(jnp.std(ref_logp)) > 0.5
        assert float(jnp.min(ref_ent)) < np.log(VOCAB) - 0.5
        for chunk, (logp, ent) in zip(CHUNKS, chunked):
            assert logp.shape == ent.shape == (B, C)
            np.testing.assert_allclose(logp, ref_logp, atol=1e-5, rtol=0, err_msg=f"chunk={chunk} T={temperature}")
            np.testing.assert_allclose(ent, ref_ent, atol=1e-5, rtol=0, err_msg=f"chunk={chunk} T={temperature}")
        np.testing.assert_allclose(no_entropy, ref_logp, atol=1e-5, rtol=0)
        real = np.asarray(completion_mask, bool)
        np.testing.assert_allclose(np.asarray(padded)[real], np.asarray(ref_logp)[real], atol=1e-5, rtol=0)
    assert float(jnp.max(jnp.abs(results[1.0] - results[0.7]))) > 1e-2


def test_without_entropy_returns_none():
    model, batch = _model(), _batch()
    logp, entropy = jax.eval_shape(lambda: completion_logprobs(model, *batch, chunk=3))
    assert entropy is None
    assert logp.shape == (B, C) and logp.dtype == jnp.float32


def _global_norm(tree):
    return float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(tree))))


def test_gradients_match_unchunked():
    """d/dparams of sum(logp * mask) (and of the entropy) chunked == the full-logits reference."""
    model, batch = _model(tied=True), _batch()
    mask = batch[3]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grad_of(fn):
        return jax.grad(lambda p: jnp.sum(fn(nnx.merge(graphdef, p, rest)) * mask))(params)

    @jax.jit
    def run(temperature):
        ref = grad_of(lambda m: _reference(m, *batch, temperature)[0])
        chunked = [
            grad_of(lambda m, c=c: completion_logprobs(m, *batch, temperature=temperature, chunk=c)[0])
            for c in (1, 3, C)
        ]
        ref_ent = grad_of(lambda m: _reference(m, *batch, temperature)[1])
        ent = grad_of(
            lambda m: completion_logprobs(m, *batch, temperature=temperature, chunk=3, with_entropy=True)[1]
        )
        return ref, chunked, ref_ent, ent

    ref, chunked, ref_ent, ent = run(0.8)
    assert _global_norm(ref) > 1e-2 and _global_norm(ref_ent) > 1e-2
    assert len(jax.tree.leaves(ref)) == len(jax.tree.leaves(params))
    for chunk, grad in zip((1, 3, C), chunked):
        for got, want in zip(jax.tree.leaves(grad), jax.tree.leaves(ref)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"chunk={chunk}")
    for got, want in zip(jax.tree.leaves(ent), jax.tree.leaves(ref_ent)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg="entropy")


def test_other_backends_take_the_same_gradients(monkeypatch):
    """GPUs and TPUs run `platform_dependent`'s default branches (the head's gradient in the weight's own
    layout, the attention's dots on their operands as they are); run here instead of the CPU ones,
    they give the same gradients, tied head and untied."""
    batch = _batch()

    def grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p: jnp.sum(completion_logprobs(nnx.merge(graphdef, p, rest), *batch, chunk=3)[0] * batch[3])
        return jax.jit(jax.grad(loss))(params)

    models = [_model(tied=tied) for tied in (True, False)]
    cpu = [grads(model) for model in models]
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, default, **_: default(*args))
    for want, model in zip(cpu, models):
        assert _global_norm(want) > 1e-2
        for got, w in zip(jax.tree.leaves(grads(model)), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, w, atol=1e-6, rtol=0)


def _grad_temp_bytes(model, batch, chunk):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logp, _ = completion_logprobs(nnx.merge(graphdef, p, rest), *batch, chunk=chunk)
        return jnp.sum(logp * batch[3])

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunking_bounds_memory():
    vocab, c, b = 32768, 64, 4
    cfg = tiny_config("qwen3", vocab_size=vocab, num_layers=1, hidden_size=32)
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))  # compiled only, never run
    batch = _batch(vocab=vocab, b=b, p=4, c=c)
    logits_bytes = b * c * vocab * 4
    small = _grad_temp_bytes(model, batch, chunk=8)
    full = _grad_temp_bytes(model, batch, chunk=c)
    # One chunk of C holds the whole float32 (B, C, V) logits; chunks of 8 never do.
    assert full >= logits_bytes, (full, logits_bytes)
    assert small < logits_bytes, (small, logits_bytes)
    assert 2 * small <= full, (small, full)


def test_temperature_gradient_matches_unchunked():
    """The hand-written backward also differentiates the temperature (logp and entropy)."""
    model, batch = _model(), _batch()
    mask = batch[3]

    def total(fn):
        return lambda t: jnp.sum((fn(t)[0] + 0.5 * fn(t)[1]) * mask)

    @jax.jit
    def run(temperature):
        ref = jax.grad(total(lambda t: _reference(model, *batch, t)))(temperature)
        ours = jax.grad(total(lambda t: completion_logprobs(model, *batch, temperature=t, chunk=3, with_entropy=True)))(temperature)
        return ref, ours

    ref, ours = run(0.8)
    assert abs(float(ref)) > 1e-2
    np.testing.assert_allclose(ours, ref, rtol=1e-5)


def test_shared_prompts_match_one_prompt_per_row():
    """Rows in blocks sharing a prompt, each block's prompt run once: the same logprobs,
    entropies and gradients as running every row's prompt (two layers, grouped-query heads)."""
    model = _model(tied=False, num_layers=2)
    n, groups = 3, 2
    prompt, prompt_mask, completion, completion_mask = _batch(b=n * groups)
    prompt, prompt_mask = jnp.repeat(prompt[:groups], n, 0), jnp.repeat(prompt_mask[1:groups + 1], n, 0)
    batch = (prompt * prompt_mask, prompt_mask, completion, completion_mask)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params):
        def loss(p, group):
            logp, ent = completion_logprobs(nnx.merge(graphdef, p, rest), *batch, temperature=0.9, chunk=4,
                                            with_entropy=True, prompt_group=group)
            return jnp.sum((logp + 0.1 * ent) * completion_mask), (logp, ent)

        return [jax.grad(loss, has_aux=True)(params, group) for group in (1, n)]

    (grad_one, (logp_one, ent_one)), (grad_shared, (logp_shared, ent_shared)) = run(params)
    real = np.asarray(completion_mask, bool)
    assert float(jnp.std(logp_one[real])) > 0.5 and _global_norm(grad_one) > 1e-2
    np.testing.assert_allclose(np.asarray(logp_shared)[real], np.asarray(logp_one)[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent_shared)[real], np.asarray(ent_one)[real], atol=1e-5, rtol=0)
    # Float32 sums in another order: 2.8e-5 relative on one of 6,208 weights at tests/xla_flags.py's -O0.
    for got, want in zip(jax.tree.leaves(grad_shared), jax.tree.leaves(grad_one)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
