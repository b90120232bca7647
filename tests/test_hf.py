"""Hugging Face checkpoint loading and saving: round trips, sharded indexes, and bad directories."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy

from jaxrl.models import (
    CheckpointError,
    Decoder,
    ModelConfigError,
    from_hf_tensors,
    load_classifier,
    load_pretrained,
    load_tokenizer,
    params_from_hf_tensors,
    save_classifier,
    save_pretrained,
    to_hf_tensors,
)
from jaxrl.models.hf import read_safetensors
from jaxrl.sharding import MeshConfig, make_mesh, param_shardings
from jaxrl.tiny import tiny_config
from jaxrl.tiny_tokenizer import build_tokenizer


def _tensors(path):
    """{name: (dtype string, raw bytes)} of every safetensors file in a directory."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                out[key] = (str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()
                            if t.dtype == torch.bfloat16 else t.numpy().tobytes())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3_moe", False),
                                         ("gpt_oss", False)])
def test_hf_to_jaxrl_to_hf_is_bit_exact(tmp_path, family, tied, dtype):
    cfg = tiny_config(family, tied=tied, vocab_size=300)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf()))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p))
    hf.to(dtype).save_pretrained(tmp_path / "src")

    model = load_pretrained(tmp_path / "src")
    assert model.cfg.param_dtype == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    save_pretrained(model, tmp_path / "dst")
    assert _tensors(tmp_path / "src") == _tensors(tmp_path / "dst")

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    for (name, a), (_, b) in zip(hf.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def _mxfp4(w_ExIxO, rng):
    """`w` quantised as gpt-oss's released checkpoints store it: per expert (out, in) rows of groups of 32
    values, each value a 4-bit code of E2M1 (two a byte, the even one in the low nibble) and each group a
    power-of-two scale biased by 127. Random codes and scales, so every code and nibble order counts."""
    E, I, O = w_ExIxO.shape
    codes = rng.integers(0, 16, (E, O, I // 32, 32), dtype=np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = rng.integers(127 - 8, 127 + 3, (E, O, I // 32), dtype=np.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_experts_load_as_transformers_dequantises_them_and_export_unquantised(tmp_path, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = tiny_config("gpt_oss", tied=False, vocab_size=300)
    tensors = {k: np.asarray(v) for k, v in to_hf_tensors(cfg, nnx.state(Decoder(cfg, nnx.Rngs(0)), nnx.Param)).items()}
    rng, want = np.random.default_rng(0), {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _mxfp4(tensors.pop(name), rng)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        want[name] = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales),
                                                dtype=getattr(torch, dtype))
    (tmp_path / "src").mkdir()
    config = {**cfg.to_hf(), "dtype": dtype, "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    save_numpy(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})

    model = load_pretrained(tmp_path / "src")
    params = nnx.state(model, nnx.Param)
    for i in range(cfg.num_layers):
        for name, ours in ((f"model.layers.{i}.mlp.experts.gate_up_proj", params["layers"][i]["mlp"]["gate_up"]),
                           (f"model.layers.{i}.mlp.experts.down_proj", params["layers"][i]["mlp"]["down"])):
            assert ours[...].dtype == np.dtype(dtype) and ours[...].shape == tuple(want[name].shape), name
            np.testing.assert_array_equal(np.asarray(ours[...], np.float32), want[name].float().numpy(), err_msg=name)

    save_pretrained(model, tmp_path / "dst", hf_config=config)
    assert "quantization_config" not in json.loads((tmp_path / "dst" / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=getattr(torch, dtype))
    for name, w in want.items():
        assert torch.equal(hf.state_dict()[name], w), name

    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_numpy(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.down_proj_blocks' has no "
                                              r"'model.layers.1.mlp.experts.down_proj_scales'"):
        load_pretrained(tmp_path / "src")


def test_sharded_checkpoint_round_trip_and_transformers_load(tmp_path):
    cfg = tiny_config("qwen3", tied=False, vocab_size=300)
    model = Decoder(cfg, nnx.Rngs(0))
    save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()

    again = load_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(a, b)

    for file in tmp_path.glob("*.safetensors"):
        assert file.stat().st_mode & 0o777 == (tmp_path / "config.json").stat().st_mode & 0o777
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = hf(ids).logits.numpy()
    ours, _ = model(ids.numpy(), np.arange(5)[None], np.ones((1, 5), np.int32))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)


def test_dtype_overrides_on_load(tmp_path):
    save_pretrained(Decoder(tiny_config("llama", vocab_size=300), nnx.Rngs(0)), tmp_path)
    model = load_pretrained(tmp_path, param_dtype="bfloat16", dtype="bfloat16")
    assert model.embed_tokens[...].dtype == np.dtype("bfloat16")
    assert model.cfg.dtype == "bfloat16"


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_pretrained(tmp_path / "nope")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelConfigError, match=r"model_type 'gpt2'.*not supported.*llama.*qwen2.*qwen3"):
        load_pretrained(tmp_path)


def test_unsupported_rope_is_a_clear_error(tmp_path):
    hf = tiny_config("qwen3").to_hf()
    hf["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ModelConfigError, match="rope type 'longrope' is not supported"):
        load_pretrained(tmp_path)


def test_wrong_shape_and_missing_tensor_name_file_and_tensor(tmp_path):
    save_pretrained(Decoder(tiny_config("qwen3", vocab_size=300), nnx.Rngs(0)), tmp_path)
    tensors = {k: np.asarray(v) for k, v in read_safetensors(tmp_path).items()}
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.zeros((7, 64), np.float32)
    save_numpy(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{tmp_path}.*{name}.*shape \(7, 64\), expected \(128, 64\)"):
        load_pretrained(tmp_path)

    del tensors[name]
    save_numpy(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*missing.*expected shape"):
        load_pretrained(tmp_path)


def test_corrupt_safetensors_file_is_a_clear_error(tmp_path):
    save_pretrained(Decoder(tiny_config("qwen3", vocab_size=300), nnx.Rngs(0)), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read as safetensors"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("family,tied,sharded", [("llama", False, True), ("qwen2", True, False),
                                                 ("qwen3_moe", False, True)])
def test_params_from_hf_tensors_are_from_hf_tensors_placed_like_the_old_ones(family, tied, sharded):
    """What the bridge swaps in: the model from_hf_tensors builds, in the served params' structure,
    dtype and shardings, with the served params left as they were."""
    cfg = tiny_config(family, tied=tied, vocab_size=300)
    old = nnx.state(Decoder(cfg, nnx.Rngs(0)), nnx.Param)
    if sharded:
        old = jax.device_put(old, param_shardings(old, make_mesh(MeshConfig(fsdp=4, tp=2))))
    old_values = [np.array(x) for x in jax.tree.leaves(old)]
    # bfloat16 tensors into float32 params, as a bfloat16 snapshot into a float32 engine.
    tensors = {k: np.asarray(v) for k, v in
               to_hf_tensors(cfg, nnx.state(Decoder(cfg, nnx.Rngs(1)), nnx.Param), jax.numpy.bfloat16).items()}
    new = params_from_hf_tensors(cfg, tensors, old)
    want = nnx.state(from_hf_tensors(cfg, tensors), nnx.Param)
    assert jax.tree.structure(new) == jax.tree.structure(old) == jax.tree.structure(want)
    for path, x in jax.tree_util.tree_leaves_with_path(new):
        [[_, w]], [[_, o]] = [[(p, v) for p, v in jax.tree_util.tree_leaves_with_path(t) if p == path]
                              for t in (want, old)]
        assert x.dtype == o.dtype == np.float32 and x.sharding == o.sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(w), err_msg=str(path))
    for before, after in zip(old_values, jax.tree.leaves(old)):
        np.testing.assert_array_equal(before, np.asarray(after))

    name = "model.layers.1.self_attn.q_proj.weight"
    with pytest.raises(CheckpointError, match=rf"snap: tensor '{name}' has shape \(7, 64\), expected \(128, 64\)"):
        params_from_hf_tensors(cfg, {**tensors, name: np.zeros((7, 64), np.float32)}, old, "snap")
    with pytest.raises(CheckpointError, match=rf"snap: tensors differ .* \(missing \['{name}'\], unexpected \[\]\)"):
        params_from_hf_tensors(cfg, {k: v for k, v in tensors.items() if k != name}, old, "snap")
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['model.extra'\]"):
        params_from_hf_tensors(cfg, {**tensors, "model.extra": tensors[name]}, old, "snap")


def test_load_tokenizer_is_autotokenizers_without_importing_torch(tmp_path):
    build_tokenizer(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "<|im_start|>user\nguess 17<|im_end|>"
    code = ("import sys; from jaxrl.models import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "print(type(t).__name__, t.encode(sys.argv[2]), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), text], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == f"{type(auto).__name__} {auto.encode(text)} False"
    # A class transformers does not have: AutoTokenizer decides, as it would.
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "NoSuchTokenizer"}))
    fallback = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(load_tokenizer(tmp_path)) is type(fallback)


def test_a_classification_checkpoint_loads_only_as_a_classifier(tmp_path):
    cfg = tiny_config("qwen3", tied=True, vocab_size=300)
    model = Decoder(cfg, nnx.Rngs(0))
    head = np.arange(cfg.hidden_size, dtype=np.float32)[:, None]
    save_classifier(model, head, tmp_path / "rm")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    np.testing.assert_array_equal(hf.score.weight.detach().numpy(), head.T)

    again, again_head = load_classifier(tmp_path / "rm")
    np.testing.assert_array_equal(again_head, head)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ModelConfigError, match=r"architectures \['Qwen3ForSequenceClassification'\] is not "
                                               r"'Qwen3ForCausalLM'"):
        load_pretrained(tmp_path / "rm")  # never a policy without its LM head

    save_pretrained(model, tmp_path / "lm")
    with pytest.raises(ModelConfigError, match=r"architectures \['Qwen3ForCausalLM'\] is not "
                                               r"'Qwen3ForSequenceClassification'"):
        load_classifier(tmp_path / "lm")
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no 'score.weight' tensor; a sequence-classification checkpoint"):
        load_classifier(tmp_path / "lm")
