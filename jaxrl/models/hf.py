"""Hugging Face checkpoints: config.json + safetensors (single file or sharded index) <-> Decoder.

`hf_names` is the one mapping between jaxrl parameter paths and Hugging Face tensor names (transformers'
own, experts stacked per layer); weight snapshots for the bridge use it too, so any engine can load them
without knowing jaxrl's tree. A family's checkpoint layout on disk (one tensor per expert) is converted
where files are read and written (`Family.from_checkpoint` / `to_checkpoint`).
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.flax import save_file

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.families import FAMILIES
from jaxrl.models.family import CheckpointError

SINGLE_FILE = "model.safetensors"
SCORE_HEAD = "score.weight"  # a sequence-classification checkpoint's head: (num_labels, hidden), no bias
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_layout(x, transposed: bool):
    """A parameter in Hugging Face's layout (or back): the last two axes swapped where `transposed`."""
    return x.swapaxes(-1, -2) if transposed else x


def hf_names(cfg: ModelConfig) -> Iterator[tuple[str, tuple, bool]]:
    """(HF tensor name, jaxrl state path, transposed) for every parameter of the model; `transposed`: the
    last two axes are swapped (`hf_layout`)."""
    family = FAMILIES[cfg.model_type]
    yield "model.embed_tokens.weight", ("embed_tokens",), False
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{pre}.{norm}.weight", ("layers", i, norm, "weight"), False
        projs = [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if cfg.is_moe(i):
            for name, path, transposed in family.moe_tensors(cfg, pre):
                yield name, ("layers", i, *path), transposed
        else:
            projs += [("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]
        for block, proj in projs:
            yield f"{pre}.{block}.{proj}.weight", ("layers", i, block, proj, "kernel"), True
            has_bias = (
                cfg.mlp_bias if block == "mlp" else cfg.o_bias if proj == "o_proj" else cfg.qkv_bias
            )
            if has_bias:
                yield f"{pre}.{block}.{proj}.bias", ("layers", i, block, proj, "bias"), False
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                yield f"{pre}.self_attn.{norm}.weight", ("layers", i, "self_attn", norm, "weight"), False
        if cfg.attention_sinks:
            yield f"{pre}.self_attn.sinks", ("layers", i, "self_attn", "sinks"), False
    yield "model.norm.weight", ("norm", "weight"), False
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head",), True


def projection_shape(cfg: ModelConfig, proj: str) -> tuple[int, int]:
    """(in, out) features of the projection `proj` (q_proj, ..., down_proj) of every layer."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}[proj]


@functools.lru_cache(maxsize=16)
def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape in HF's layout} of every parameter, from the config alone."""
    params = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    return {name: _hf_shape(_lookup(params, path).shape, transposed) for name, path, transposed in hf_names(cfg)}


def _hf_shape(shape, transposed: bool) -> tuple[int, ...]:
    shape = tuple(shape)
    return (*shape[:-2], shape[-1], shape[-2]) if transposed else shape


def _lookup(state, path):
    for key in path:
        state = state[key]
    return state


def to_hf_tensors(cfg: ModelConfig, params: nnx.State, dtype=None) -> dict[str, jax.Array]:
    """Flat {HF name: array} in HF layout (out, in), optionally cast to `dtype`."""
    out = {}
    for name, path, transposed in hf_names(cfg):
        value = hf_layout(_lookup(params, path)[...], transposed)
        out[name] = value if dtype is None else value.astype(dtype)
    return out


def from_hf_tensors(
    cfg: ModelConfig, tensors: Mapping[str, jax.Array | np.ndarray], source: str = "tensors"
) -> Decoder:
    """Builds a Decoder from a flat {HF name: array} mapping without random initialisation."""
    model = nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    expected = {name for name, _, _ in hf_names(cfg)}
    unexpected = sorted(
        n for n in tensors
        if n not in expected
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        raise CheckpointError(
            f"{source}: tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} are not part "
            f"of a {cfg.model_type} model with this config.json; is the config for this checkpoint?"
        )
    for name, path, transposed in hf_names(cfg):
        param = _lookup(params, path)
        want = tuple(param.shape)
        if name not in tensors:
            raise CheckpointError(
                f"{source}: tensor {name!r} is missing (expected shape {want} for "
                f"{cfg.model_type}); the checkpoint is incomplete or its config.json does not match"
            )
        value = tensors[name]
        got = _hf_shape(value.shape, transposed)
        if got != want:
            hf_want = _hf_shape(want, transposed)
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(value.shape)}, expected {hf_want} "
                f"from config.json"
            )
        value = jnp.asarray(value, cfg.jnp_param_dtype)
        param.set_value(hf_layout(value, transposed))
    nnx.update(model, params)
    return model


def _key(entry) -> str | int:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


@functools.lru_cache(maxsize=16)
def _slots(cfg: ModelConfig, treedef) -> tuple[tuple[str, int, bool], ...]:
    """(HF name, leaf position, transposed) of every parameter, for params flattened to `treedef`."""
    paths = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves)))[0]
    position = {tuple(_key(k) for k in path if _key(k) != "value"): i for path, i in paths}
    slots = []
    for name, path, transposed in hf_names(cfg):
        if path not in position:
            raise CheckpointError(f"the params have no {'/'.join(map(str, path))} for {name!r}")
        slots.append((name, position.pop(path), transposed))
    if position:
        raise CheckpointError(f"params {sorted(map(str, position))[:5]} have no Hugging Face name")
    return tuple(slots)


