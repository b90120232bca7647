"""LoRA adapters: PEFT's function and names, sharding with their base weights, the learner training
them alone (base bitwise unchanged, no optimiser state for it, no compile after the first step)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.compilation import programs
from jaxrl.learner import Learner
from jaxrl.losses import LossConfig
from jaxrl.models import Decoder, from_hf_tensors, positions_from_mask, to_hf_tensors
from jaxrl.models.lora import (LoraConfig, LoraError, adapter_config, adapter_tensors, add_lora,
                               check_adapter_tensors, config_from_peft, merged_tensors, training_mode)
from jaxrl.optim import OptimizerConfig
from jaxrl.sharding import MeshConfig, make_mesh, param_shardings
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig

from batches import VOCAB, make_batch

MODEL_CFG = tiny_config("qwen3", tied=False, vocab_size=VOCAB)
LORA = LoraConfig(rank=4, alpha=8.0)


def _logits(model, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((3, 10), np.int32)
    mask[1, :4] = 0
    tokens = jnp.asarray(rng.integers(0, VOCAB, (3, 10)) * mask)
    return np.asarray(model(tokens, positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))[0])


def _randomised(model, seed=1):
    """Adapters with nonzero B (a fresh adapter's B is zero), as training leaves them."""
    adapters = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(seed)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype), adapters))
    return model


def test_fresh_adapters_change_nothing():
    base = _logits(Decoder(MODEL_CFG, nnx.Rngs(0)))
    assert np.array_equal(_logits(add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), LORA)), base)


def test_adapters_compute_the_merged_model():
    model = _randomised(add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), LORA))
    tensors = adapter_tensors(MODEL_CFG, LORA, nnx.state(model, nnx.LoRAParam))
    check_adapter_tensors(MODEL_CFG, LORA, tensors, "test")
    base = {k: np.asarray(v) for k, v in to_hf_tensors(MODEL_CFG, nnx.state(model, nnx.Param)).items()}
    merged = from_hf_tensors(MODEL_CFG, merged_tensors(MODEL_CFG, LORA, base, tensors))
    ours, theirs = _logits(model), _logits(merged)
    assert np.abs(ours - _logits(Decoder(MODEL_CFG, nnx.Rngs(0)))).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_peft_names_and_shapes():
    model = add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), LoraConfig(rank=4, targets=("q_proj", "down_proj")))
    tensors = adapter_tensors(MODEL_CFG, LoraConfig(rank=4, targets=("q_proj", "down_proj")),
                              nnx.state(model, nnx.LoRAParam))
    d, q, f = MODEL_CFG.hidden_size, MODEL_CFG.num_heads * MODEL_CFG.head_dim, MODEL_CFG.intermediate_size
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, d)
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape == (q, 4)
    assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, f)
    assert len(tensors) == 2 * 2 * MODEL_CFG.num_layers
    with pytest.raises(LoraError, match="missing"):
        check_adapter_tensors(MODEL_CFG, LORA, tensors, "snap")


def test_adapter_config_round_trip_and_refusals():
    assert config_from_peft(adapter_config(LORA), "x") == LORA
    for bad, match in (({"use_rslora": True}, "use_rslora"), ({"bias": "all"}, "bias"),
                       ({"peft_type": "IA3"}, "peft_type"), ({"target_modules": ["c_attn"]}, "c_attn")):
        with pytest.raises(LoraError, match=match):
            config_from_peft({**adapter_config(LORA), **bad}, "x")


@pytest.mark.parametrize("change,match", [
    (dict(rank=0), "learner.lora.rank=0 must be an integer >= 1"),
    (dict(alpha=0), "learner.lora.alpha"),
    (dict(targets=("q_proj", "lm_head")), "has no projection 'lm_head'"),
    (dict(targets=()), "list distinct"),
    (dict(dropout=1.0), "learner.lora.dropout"),
])
def test_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**change)


def test_adapters_of_another_rank_are_refused():
    model = add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), LORA)
    with pytest.raises(LoraError, match="rank 4, not learner.lora.rank=8"):
        add_lora(model, LoraConfig(rank=8))


def test_dropout_only_in_training_mode():
    cfg = LoraConfig(rank=4, dropout=0.5)
    model = _randomised(add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg))
    plain = _logits(model)
    assert np.array_equal(_logits(model), plain)  # deterministic by default
    training_mode(model, jax.random.key(3))
    dropped = _logits(model)
    assert np.abs(dropped - plain).max() > 1e-3


