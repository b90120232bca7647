"""Tiny models primed to answer in a known way, for the tests of the engines and runs that serve them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from jaxrl.models import Decoder, save_pretrained
from jaxrl.tiny import tiny_config


def primed_judge(out_dir: Path, tokenizer) -> Path:
    """A tiny judge that answers every rubric "7": no layer writes to the residual stream (o_proj and
    down_proj are zero), so each position's final state is its own token's embedding, normed; the LM
    head maps the generation prompt's last token to "7" and "7" to the end of the turn."""
    cfg = tiny_config(tied=False, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    model = Decoder(cfg, nnx.Rngs(4))
    for layer in model.layers:
        layer.self_attn.o_proj.kernel[...] = 0.0 * layer.self_attn.o_proj.kernel[...]
        layer.mlp.down_proj.kernel[...] = 0.0 * layer.mlp.down_proj.kernel[...]
    embed, norm = np.asarray(model.embed_tokens[...]), np.asarray(model.norm.weight[...])

    def state(token):
        x = embed[token]
        return x / np.sqrt(np.mean(x * x) + cfg.rms_norm_eps) * norm

    last = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)[-1]
    [seven] = tokenizer.encode("7", add_special_tokens=False)
    head = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
    head[:, seven], head[:, tokenizer.eos_token_id] = 10 * state(last), 10 * state(seven)
    model.lm_head[...] = head
    save_pretrained(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
