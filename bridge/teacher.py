"""The teacher of on-policy distillation: its logprobs of the tokens the student sampled.

Each finished episode (prompt and completion, environment tokens included as context) goes through
the teacher once, in batches of `rows` episodes of at most `max_seq_len` tokens (one compiled
program, built before the bridge serves). The learner turns the logprobs into each token's
distillation advantage (`jaxrl.losses`, `distill_weight`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.batching import Batcher
from jaxrl.logprobs import chunked_logprobs
from jaxrl.models import load_pretrained

log = logging.getLogger(__name__)


class Teacher:
    """Scores episodes with the model in `model_dir`; `score` batches concurrent calls."""

    def __init__(self, model_dir: str | Path, max_seq_len: int, vocab_size: int | None = None, rows: int = 8,
                 batch_window_s: float = 0.005):
        model = load_pretrained(model_dir)
        if vocab_size is not None and model.cfg.vocab_size != vocab_size:
            raise ValueError(f"teacher {model_dir}: a vocabulary of {model.cfg.vocab_size} tokens, the student's has "
                             f"{vocab_size}; the teacher must share the student's tokenizer")
        self.graphdef, self.params = nnx.split(model)
        self.max_seq_len, self.rows = max_seq_len, rows
        self.batcher = Batcher(self._run, rows, batch_window_s)
        self._logprobs = jax.jit(self._next_token_logprobs)
        start = time.perf_counter()
        self._run([[0]])  # compiles the one program
        log.info("teacher %s: %d rows of %d tokens per call, compiled in %.1f s", model_dir, rows, max_seq_len,
                 time.perf_counter() - start)

    def _next_token_logprobs(self, params, tokens_BxS, mask_BxS):
        model = nnx.merge(self.graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
        h_BxSxD, _ = model.hidden(tokens_BxS, positions, mask_BxS)
        tied = model.lm_head is None
        w = model.embed_tokens[...] if tied else model.lm_head[...]
        return chunked_logprobs(h_BxSxD[:, :-1], w, tokens_BxS[:, 1:], 1.0, 128, False, tied)[0]

    def _run(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """log p(token t | tokens before it) for t >= 1 of each sequence (right-padded to one shape)."""
        tokens = np.zeros((self.rows, self.max_seq_len), np.int32)
        mask = np.zeros((self.rows, self.max_seq_len), np.int32)
        for i, seq in enumerate(sequences):
            tokens[i, :len(seq)], mask[i, :len(seq)] = seq, 1
        logp = np.asarray(self._logprobs(self.params, tokens, mask))
        return [logp[i, :len(seq) - 1] for i, seq in enumerate(sequences)]

    async def score(self, prompt_ids: list[int], completion_ids: list[int]) -> np.ndarray:
        """The teacher's logprob of each completion token given all before it (float32)."""
        n = len(prompt_ids) + len(completion_ids)
        if n > self.max_seq_len:
            raise ValueError(f"an episode of {n} tokens is longer than the teacher's {self.max_seq_len}")
        logp = await self.batcher.submit(list(prompt_ids) + list(completion_ids))
        return logp[len(prompt_ids) - 1:].astype(np.float32)
