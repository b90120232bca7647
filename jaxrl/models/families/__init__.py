"""The model families jaxrl loads, one module each, and config.json <-> ModelConfig through them."""

from __future__ import annotations

from typing import Any

from jaxrl.models.config import DTYPES, ModelConfig, ModelConfigError, rope_from_hf, rope_to_hf
from jaxrl.models.families import gpt_oss, llama, qwen2, qwen3, qwen3_moe
from jaxrl.models.family import Family, require

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                                         gpt_oss.FAMILY)}


def family_of(model_type: str, source: str = "config") -> Family:
    if model_type not in FAMILIES:
        raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported; jaxrl loads {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def config_from_hf(hf: dict[str, Any], source: str = "config.json", classifier: bool = False) -> ModelConfig:
    """The ModelConfig of a Hugging Face config dict (`ModelConfig.from_hf`)."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ModelConfigError(
            f"{source}: model_type {model_type!r} (architectures {hf.get('architectures')}) is "
            f"not supported; jaxrl loads {sorted(FAMILIES)}"
        )
    family = FAMILIES[model_type]
    arch = family.classifier if classifier else family.architecture
    archs = hf.get("architectures") or [arch]
    if arch not in archs:
        raise ModelConfigError(f"{source}: architectures {archs} is not {arch!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {hf['hidden_act']!r}; only 'silu' is supported")
    if hf.get("use_sliding_window"):
        raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        require(hf, key, source)
    num_heads = hf["num_attention_heads"]
    rope_theta, rope_scaling = rope_from_hf(hf, source)
    attention_bias = bool(hf.get("attention_bias", False))
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    common = dict(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=require(hf, "intermediate_size", source),
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family.qk_norm,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        param_dtype=dtype if dtype in DTYPES else "float32",
        dtype=dtype if dtype in DTYPES else "float32",
    )
    # A family's fields may replace common ones whose defaults are its own (gpt-oss: biased attention).
    return ModelConfig(**(common | family.config_fields(hf, source)))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config.json dict that transformers loads as the same model (`ModelConfig.to_hf`)."""
    family = FAMILIES[cfg.model_type]
    if cfg.qkv_bias != (family.qkv_bias or cfg.o_bias):
        raise ModelConfigError(
            f"qkv_bias={cfg.qkv_bias} with o_bias={cfg.o_bias} cannot be expressed as a {cfg.model_type} config"
        )
    hf: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
        "rope_parameters": rope_to_hf(cfg),
    }
    return hf | family.hf_keys(cfg)
