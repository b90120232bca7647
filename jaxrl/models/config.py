"""Model configuration: the fields the decoder reads, to and from Hugging Face config.json (each family's
keys: `jaxrl.models.families`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from jaxrl.models import moe

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ModelConfigError(ValueError):
    """A model configuration that jaxrl cannot build, with the reason and what to do."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling."""

    rope_type: ClassVar[str] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (arXiv 2309.00071) as transformers computes it (gpt-oss, Qwen3 long-context checkpoints):
    frequencies blended between scaled and original by a ramp over the dimensions, cos and sin scaled
    by an attention factor. The optional fields are kept as config.json has them (None: its default),
    so that they are written back the same."""

    rope_type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


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
    rope_scaling: RopeScaling | YarnScaling | None = None
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
    # gpt-oss's attention: a learned logit per query head in each softmax (a sink taking mass, adding no
    # value), and `sliding_layers` whose queries see only the `sliding_window` keys up to themselves.
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # Mixture of experts (0 experts: every layer is a dense MLP). A layer i is MoE unless it is one of
    # `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (Qwen-MoE's rule).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False  # the top-k weights renormalised to sum to 1
    router_scoring: str = "softmax"  # how the router's logits weigh the chosen experts (`moe.route`)
    router_bias: bool = False
    expert_bias: bool = False  # each expert's gate/up and down projections carry a bias
    expert_activation: str = "silu_glu"  # one of `moe.ACTIVATIONS`; the clamp and gain below are clamped_swiglu's
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        from jaxrl.models.families import FAMILIES

        if self.model_type not in FAMILIES:
            raise ModelConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if self.sliding_layers and self.sliding_window < 1:
            raise ModelConfigError(f"sliding_window={self.sliding_window} must be >= 1 with sliding layers")
        if not set(self.sliding_layers) <= set(range(self.num_layers)):
            raise ModelConfigError(f"sliding_layers={self.sliding_layers} must be layers of 0..{self.num_layers - 1}")
        if self.num_experts and FAMILIES[self.model_type].moe_tensors is None:
            raise ModelConfigError(f"num_experts={self.num_experts}: {self.model_type} has no mixture-of-experts "
                                   "layers; use an MoE family (qwen3_moe, gpt_oss)")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                                   f"{self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ModelConfigError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1 with experts")
        for key, allowed in (("router_scoring", moe.SCORINGS), ("expert_activation", moe.ACTIVATIONS)):
            if getattr(self, key) not in allowed:
                raise ModelConfigError(f"{key}={getattr(self, key)!r}; allowed: {list(allowed)}")
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

    def is_moe(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def sliding(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention; None where it sees every key before it."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts, in order."""
        return tuple(i for i in range(self.num_layers) if self.is_moe(i))

    @property
    def route_width(self) -> int:
        """Expert ids in a token's route: its top-k in every MoE layer, layer by layer (0: a dense model)."""
        return len(self.moe_layers) * self.num_experts_per_tok

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json", classifier: bool = False) -> ModelConfig:
        """Builds a config from a Hugging Face config dict; `source` names it in errors. `classifier`:
        the decoder of a sequence-classification checkpoint (`*ForSequenceClassification`), asked for
        by name so that one is never loaded as a policy whose LM head is missing."""
        from jaxrl.models.families import config_from_hf

        return config_from_hf(hf, source, classifier)

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face config.json dict that transformers loads as the same model."""
        from jaxrl.models.families import config_to_hf

        return config_to_hf(self)


def rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | YarnScaling | None]:
    # transformers 5 writes `rope_parameters`; older checkpoints have `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    try:
        if rope_type == "llama3":
            return theta, RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        if rope_type == "yarn":
            original = int(params["original_max_position_embeddings"])
            factor = params.get("factor")
            if factor is None:  # transformers' rule (DeepSeek-V3's layout): the ratio of the two lengths
                factor = hf["max_position_embeddings"] / original
            return theta, YarnScaling(
                factor=float(factor),
                original_max_position_embeddings=original,
                # `or`: transformers takes a 0 or null beta as its default too
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                truncate=bool(params.get("truncate", True)),
                **{k: float(params[k]) for k in ("attention_factor", "mscale", "mscale_all_dim")
                   if params.get(k) is not None},
            )
    except KeyError as missing:
        raise ModelConfigError(f"{source}: {rope_type} rope scaling lacks {missing}") from None
    raise ModelConfigError(
        f"{source}: rope type {rope_type!r} is not supported; supported: 'default', 'llama3', 'yarn'"
    )


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's `rope_parameters` of `cfg` (read back by `rope_from_hf` as the same)."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return {"rope_type": scaling.rope_type, "rope_theta": cfg.rope_theta, **fields}
