"""Qwen2 / Qwen2.5: Llama with a bias on q, k and v always (config.json has no key for it)."""

from jaxrl.models.family import Family

FAMILY = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", qkv_bias=True)
