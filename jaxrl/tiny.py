"""Tiny random models of each family, built locally, for tests and the embedded CPU default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, RopeScaling, YarnScaling, save_classifier, save_pretrained
from jaxrl.models.families import FAMILIES, gpt_oss

# An MoE family's tiny shape: 8 experts of width 32, 2 a token.
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def tiny_config(family: str = "qwen3", tied: bool = True, vocab_size: int = 512, **overrides) -> ModelConfig:
    """A 2-layer GQA model (4 query heads, 2 KV heads, head_dim 32: vLLM's CPU minimum); an MoE family's
    with `TINY_MOE` experts. gpt-oss's with its released RoPE and every other layer (from the first)
    sliding over 4 keys, so that a few tokens reach past the window."""
    fields = dict(
        model_type=family,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        qkv_bias=FAMILIES[family].qkv_bias,
        qk_norm=FAMILIES[family].qk_norm,
        max_position_embeddings=2048,
    )
    if FAMILIES[family].moe_tensors is not None:
        fields.update(TINY_MOE)
    if family == "llama":
        fields["rope_scaling"] = RopeScaling(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
    if family == "gpt_oss":
        fields.update(gpt_oss.BLOCK, intermediate_size=TINY_MOE["moe_intermediate_size"], qkv_bias=True, o_bias=True,
                      rope_theta=150000.0, sliding_window=4,
                      rope_scaling=YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False))
    fields.update(overrides)
    if family == "gpt_oss" and "sliding_layers" not in overrides:
        fields["sliding_layers"] = tuple(range(0, fields["num_layers"], 2))
    return ModelConfig(**fields)


def build_tiny_model(out_dir: str | Path, family: str = "qwen3", seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Writes a random tiny model (and the tiny tokenizer's files) as a Hugging Face directory."""
    from jaxrl.tiny_tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer()
    cfg = tiny_config(
        family,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    save_pretrained(Decoder(cfg, nnx.Rngs(seed)), out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_classifier(out_dir: str | Path, seed: int = 0, tokenizer=None, **overrides) -> Path:
    """Writes a random tiny reward model (a sequence-classification checkpoint with one score, and the
    tiny tokenizer's files) as a Hugging Face directory."""
    from jaxrl.tiny_tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer()
    cfg = tiny_config(**{"vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                         "pad_token_id": tokenizer.pad_token_id, **overrides})
    head = np.random.default_rng(seed).normal(0.0, 0.5, (cfg.hidden_size, 1)).astype(np.float32)
    save_classifier(Decoder(cfg, nnx.Rngs(seed)), head, out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
