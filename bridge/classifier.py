"""A reward model of the `classifier` kind: a Hugging Face sequence-classification checkpoint that
scores each finished episode's conversation, rendered by its own tokenizer's chat template.

The checkpoint loads into jaxrl's decoder with its score head (`jaxrl.models.load_classifier`); the
episodes that finish together go through it in one call of `rows` sequences, padded to a power-of-two
length up to `max_seq_len` (every such program compiled before the bridge serves: nothing compiles
mid-run). The score is read at a sequence's last token that is not the checkpoint's padding token, as
transformers reads it (a template that ends turns with that token is read before it).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.batching import Batcher
from bridge.envs.render import prompt_ids
from jaxrl.compilation import bucket
from jaxrl.models import load_classifier, load_tokenizer

log = logging.getLogger(__name__)

MIN_BUCKET = 64  # the shortest padded length: shorter buckets save little and cost programs


class RewardClassifier:
    """Scores conversations with the model in `model_dir`; `score` batches concurrent calls."""

    def __init__(self, model_dir: str | Path, max_seq_len: int, rows: int = 8, batch_window_s: float = 0.005,
                 template_kwargs: dict[str, Any] | None = None):
        model, head_DxL = load_classifier(model_dir)
        if head_DxL.shape[1] != 1:
            raise ValueError(f"reward model {model_dir}: {head_DxL.shape[1]} labels; a reward model gives one score "
                             "(num_labels 1)")
        self.tokenizer = load_tokenizer(model_dir)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward model {model_dir}: its tokenizer has no chat template to render conversations "
                             "with (tokenizer_config.json's chat_template)")
        self.template_kwargs = dict(template_kwargs or {})
        self.pad_id = model.cfg.pad_token_id
        self.graphdef, self.params = nnx.split(model)
        self.head_DxL = head_DxL
        self.max_seq_len = bucket(max_seq_len, MIN_BUCKET)
        self.rows = rows
        self.batcher = Batcher(self._run, rows, batch_window_s)
        self._scores = jax.jit(self._last_token_scores)
        start = time.perf_counter()
        lengths = [MIN_BUCKET]
        while lengths[-1] < self.max_seq_len:
            lengths.append(2 * lengths[-1])
        for length in lengths:  # compiles every program before the first episode
            self._run([[0] * length])
        log.info("reward model %s: %d rows of up to %d tokens per call, %d programs compiled in %.1f s", model_dir,
                 rows, self.max_seq_len, len(lengths), time.perf_counter() - start)

    def _last_token_scores(self, params, head_DxL, tokens_BxS, lengths_B, read_B):
        model = nnx.merge(self.graphdef, params)
        mask_BxS = jnp.arange(tokens_BxS.shape[1]) < lengths_B[:, None]
        positions = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
        h_BxSxD, _ = model.hidden(tokens_BxS, positions, mask_BxS)  # right padding: causal slots ignore it
        read_BxD = jnp.take_along_axis(h_BxSxD, read_B[:, None, None], axis=1)[:, 0]
        return (read_BxD.astype(jnp.float32) @ head_DxL)[:, 0]

    def _run(self, sequences: list[list[int]]) -> list[float]:
        """The score of each sequence (at most `rows`, each at most `max_seq_len` tokens)."""
        length = bucket(max(len(s) for s in sequences), MIN_BUCKET)
        tokens = np.zeros((self.rows, length), np.int32)
        lengths, read = np.zeros(self.rows, np.int32), np.zeros(self.rows, np.int32)
        for i, seq in enumerate(sequences):
            tokens[i, :len(seq)], lengths[i] = seq, len(seq)
            # transformers: the last token that is not padding (none such: the first)
            read[i] = max((j for j, t in enumerate(seq) if t != self.pad_id), default=0)
        scores = np.asarray(self._scores(self.params, self.head_DxL, tokens, lengths, read))
        return [float(scores[i]) for i in range(len(sequences))]

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """`messages` as the classifier reads them: its chat template's tokens (no generation prompt)."""
        return prompt_ids(self.tokenizer, messages, None, self.template_kwargs, add_generation_prompt=False)

    async def score(self, messages: list[dict[str, Any]]) -> float:
        """The classifier's score of the conversation `messages`."""
        ids = self.render(messages)
        if len(ids) > self.max_seq_len:
            raise ValueError(f"a conversation of {len(ids)} tokens is longer than the reward model's "
                             f"{self.max_seq_len} (the engine's max_seq_len): raise bridge.engine_kwargs.max_seq_len")
        if not ids:
            raise ValueError("the reward model's chat template rendered the conversation as no tokens")
        return await self.batcher.submit(ids)
