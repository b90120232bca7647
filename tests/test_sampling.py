"""KV-cache sampling: tokens and logprobs agree with full forward passes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, positions_from_mask
from jaxrl.sampling import generate
from jaxrl.tiny import tiny_config


@pytest.fixture(scope="module")
def model():
    return Decoder(tiny_config("qwen3", vocab_size=128), nnx.Rngs(3))


def _full_logp(model, prompt, completion, temperature):
    """Log-softmax of a full forward pass over prompt + completion, at each completion token."""
    seq = jnp.asarray([prompt + completion])
    mask = jnp.ones_like(seq)
    logits, _ = model(seq, positions_from_mask(mask), mask)
    logp = jax.nn.log_softmax(logits[0, len(prompt) - 1:-1] / temperature, -1)
    return logp, np.asarray(logp)[np.arange(len(completion)), completion]


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_logprobs_match_a_full_forward_pass(model, temperature):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12]]
    out = generate(model, prompts, max_new_tokens=6, temperature=temperature, seed=1)
    for prompt, toks, logps in zip(prompts, out.tokens, out.logprobs):
        assert len(toks) == 6
        _, ref = _full_logp(model, prompt, toks, temperature)
        np.testing.assert_allclose(logps, ref, atol=1e-5)


def test_greedy_follows_argmax_and_stops_at_stop_tokens(model):
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, max_new_tokens=5)
    for prompt, toks in zip(prompts, free.tokens):
        logp, _ = _full_logp(model, prompt, toks, 1.0)
        assert toks == np.asarray(jnp.argmax(logp, -1)).tolist()
    assert free.finish_reasons == ["length", "length"]

    stop = free.tokens[0][-1]
    first = free.tokens[0].index(stop)
    stopped = generate(model, prompts, max_new_tokens=5, stop_token_ids=(stop,))
    assert stopped.tokens[0] == free.tokens[0][:first + 1]
    assert stopped.finish_reasons[0] == "stop"


def test_different_seeds_sample_differently(model):
    a = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=0)
    b = generate(model, [[1, 2]], max_new_tokens=8, temperature=1.0, seed=1)
    assert a.tokens != b.tokens


def test_empty_prompt_is_rejected(model):
    with pytest.raises(ValueError, match="every prompt needs a token"):
        generate(model, [[1], []], max_new_tokens=2)