def params_from_hf_tensors(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], like: nnx.State, source: str = "tensors"
) -> nnx.State:
    """New params shaped, typed and placed like `like` (a Decoder's params), holding `tensors`.

    What `from_hf_tensors` builds, without building a model: one transfer of every tensor onto
    the devices of the param it replaces. `like` is left untouched (it may be in use).
    Raises CheckpointError naming the tensor that is missing, unexpected or of the wrong shape.
    """
    leaves, treedef = jax.tree_util.tree_flatten(like)
    slots = _slots(cfg, treedef)
    if len(tensors) != len(slots) or any(name not in tensors for name, _, _ in slots):
        names = {name for name, _, _ in slots}
        missing, unexpected = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise CheckpointError(f"{source}: tensors differ from a {cfg.model_type} model of this shape (missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]})")
    host = [None] * len(leaves)
    for name, i, transposed in slots:
        old, value = leaves[i], tensors[name]
        want = _hf_shape(old.shape, transposed)
        if tuple(value.shape) != want:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(value.shape)}, expected {want}")
        host[i] = np.asarray(hf_layout(value, transposed), old.dtype)
    placed = jax.device_put(host, [x.sharding for x in leaves])
    return jax.tree_util.tree_unflatten(treedef, placed)


def read_config(path: str | Path) -> dict:
    path = Path(path)
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; give a Hugging Face model directory")
    if not config_file.is_file():
        raise CheckpointError(
            f"{config_file}: missing; a Hugging Face model directory holds config.json and "
            f"safetensors files"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None


def read_safetensors(path: str | Path) -> dict[str, jax.Array]:
    """All tensors of a directory's `model.safetensors` or sharded index."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    tensors = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {INDEX_FILE} but missing")
        try:
            with safe_open(file, framework="flax") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises bare errors for truncated / corrupt headers
            raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None
    return tensors


def read_checkpoint(path: str | Path, cfg: ModelConfig) -> dict:
    """A directory's tensors under `hf_names`' names (its family's checkpoint layout converted)."""
    return FAMILIES[cfg.model_type].from_checkpoint(cfg, read_safetensors(path), str(path))


def load_model_config(path: str | Path, param_dtype: str | None = None, dtype: str | None = None) -> ModelConfig:
    """The config of a Hugging Face model directory, as `load_pretrained` builds its model."""
    cfg = ModelConfig.from_hf(read_config(path), source=str(Path(path) / "config.json"))
    return cfg.replace(**{k: v for k, v in (("param_dtype", param_dtype), ("dtype", dtype)) if v})


def load_pretrained(path: str | Path, param_dtype: str | None = None, dtype: str | None = None) -> Decoder:
    """Loads a Hugging Face model directory; dtypes default to the checkpoint's."""
    cfg = load_model_config(path, param_dtype, dtype)
    return from_hf_tensors(cfg, read_checkpoint(path, cfg), source=str(path))


def load_classifier(path: str | Path, dtype: str | None = None) -> tuple[Decoder, jax.Array]:
    """A Hugging Face sequence-classification directory (transformers' `*ForSequenceClassification`:
    the decoder's tensors under `model.`, a bias-free `score` linear head) as the decoder and the
    head's (D, num_labels) weight: the scores are `hidden(tokens)[last token] @ head`, read at a
    sequence's last real token as transformers reads them at its last non-pad one."""
    hf_config = read_config(path)
    cfg = ModelConfig.from_hf(hf_config, source=str(Path(path) / "config.json"), classifier=True)
    # No LM head: a tied decoder expects none (the classifier never reads logits over the vocabulary).
    cfg = cfg.replace(tie_word_embeddings=True, **({"param_dtype": dtype, "dtype": dtype} if dtype else {}))
    tensors = read_checkpoint(path, cfg)
    head = tensors.pop(SCORE_HEAD, None)
    if head is None:
        raise CheckpointError(f"{path}: no {SCORE_HEAD!r} tensor; a sequence-classification checkpoint "
                              "(*ForSequenceClassification) carries its score head there")
    if head.ndim != 2 or head.shape[1] != cfg.hidden_size:
        raise CheckpointError(f"{path}: {SCORE_HEAD!r} has shape {tuple(head.shape)}, expected (num_labels, "
                              f"{cfg.hidden_size})")
    return from_hf_tensors(cfg, tensors, source=str(path)), jnp.asarray(head, jnp.float32).T


def save_classifier(model: Decoder, head_DxL: jax.Array, path: str | Path) -> None:
    """Writes `model` with the score head `head_DxL` as a sequence-classification directory that
    transformers (`AutoModelForSequenceClassification`) and `load_classifier` load."""
    cfg = model.cfg
    if not cfg.tie_word_embeddings:
        raise ValueError("a classifier's decoder has no LM head: build it with tie_word_embeddings=True")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    labels = head_DxL.shape[1]
    config = {**cfg.to_hf(), "architectures": [FAMILIES[cfg.model_type].classifier],
              "num_labels": labels, "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
              "label2id": {f"LABEL_{i}": i for i in range(labels)}}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {**FAMILIES[cfg.model_type].to_checkpoint(cfg, to_hf_tensors(cfg, nnx.state(model, nnx.Param))),
               SCORE_HEAD: jnp.asarray(head_DxL).T}
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})


