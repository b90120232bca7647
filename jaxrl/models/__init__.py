"""Llama / Qwen2 / Qwen3 / Qwen3-MoE / gpt-oss decoders in Flax NNX and their Hugging Face checkpoints."""

from jaxrl.models.config import ModelConfig, ModelConfigError, RopeScaling, YarnScaling
from jaxrl.models.decoder import LOGICAL_AXIS_RULES, Decoder, KVCache, positions_from_mask
from jaxrl.models.hf import (
    CheckpointError,
    from_hf_tensors,
    hf_names,
    load_classifier,
    load_pretrained,
    load_tokenizer,
    params_from_hf_tensors,
    save_classifier,
    save_pretrained,
    to_hf_tensors,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "CheckpointError",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "RopeScaling",
    "YarnScaling",
    "from_hf_tensors",
    "hf_names",
    "load_classifier",
    "load_pretrained",
    "load_tokenizer",
    "params_from_hf_tensors",
    "positions_from_mask",
    "save_classifier",
    "save_pretrained",
    "to_hf_tensors",
]
