"""Llama (2, 3.x): the dense layout every family here starts from; biases only where config.json asks."""

from jaxrl.models.family import Family

FAMILY = Family(
    model_type="llama",
    architecture="LlamaForCausalLM",
    hf_keys=lambda cfg: {"attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias},
)