def load_tokenizer(path: str | Path):
    """The directory's tokenizer as `AutoTokenizer.from_pretrained` loads it: the class that
    tokenizer_config.json names, imported alone. AutoTokenizer's own import pulls in PyTorch
    where it is installed (~2.5 s of every process's start-up); it is used only for a directory
    that names no class transformers has."""
    import transformers

    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(path, local_files_only=True)


def save_pretrained(
    model: Decoder,
    path: str | Path,
    hf_config: dict | None = None,
    max_shard_bytes: int = 5 << 30,
) -> None:
    """Writes config.json + safetensors (sharded with an index above `max_shard_bytes`).

    With several processes (a model sharded over them) every process calls it: each tensor is
    gathered, and process 0 writes."""
    cfg = model.cfg
    tensors = FAMILIES[cfg.model_type].to_checkpoint(cfg, to_hf_tensors(cfg, nnx.state(model, nnx.Param)))
    if jax.process_count() > 1:
        tensors = {name: multihost_utils.process_allgather(x, tiled=True) for name, x in tensors.items()}
        if jax.process_index() != 0:
            return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # The tensors are written unquantised whatever the source was (gpt-oss's MXFP4 experts): a source's
    # quantization_config would make transformers read them as quantised.
    config = {**{k: v for k, v in (hf_config or {}).items() if k != "quantization_config"}, **cfg.to_hf()}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name, value in tensors.items():
        if size and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    def write(shard, name):
        # transformers refuses files without a known format tag.
        save_file(shard, str(path / name), metadata={"format": "pt"})
        # safetensors writes 0600; a served model must be readable like config.json.
        shutil.copymode(path / "config.json", path / name)

    if len(shards) == 1:
        write(shards[0], SINGLE_FILE)
        (path / INDEX_FILE).unlink(missing_ok=True)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write(shard, name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / SINGLE_FILE).unlink(missing_ok=True)
