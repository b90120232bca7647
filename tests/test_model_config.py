"""ModelConfig <-> Hugging Face config dicts."""

import pytest
import transformers

from jaxrl.models import ModelConfig, ModelConfigError, RopeScaling, YarnScaling
from jaxrl.tiny import tiny_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_through_transformers_config(family, tied):
    cfg = tiny_config(family, tied=tied)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(hf.to_dict()) == cfg


def test_legacy_rope_keys_are_read():
    hf = tiny_config("llama").to_hf()
    del hf["rope_parameters"]
    hf["rope_theta"] = 500000.0
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("scaling", [
    YarnScaling(factor=4.0, original_max_position_embeddings=32768),  # Qwen3's long-context recipe
    YarnScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),  # gpt-oss
    YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                attention_factor=1.25, mscale=1.0, mscale_all_dim=0.5),
])
def test_yarn_round_trips_through_transformers_config(scaling):
    cfg = tiny_config("qwen3", rope_scaling=scaling, max_position_embeddings=131072)
    hf = transformers.AutoConfig.for_model(**cfg.to_hf()).to_dict()
    assert hf["rope_parameters"]["rope_type"] == "yarn"
    assert ModelConfig.from_hf(hf) == cfg


def test_yarn_reads_legacy_keys_and_defaults_the_factor_as_transformers_does():
    hf = tiny_config("qwen3").to_hf() | {"max_position_embeddings": 131072}
    del hf["rope_parameters"]
    hf["rope_theta"] = 1e6
    hf["rope_scaling"] = {"type": "yarn", "factor": None, "original_max_position_embeddings": 32768,
                          "beta_fast": None}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=32768, beta_fast=32.0)
    del hf["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(ModelConfigError, match="yarn rope scaling lacks 'original_max_position_embeddings'"):
        ModelConfig.from_hf(hf)


def test_qwen2_always_has_qkv_bias_and_llama_bias_follows_attention_bias():
    assert ModelConfig.from_hf(tiny_config("qwen2").to_hf()).qkv_bias
    hf = tiny_config("llama").to_hf() | {"attention_bias": True}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qkv_bias and cfg.o_bias


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model_type": "mistral"}, "model_type 'mistral' .* not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_bad_configs_name_the_key(change, message):
    hf = tiny_config("qwen2").to_hf() | change
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(hf, source="model/config.json")


def test_missing_key_is_named():
    hf = tiny_config("qwen3").to_hf()
    del hf["hidden_size"]
    with pytest.raises(ModelConfigError, match="missing required key 'hidden_size'"):
        ModelConfig.from_hf(hf)


def test_bad_dtype_is_named():
    with pytest.raises(ModelConfigError, match=r"dtype='float8'.*allowed"):
        tiny_config("qwen3", dtype="float8")


@pytest.mark.parametrize("change, message", [
    ({"router_scoring": "sigmoid"}, r"router_scoring='sigmoid'; allowed: \['softmax', 'topk_softmax'\]"),
    ({"expert_activation": "gelu"}, r"expert_activation='gelu'; allowed: \['silu_glu', 'clamped_swiglu'\]"),
    ({"sliding_layers": (0,)}, "sliding_window=0 must be >= 1 with sliding layers"),
    ({"sliding_layers": (2,), "sliding_window": 8}, r"sliding_layers=\(2,\) must be layers of 0..1"),
])
def test_bad_moe_and_attention_fields_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message):
        tiny_config("qwen3_moe", **change)


def test_gpt_oss_reads_transformers_config_and_its_defaults():
    hf = transformers.GptOssConfig().to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.sliding_window, cfg.sliding_layers) == (128, tuple(range(0, 36, 2)))
    assert (cfg.rope_theta, cfg.rope_scaling) == (150000.0, YarnScaling(32.0, 4096, truncate=False))
    assert cfg.qkv_bias and cfg.o_bias and cfg.attention_sinks and cfg.router_bias and cfg.expert_bias
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers) == (
        128, 4, 2880, tuple(range(36)))
    assert (cfg.router_scoring, cfg.expert_activation, cfg.swiglu_limit, cfg.swiglu_alpha) == (
        "topk_softmax", "clamped_swiglu", 7.0, 1.702)
    # A config.json without the keys whose defaults are gpt-oss's own reads as transformers reads it.
    bare = {k: v for k, v in hf.items() if k not in ("attention_bias", "rope_parameters", "layer_types")}
    assert ModelConfig.from_hf(bare) == cfg
    assert ModelConfig.from_hf(hf | {"sliding_window": None}).sliding_layers == ()


def test_gpt_oss_configs_that_cannot_be_expressed_are_named():
    hf = tiny_config("gpt_oss").to_hf()
    with pytest.raises(ModelConfigError, match=r"layer_types must give one of .* for each of the 2 layers"):
        ModelConfig.from_hf(hf | {"layer_types": ["sliding_attention"]})
    with pytest.raises(ModelConfigError, match=r"layer_types must give one of"):
        ModelConfig.from_hf(hf | {"layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ModelConfigError, match=r"intermediate_size=128 cannot be expressed as a gpt_oss config"):
        tiny_config("gpt_oss", intermediate_size=128).to_hf()
    with pytest.raises(ModelConfigError, match=r"router_scoring='softmax' cannot be expressed"):
        tiny_config("gpt_oss", router_scoring="softmax").to_hf()
