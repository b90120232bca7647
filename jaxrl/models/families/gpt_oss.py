"""gpt-oss (gpt-oss-20b, -120b): biased attention with a sink logit per query head, sliding-window layers
(`layer_types`) alternating with full ones, YaRN RoPE; an MoE block in every layer: a biased router
whose top-k logits are softmaxed, and `num_local_experts` experts of width `intermediate_size` with
biases and a clamped SwiGLU over interleaved gate/up columns.

transformers' model and jaxrl's names hold each layer's experts stacked, in (in, out) layout:
`mlp.experts.gate_up_proj` (E, D, 2I), gate and up columns interleaved, and `mlp.experts.down_proj`
(E, I, D), each with its `_bias`. The released checkpoints store both projections in MXFP4
(`{name}_blocks` (E, out, in / 32, 16) uint8, two 4-bit values a byte, and `{name}_scales`
(E, out, in / 32) uint8, one power-of-two exponent per 32 values): they are dequantised on load;
jaxrl writes them unquantised (bfloat16 or float32), under transformers' names, which it loads as they are.
"""

from __future__ import annotations

import numpy as np

from jaxrl.models.config import ModelConfigError, YarnScaling
from jaxrl.models.family import CheckpointError, Family, require

# What every gpt-oss config has (tiny_config builds with it too).
BLOCK = dict(router_scoring="topk_softmax", router_bias=True, expert_bias=True, expert_activation="clamped_swiglu",
             attention_sinks=True)
_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig defaults where config.json has no rope keys
_ROPE_THETA = 150000.0
_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False)
# MXFP4's 4-bit values (E2M1: sign, two exponent bits, one mantissa bit) by their code
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
_SCALE_BIAS = 127


def _config_fields(hf, source):
    layers = require(hf, "num_hidden_layers", source)
    layer_types = hf.get("layer_types") or [_LAYER_TYPES[i % 2] for i in range(layers)]
    if len(layer_types) != layers or not set(layer_types) <= set(_LAYER_TYPES):
        raise ModelConfigError(f"{source}: layer_types must give one of {list(_LAYER_TYPES)} for each of the "
                               f"{layers} layers; got {layer_types}")
    # transformers: a sliding layer without a window attends to every key before it
    window = hf.get("sliding_window") or 0
    attention_bias = bool(hf.get("attention_bias", True))  # transformers' default for gpt-oss
    rope = {} if "rope_parameters" in hf or "rope_scaling" in hf else dict(
        rope_theta=float(hf.get("rope_theta", _ROPE_THETA)), rope_scaling=_YARN)
    return dict(
        **BLOCK,
        **rope,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        num_experts=require(hf, "num_local_experts", source, "num_experts"),
        num_experts_per_tok=require(hf, "num_experts_per_tok", source),
        moe_intermediate_size=require(hf, "intermediate_size", source),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention") if window else (),
    )


def _hf_keys(cfg):
    fixed = {**BLOCK, "intermediate_size": cfg.moe_intermediate_size, "decoder_sparse_step": 1, "mlp_only_layers": (),
             "norm_topk_prob": False}
    differing = [f"{k}={getattr(cfg, k)!r}" for k, v in fixed.items() if getattr(cfg, k) != v]
    if differing or not cfg.num_experts:
        raise ModelConfigError(f"{', '.join(differing) or 'num_experts=0'} cannot be expressed as a gpt_oss config: "
                               f"every layer is an MoE block with {BLOCK}, its experts intermediate_size wide")
    return {"attention_bias": cfg.o_bias, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "swiglu_limit": cfg.swiglu_limit,
            "swiglu_alpha": cfg.swiglu_alpha, "sliding_window": cfg.sliding_window or None,
            "layer_types": [_LAYER_TYPES[i not in cfg.sliding_layers] for i in range(cfg.num_layers)]}


def _moe_tensors(cfg, prefix):
    yield f"{prefix}.mlp.router.weight", ("mlp", "router", "kernel"), True
    yield f"{prefix}.mlp.router.bias", ("mlp", "router", "bias"), False
    yield f"{prefix}.mlp.experts.gate_up_proj", ("mlp", "gate_up"), False
    yield f"{prefix}.mlp.experts.gate_up_proj_bias", ("mlp", "gate_up_bias"), False
    yield f"{prefix}.mlp.experts.down_proj", ("mlp", "down"), False
    yield f"{prefix}.mlp.experts.down_proj_bias", ("mlp", "down_bias"), False


def dequantize_mxfp4(blocks_ExRxGx16, scales_ExRxG, dtype, name: str) -> np.ndarray:
    """(E, G * 32, R) in `dtype`: MXFP4 blocks of R rows of G groups of 32 values (each byte two values, the
    low nibble first) times 2 ** (their group's scale - 127), transposed to (in, out) as transformers'
    experts hold them. One expert at a time, so that the float32 copy is one expert's, not the layer's."""
    blocks, scales = np.asarray(blocks_ExRxGx16), np.asarray(scales_ExRxG)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16 or blocks.ndim != 4:
        raise CheckpointError(f"{name}: MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                              f"{scales.dtype}{list(scales.shape)} are not uint8 (E, out, in / 32, 16) and "
                              "(E, out, in / 32); the checkpoint is not a gpt-oss MXFP4 one")
    E, R, G, _ = blocks.shape
    out = np.empty((E, G * 32, R), dtype)
    for e in range(E):
        values_RxGx32 = np.empty((R, G, 32), np.float32)
        values_RxGx32[..., 0::2] = _FP4_VALUES[blocks[e] & 0x0F]
        values_RxGx32[..., 1::2] = _FP4_VALUES[blocks[e] >> 4]
        exponents = scales[e].astype(np.int32)[..., None] - _SCALE_BIAS
        out[e] = np.ldexp(values_RxGx32, exponents).reshape(R, G * 32).T
    return out


def _from_checkpoint(cfg, tensors, source="checkpoint"):
    out = dict(tensors)
    for i in cfg.moe_layers:
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            if f"{name}_blocks" not in out:  # unquantised (transformers' names)
                continue
            if f"{name}_scales" not in out:
                raise CheckpointError(f"{source}: tensor {name + '_blocks'!r} has no {name + '_scales'!r}; the "
                                      "checkpoint is incomplete")
            out[name] = dequantize_mxfp4(out.pop(f"{name}_blocks"), out.pop(f"{name}_scales"), cfg.jnp_param_dtype,
                                         f"{source}: {name}")
    return out


FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    config_fields=_config_fields,
    hf_keys=_hf_keys,
    moe_tensors=_moe_tensors,
    from_checkpoint=_from_checkpoint,
)
