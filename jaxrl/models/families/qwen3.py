"""Qwen3 (dense): Llama with q and k RMS-normed per head."""

from jaxrl.models.family import Family

FAMILY = Family(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    qk_norm=True,
    hf_keys=lambda cfg: {"attention_bias": cfg.o_bias},
)