def test_adapters_shard_with_their_base_weights():
    mesh = make_mesh(MeshConfig(fsdp=4, tp=2), jax.devices()[:8])
    model = add_lora(Decoder(MODEL_CFG, nnx.Rngs(0)), LORA)
    shardings = param_shardings(nnx.state(model, nnx.Param), mesh)
    q = shardings["layers"][0]["self_attn"]["q_proj"]
    down = shardings["layers"][0]["mlp"]["down_proj"]

    def spec(var):
        return tuple(var.get_value().spec)

    assert spec(q["kernel"]) == ("fsdp", "tp")
    assert spec(q["lora"]["a"]) == ("fsdp", None) and spec(q["lora"]["b"]) == (None, "tp")
    assert spec(down["lora"]["a"]) == ("tp", None) and spec(down["lora"]["b"]) == (None, "fsdp")


CFG = LearnerConfig(group_size=4, lora=LORA,
                    loss=LossConfig(loss_type="dapo", beta=0.02, is_level="token"),
                    optimizer=OptimizerConfig(learning_rate=1e-2))


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=1), MeshConfig(fsdp=4, tp=2)], ids=["one", "fsdp4-tp2"])
def test_learner_trains_adapters_only(mesh_cfg):
    devices = jax.devices()[:1] if mesh_cfg.fsdp == 1 else jax.devices()[:8]
    base_before = _host(nnx.state(Decoder(MODEL_CFG, nnx.Rngs(0)), nnx.Param))
    learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), CFG, make_mesh(mesh_cfg, devices))
    adapters_before = _host(learner.state.params)
    metrics = learner.update(make_batch(0))
    after_first = programs()
    for seed in (1, 2):
        metrics = learner.update(make_batch(seed))
    assert programs() == after_first  # LoRA adds no program after the first step
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    # Only adapters are trained; the optimiser's moments are theirs alone.
    paths = [tuple(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(learner.state.params)]
    assert len(paths) == 2 * 7 * MODEL_CFG.num_layers
    assert all(p[-2:] in (("a", "value"), ("b", "value"), ("lora", "a"), ("lora", "b")) or "lora" in p for p in paths)
    moments = [x for x in jax.tree.leaves(learner.state.opt_state) if x.ndim == 2]
    assert len(moments) == 2 * len(jax.tree.leaves(learner.state.params))
    after = _host(learner.state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(adapters_before)))
    # The base is bitwise as loaded.
    frozen = _host(nnx.state(learner.model(), lambda path, v: type(v) is nnx.Param))
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(base_before)):
        assert np.array_equal(x, y)


def test_lora_steps_equal_on_every_mesh():
    # A small rate: Adam turns a last-bit difference of a near-zero gradient into up to 2 x lr.
    cfg = dataclasses.replace(CFG, optimizer=OptimizerConfig(learning_rate=1e-4))
    one = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    eight = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(data=2, fsdp=4), jax.devices()[:8]))
    for seed in range(2):
        a, b = one.update(make_batch(seed)), eight.update(make_batch(seed))
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    for x, y in zip(jax.tree.leaves(_host(one.state.params)), jax.tree.leaves(_host(eight.state.params))):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_dropout_draws_repeat():
    cfg = dataclasses.replace(CFG, lora=LoraConfig(rank=4, dropout=0.3))

    def losses():
        learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
        return [learner.update(make_batch(0))["loss"] for _ in range(2)]

    first = losses()
    assert first == losses()  # the same steps draw the same masks


def test_an_moe_models_mlps_take_no_adapters_said_in_one_line():
    moe = tiny_config("qwen3_moe", vocab_size=VOCAB)
    with pytest.raises(LoraError, match=r"targets has gate_proj, up_proj, down_proj: a mixture-of-experts model's "
                                        r"MLPs take no adapters; target its attention"):
        add_lora(Decoder(moe, nnx.Rngs(0)), LORA)
    attention = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    model = _randomised(add_lora(Decoder(moe, nnx.Rngs(0)), attention))
    assert np.abs(_logits(model) - _logits(Decoder(moe, nnx.Rngs(0)))).max() > 1e-3
