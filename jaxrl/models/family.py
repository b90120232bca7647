"""What makes one model family: its Hugging Face config.json keys, its tensor names, its block pieces.

A family is one module of `jaxrl/models/families/` holding one `Family`; `families.FAMILIES` lists them.
The decoder reads only `ModelConfig` fields; a family decides them from config.json (`config_fields`)
and writes them back (`hf_keys`). Tensor names are transformers' own (a model's `state_dict()` keys,
experts stacked as one tensor per layer): weight snapshots and `hf_names` use them. A checkpoint on disk
may lay tensors out otherwise (one tensor per expert, quantised experts): `from_checkpoint` and
`to_checkpoint` convert at the file's edge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jaxrl.models.config import ModelConfig, ModelConfigError

Tensors = Mapping[str, Any]  # name -> array (numpy or jax)


def _none(*_args) -> dict:
    return {}


def _same(_cfg, tensors: Tensors, _source: str = "") -> Tensors:
    return tensors


@dataclasses.dataclass(frozen=True)
class Family:
    """One family. The callables default to "nothing beyond the dense Llama layout"."""

    model_type: str
    architecture: str  # transformers' causal LM class, as config.json's `architectures` names it
    qkv_bias: bool = False  # q/k/v always carry a bias (others follow `attention_bias`)
    qk_norm: bool = False  # q and k are RMS-normed per head before RoPE
    # config.json -> the ModelConfig fields this family sets beyond the common ones (or instead of them)
    config_fields: Callable[[Mapping[str, Any], str], dict] = _none
    # ModelConfig -> the config.json keys this family writes beyond the common ones
    hf_keys: Callable[[ModelConfig], dict] = _none
    # (HF name, path under the layer's `mlp`, transposed) of an MoE layer's tensors, given the layer's prefix
    moe_tensors: Callable[[ModelConfig, str], Iterator[tuple[str, tuple, bool]]] | None = None
    # checkpoint tensors as files hold them (and the file's name, for errors) <-> the names of `hf_names`
    from_checkpoint: Callable[..., Tensors] = _same
    to_checkpoint: Callable[[ModelConfig, Tensors], Tensors] = _same

    @property
    def classifier(self) -> str:
        return self.architecture.replace("ForCausalLM", "ForSequenceClassification")


def require(hf: Mapping[str, Any], key: str, source: str, *alternatives: str):
    """config.json's `key` (or the first of `alternatives` present); ModelConfigError naming it if absent."""
    for name in (key, *alternatives):
        if hf.get(name) is not None:
            return hf[name]
    raise ModelConfigError(f"{source}: missing required key {key!r}")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: names the file, the tensor and the fix."""


def stack_experts(tensors: Tensors, prefix: str, experts: int, pieces: tuple[str, ...], source: str) -> np.ndarray:
    """`{prefix}.{j}.{piece}.weight` for every expert j, each piece's experts stacked (E, out, in) and the
    pieces concatenated along `out`: one tensor per expert as checkpoints hold them -> one per layer."""
    parts = []
    for piece in pieces:
        names = [f"{prefix}.{j}.{piece}.weight" for j in range(experts)]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise CheckpointError(f"{source}: tensor {missing[0]!r} is missing (expected {experts} experts from "
                                  "config.json); the checkpoint is incomplete or its config.json does not match")
        parts.append(np.stack([np.asarray(tensors[n]) for n in names]))
    return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
