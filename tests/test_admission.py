"""Snapshot admission, the one check every engine runs before it takes new weights: what it lets
through (each family's whole weights, adapters) and each refusal, in one line saying what to do."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from bridge.engines.admission import ARCHITECTURE_FIELDS, admit, check
from bridge.engines.base import SnapshotRefused
from jaxrl.models import Decoder
from jaxrl.models.hf import hf_shapes
from jaxrl.models.lora import LoraConfig, adapter_config, adapter_shapes, add_lora
from jaxrl.snapshots import Snapshot, SnapshotWriter
from jaxrl.tiny import tiny_config

CFG = tiny_config("qwen3")
MOE_CFG = tiny_config("qwen3_moe")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
              "norm_topk_prob")
OSS_CFG = tiny_config("gpt_oss")
OSS_FIELDS = ("attention_sinks", "sliding_window", "sliding_layers", "router_scoring", "router_bias", "expert_bias",
              "expert_activation", "swiglu_limit", "swiglu_alpha")
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))


def whole(cfg=CFG, **changes) -> Snapshot:
    tensors = {name: np.zeros(shape, np.float32) for name, shape in hf_shapes(cfg).items()}
    return Snapshot(3, cfg.to_hf(), tensors, "snaps/3", **changes)


def adapters(lora=LORA) -> Snapshot:
    tensors = {name: np.zeros(shape, np.float32) for name, shape in adapter_shapes(CFG, lora).items()}
    return Snapshot(3, CFG.to_hf(), tensors, "snaps/3", adapter_config(lora))


def refusal(snapshot: Snapshot, served=CFG, lora=None) -> str:
    with pytest.raises(SnapshotRefused) as e:
        check(snapshot, served, lora)
    message = str(e.value)
    assert message.startswith("snaps/3") and "\n" not in message, message
    return message


@pytest.mark.parametrize("family, changes", [
    ("qwen3", {}), ("qwen2", {}), ("llama", {"tied": False, "qkv_bias": True, "o_bias": True, "mlp_bias": True}),
    ("qwen3_moe", {"mlp_only_layers": (0,)}),
    ("gpt_oss", {"tied": False}),
], ids=["qwen3-qk-norm", "qwen2-qkv-bias", "llama-untied-biases", "qwen3-moe", "gpt-oss"])
def test_each_familys_published_weights_are_admitted(family, changes, tmp_path):
    cfg = tiny_config(family, **changes)
    params = nnx.state(Decoder(cfg, nnx.Rngs(0)), nnx.Param)
    SnapshotWriter(tmp_path, cfg, dtype="bfloat16").publish(params, 5)
    snapshot = admit(str(tmp_path), 5, cfg, None)
    assert snapshot.version == 5 and set(snapshot.tensors) == set(hf_shapes(cfg))


def test_published_adapters_are_admitted(tmp_path):
    state = nnx.state(add_lora(Decoder(CFG, nnx.Rngs(0)), LORA), nnx.LoRAParam)
    SnapshotWriter(tmp_path, CFG, lora=LORA).publish(state, 2)
    assert set(admit(str(tmp_path), 2, CFG, LORA).tensors) == set(adapter_shapes(CFG, LORA))


def test_a_missing_version_or_directory_is_refused(tmp_path):
    SnapshotWriter(tmp_path / "snaps", CFG).publish(nnx.state(Decoder(CFG, nnx.Rngs(0)), nnx.Param), 1)
    with pytest.raises(SnapshotRefused, match=r"no finished snapshot with version 9 \(have \[1\]\)"):
        admit(str(tmp_path / "snaps"), 9, CFG, None)
    with pytest.raises(SnapshotRefused, match="snapshot directory does not exist"):
        admit(str(tmp_path / "nowhere"), 1, CFG, None)


def _changed(base, field: str):
    value = getattr(base, field)
    if isinstance(value, bool):
        return not value
    return {"model_type": "llama", "num_kv_heads": 1, "num_experts_per_tok": 1, "mlp_only_layers": (1,),
            "sliding_layers": (1,), "router_scoring": "softmax", "expert_activation": "silu_glu"}.get(
        field, value * 2 if isinstance(value, (int, float)) else value)


@pytest.mark.parametrize("field", ARCHITECTURE_FIELDS)
def test_another_architecture_is_refused(field):
    base = MOE_CFG if field in MOE_FIELDS else OSS_CFG if field in OSS_FIELDS else CFG
    served = dataclasses.replace(base, **{field: _changed(base, field)})
    message = refusal(whole(base), served)
    assert f"{field} {getattr(base, field)} (serving {getattr(served, field)})" in message
    assert message.endswith("publish weights of the model this bridge serves")


def test_a_manifest_config_jaxrl_cannot_read_is_refused():
    snapshot = dataclasses.replace(whole(), hf_config={**CFG.to_hf(), "model_type": "gpt2"})
    assert "model_type 'gpt2'" in refusal(snapshot)


def test_adapters_and_whole_weights_are_not_confused():
    assert refusal(whole(), lora=LORA) == (
        "snaps/3: holds whole weights, but this engine serves adapters; start the bridge without the run's lora "
        "launch setting")
    assert refusal(adapters()) == (
        "snaps/3: holds LoRA adapters, but this engine serves whole weights; start the bridge with the run's lora "
        "launch setting")


def test_adapters_of_another_rank_or_kind_are_refused():
    other = LoraConfig(rank=8, alpha=8.0, targets=LORA.targets)
    assert "adapters of rank 8, alpha 8.0 on ['q_proj', 'v_proj']; this engine serves rank 4" in refusal(
        adapters(other), lora=LORA)
    snapshot = dataclasses.replace(adapters(), adapter_config={**adapter_config(LORA), "use_dora": True})
    assert "LoRA settings jaxrl does not apply: {'use_dora': True}" in refusal(snapshot, lora=LORA)


def test_missing_or_unexpected_tensors_are_refused():
    snapshot = whole()
    del snapshot.tensors["model.norm.weight"]
    snapshot.tensors["model.extra.weight"] = np.zeros(3, np.float32)
    assert ("missing ['model.norm.weight'], unexpected ['model.extra.weight']" in refusal(snapshot))
    short = adapters()
    del short.tensors[next(iter(short.tensors))]
    assert "missing ['base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight']" in refusal(short, lora=LORA)


def test_a_tensor_of_another_shape_or_dtype_is_refused():
    snapshot = whole()
    snapshot.tensors["model.norm.weight"] = np.zeros(65, np.float32)
    assert "tensor 'model.norm.weight' has shape (65,), not the served (64,)" in refusal(snapshot)
    snapshot = whole()
    snapshot.tensors["model.norm.weight"] = np.zeros(64, np.int32)
    assert refusal(snapshot) == ("snaps/3: tensor 'model.norm.weight' is int32; publish weights as one of "
                                 "['bfloat16', 'float16', 'float32']")
