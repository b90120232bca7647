"""Model configuration for the Llama / Qwen2 / Qwen3 decoder family, to and from HF config.json."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# model_type -> (architecture class name, whether q/k/v carry a bias, whether q/k are RMS-normed)
FAMILIES: dict[str, tuple[str, bool, bool]] = {
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ModelConfigError(ValueError):
    """A model configuration that jaxrl cannot build, with the reason and what to do."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (the only scaling the supported families use)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        for key in ("param_dtype", "dtype"):
            if getattr(self, key) not in DTYPES:
                raise ModelConfigError(f"{key}={getattr(self, key)!r}; allowed: {sorted(DTYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def jnp_param_dtype(self):
        return DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json", classifier: bool = False) -> ModelConfig:
        """Builds a config from a Hugging Face config dict; `source` names it in errors. `classifier`:
        the decoder of a sequence-classification checkpoint (`*ForSequenceClassification`), asked for
        by name so that one is never loaded as a policy whose LM head is missing."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} (architectures {hf.get('architectures')}) is "
                f"not supported; jaxrl loads {sorted(FAMILIES)}"
            )
        arch, qkv_bias, qk_norm = FAMILIES[model_type]
        if classifier:
            arch = arch.replace("ForCausalLM", "ForSequenceClassification")
        archs = hf.get("architectures") or [arch]
        if arch not in archs:
            raise ModelConfigError(f"{source}: architectures {archs} is not {arch!r}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act {hf['hidden_act']!r}; only 'silu' is supported")
        if hf.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ModelConfigError(f"{source}: missing required key {key!r}")
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(hf, source)
        attention_bias = bool(hf.get("attention_bias", False))
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            param_dtype=dtype if dtype in DTYPES else "float32",
            dtype=dtype if dtype in DTYPES else "float32",
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict that transformers loads as the same model."""
        arch, family_qkv_bias, _ = FAMILIES[self.model_type]
        if self.qkv_bias != (family_qkv_bias or self.o_bias):
            raise ModelConfigError(
                f"qkv_bias={self.qkv_bias} with o_bias={self.o_bias} cannot be expressed as a "
                f"{self.model_type} config"
            )
        hf: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.param_dtype,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        }
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            hf["rope_parameters"] = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                **dataclasses.asdict(self.rope_scaling),
            }
        return hf


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelConfigError(
            f"{source}: rope type {rope_type!r} is not supported; supported: 'default', 'llama3'"
        )
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ModelConfigError(f"{source}: llama3 rope scaling lacks {missing}") from None
