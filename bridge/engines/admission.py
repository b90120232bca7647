"""Admission of new weights: the one check a snapshot passes before any engine serves it.

Every engine takes snapshots through `admit`, so what one engine refuses no other serves. A
snapshot is read and verified (its checksums), then judged against the served model alone, not
an engine's own tree or files: its architecture (the config fields that decide which tensors
exist and their shapes), adapters or whole weights as the engine was started, the adapters'
rank, alpha and targets, and every tensor's name, shape and dtype. A refused snapshot leaves the
old weights serving.
"""

from __future__ import annotations

from bridge.engines.base import SnapshotRefused
from jaxrl.models import ModelConfig
from jaxrl.models.config import DTYPES
from jaxrl.models.hf import hf_shapes
from jaxrl.models.lora import LoraConfig, LoraError, adapter_shapes, config_from_peft
from jaxrl.snapshots import Snapshot, SnapshotError, SnapshotReader

_FIX = "publish weights of the model this bridge serves"
# Config fields that decide which tensors a model has and their shapes, or how its blocks use them (the
# engine computes with its own config): a snapshot must agree on all.
ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
    "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
    "attention_sinks", "sliding_window", "sliding_layers",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    "norm_topk_prob", "router_scoring", "router_bias", "expert_bias", "expert_activation", "swiglu_limit",
    "swiglu_alpha",
)


def admit(path: str, version: int, served: ModelConfig, lora: LoraConfig | None) -> Snapshot:
    """Snapshot `version` under `path`, read, verified and fit for an engine serving `served` with
    `lora`'s adapters (None: whole weights); SnapshotRefused otherwise."""
    try:
        snapshot = SnapshotReader(path).load(version)
    except SnapshotError as e:
        raise SnapshotRefused(str(e)) from e
    check(snapshot, served, lora)
    return snapshot


def check(snapshot: Snapshot, served: ModelConfig, lora: LoraConfig | None) -> None:
    """SnapshotRefused, in one line saying what is wrong and what to do, unless an engine serving
    `served` with `lora`'s adapters (None: whole weights) can take `snapshot`."""
    where = snapshot.path
    try:
        theirs = ModelConfig.from_hf(snapshot.hf_config, source=f"{where} manifest")
    except ValueError as e:
        raise SnapshotRefused(str(e)) from e
    differing = [f"{k} {getattr(theirs, k)} (serving {getattr(served, k)})"
                 for k in ARCHITECTURE_FIELDS if getattr(theirs, k) != getattr(served, k)]
    if differing:
        raise SnapshotRefused(f"{where}: another model's weights ({', '.join(differing)}); {_FIX}")
    holds_adapters = snapshot.adapter_config is not None
    if holds_adapters != (lora is not None):
        raise SnapshotRefused(
            f"{where}: holds {'LoRA adapters' if holds_adapters else 'whole weights'}, but this engine serves "
            f"{'adapters' if lora else 'whole weights'}; start the bridge "
            f"{'with' if holds_adapters else 'without'} the run's lora launch setting")
    if lora is not None:
        _check_adapters(snapshot, lora)
    _check_tensors(snapshot, adapter_shapes(served, lora) if lora else hf_shapes(served))


def _check_adapters(snapshot: Snapshot, lora: LoraConfig) -> None:
    try:
        theirs = config_from_peft(snapshot.adapter_config, f"{snapshot.path} adapter_config")
    except LoraError as e:
        raise SnapshotRefused(str(e)) from e
    if (theirs.rank, theirs.alpha, theirs.targets) != (lora.rank, lora.alpha, lora.targets):
        raise SnapshotRefused(
            f"{snapshot.path}: adapters of rank {theirs.rank}, alpha {theirs.alpha} on {list(theirs.targets)}; "
            f"this engine serves rank {lora.rank}, alpha {lora.alpha} on {list(lora.targets)}: match the run's lora")


def _check_tensors(snapshot: Snapshot, want: dict[str, tuple[int, ...]]) -> None:
    tensors, where = snapshot.tensors, snapshot.path
    missing, unexpected = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    if missing or unexpected:
        raise SnapshotRefused(f"{where}: tensors differ from the served model's (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); {_FIX}")
    for name, shape in want.items():
        x = tensors[name]
        if tuple(x.shape) != shape:
            raise SnapshotRefused(f"{where}: tensor {name!r} has shape {tuple(x.shape)}, not the served {shape}; "
                                  f"{_FIX}")
        if str(x.dtype) not in DTYPES:
            raise SnapshotRefused(f"{where}: tensor {name!r} is {x.dtype}; publish weights as one of {sorted(DTYPES)}")
