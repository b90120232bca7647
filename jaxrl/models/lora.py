"""Low-rank adapters (LoRA) on the decoder's projections, in Hugging Face PEFT's names and layout.

`add_lora` gives each target projection `W` (in, out) two factors, `a` (in, r) and `b` (r, out),
and the projection computes `x W + (alpha / r) (dropout(x) a) b`, PEFT's LoRA exactly: `a` starts
as PEFT's Kaiming-uniform draw and `b` at zero, so a fresh adapter leaves the model unchanged. The
factors are `nnx.LoRAParam`s (a kind of `nnx.Param`): `nnx.split(model, nnx.LoRAParam, ...)` parts
what trains from the frozen base. They carry the logical axes of their base weight's input (`a`)
and output (`b`), so they shard with it on the mesh, and stay float32 whatever `model.dtype` is:
Adam's updates of small factors need the precision (they are tiny beside the base).

Adapters travel as PEFT writes them: `adapter_config.json` (`adapter_config`) and tensors named
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (r, in) / `lora_B.weight` (out, r)
(`adapter_tensors`), which `peft.PeftModel.from_pretrained` and vLLM's LoRA requests load.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder, Linear, matmul_2d
from jaxrl.models.hf import projection_shape
from jaxrl.options import option

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper around the transformers model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_DTYPE = jnp.float32


class LoraError(ValueError):
    """Adapters that do not fit the model or cannot be read: names the source and what differs."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = option("adapter rank r", default=16)
    alpha: float = option("the adapters' product is scaled by alpha / rank (PEFT's lora_alpha)", default=32.0)
    targets: tuple[str, ...] = option(
        f"projections that get adapters (of {', '.join(TARGETS)})", default=TARGETS)
    dropout: float = option(
        "dropout on the adapters' input in the learner's gradient pass (PEFT's lora_dropout); generation and "
        "the old and reference logprobs never drop", default=0.0)

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"learner.lora.rank={self.rank!r} must be an integer >= 1 (16 is usual)")
        if not self.alpha > 0:
            raise ValueError(f"learner.lora.alpha={self.alpha!r} must be > 0 (the scale is alpha / rank)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"learner.lora.targets={list(self.targets)!r}: the model has no projection "
                             f"{unknown[0]!r}; list distinct ones of {', '.join(TARGETS)}" if unknown else
                             f"learner.lora.targets={list(self.targets)!r}: list distinct ones of {', '.join(TARGETS)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora.dropout={self.dropout!r} must be in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRA(nnx.Module):
    """The adapter of one projection: `(alpha / r) (dropout(x) a) b`."""

    def __init__(self, d_in: int, d_out: int, axes: tuple, cfg: LoraConfig, rngs: nnx.Rngs):
        bound = 1 / math.sqrt(d_in)  # PEFT's kaiming_uniform_(a=sqrt(5)) on lora_A
        a = jax.random.uniform(rngs.params(), (d_in, cfg.rank), _DTYPE, -bound, bound)
        self.a = nnx.LoRAParam(a, out_sharding=(axes[0], None), eager_sharding=False)
        self.b = nnx.LoRAParam(jnp.zeros((cfg.rank, d_out), _DTYPE), out_sharding=(None, axes[1]),
                               eager_sharding=False)
        self.scale, self.dropout = cfg.scale, cfg.dropout
        # None unless `training_mode` set it: only the learner's gradient pass drops.
        self.dropout_key = nnx.data(None)

    def __call__(self, x):
        if self.dropout and self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1 - self.dropout, x.dtype), 0)
        h = matmul_2d(x, self.a[...].astype(x.dtype))
        return matmul_2d(h, self.b[...].astype(x.dtype)) * jnp.asarray(self.scale, x.dtype)


def _projection(model: Decoder, layer: int, target: str) -> Linear:
    return getattr(getattr(model.layers[layer], BLOCKS[target]), target)


def check_targets(model_cfg: ModelConfig, cfg: LoraConfig) -> None:
    """LoraError unless every target is a projection the model has adapters for: an MoE model's MLPs take
    none (PEFT refuses adapters on MLP projections of a model whose experts transformers fuses)."""
    mlp = [t for t in cfg.targets if BLOCKS[t] == "mlp"]
    if model_cfg.num_experts and mlp:
        raise LoraError(f"learner.lora.targets has {', '.join(mlp)}: a mixture-of-experts model's MLPs take no "
                        "adapters; target its attention (q_proj, k_proj, v_proj, o_proj)")


def add_lora(model: Decoder, cfg: LoraConfig) -> Decoder:
    """`model` with adapters on `cfg.targets` (in place; returned), drawn from a fixed seed: the same
    model gets the same adapters, in every process and run. Projections that have adapters already
    (a warm start's) keep them; adapters of another rank are an error."""
    check_targets(model.cfg, cfg)
    rngs = nnx.Rngs(params=0)
    for layer in range(model.cfg.num_layers):
        for target in cfg.targets:
            linear = _projection(model, layer, target)
            if linear.lora is not None:
                if linear.lora.a.shape[1] != cfg.rank:
                    raise LoraError(f"layer {layer} {target} has adapters of rank {linear.lora.a.shape[1]}, "
                                    f"not learner.lora.rank={cfg.rank}")
                continue
            d_in, d_out = linear.kernel.shape
            axes = linear.kernel.get_metadata()["out_sharding"]
            linear.lora = nnx.data(LoRA(d_in, d_out, axes, cfg, rngs))
    return model


def training_mode(model: Decoder, key: jax.Array) -> None:
    """Switches the adapters' dropout on, each adapter drawing from its own fold of `key` (for one
    gradient pass of the learner, on a model merged for it)."""
    adapters = [m for _, m in nnx.iter_modules(model) if isinstance(m, LoRA)]
    for i, adapter in enumerate(adapters):
        adapter.dropout_key = nnx.data(jax.random.fold_in(key, i))


def peft_names(model_cfg: ModelConfig, cfg: LoraConfig) -> Iterator[tuple[str, tuple]]:
    """(PEFT tensor name, the factor's path in the adapters' state) of every adapter factor."""
    for i in range(model_cfg.num_layers):
        for target in cfg.targets:
            module = f"{PEFT_PREFIX}model.layers.{i}.{BLOCKS[target]}.{target}"
            path = ("layers", i, BLOCKS[target], target, "lora")
            yield f"{module}.lora_A.weight", (*path, "a")
            yield f"{module}.lora_B.weight", (*path, "b")


def adapter_tensors(model_cfg: ModelConfig, cfg: LoraConfig, adapters: nnx.State, dtype=None) -> dict:
    """{PEFT name: factor in PEFT's (out, in) layout}, optionally cast to `dtype`."""
    out = {}
    for name, path in peft_names(model_cfg, cfg):
        value = functools.reduce(operator.getitem, path, adapters)[...].T
        out[name] = value if dtype is None else value.astype(dtype)
    return out


def adapter_config(cfg: LoraConfig, base_model: str | None = None) -> dict:
    """PEFT's `adapter_config.json` for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": list(cfg.targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
        "inference_mode": True, "init_lora_weights": True,
    }


def config_from_peft(config: Mapping, source: str) -> LoraConfig:
    """The LoraConfig of a PEFT `adapter_config.json` dict; LoraError for what jaxrl cannot serve."""
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{source}: peft_type {config.get('peft_type')!r} is not 'LORA'")
    unsupported = {k: config[k] for k in ("use_rslora", "use_dora", "fan_in_fan_out") if config.get(k)}
    unsupported |= {k: config[k] for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
                    if config.get(k)}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise LoraError(f"{source}: LoRA settings jaxrl does not apply: {unsupported}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    try:
        return LoraConfig(rank=config["r"], alpha=config["lora_alpha"], targets=tuple(targets or ()),
                          dropout=config.get("lora_dropout") or 0.0)
    except (KeyError, ValueError, TypeError) as e:
        raise LoraError(f"{source}: not an adapter config jaxrl can serve ({e})") from None


def adapter_shapes(model_cfg: ModelConfig, cfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """{PEFT name: shape} of every adapter factor of `cfg` on this model."""
    shapes = {}
    for name, path in peft_names(model_cfg, cfg):
        d_in, d_out = projection_shape(model_cfg, path[3])
        shapes[name] = (cfg.rank, d_in) if path[-1] == "a" else (d_out, cfg.rank)
    return shapes


def check_adapter_tensors(model_cfg: ModelConfig, cfg: LoraConfig, tensors: Mapping, source: str) -> None:
    """LoraError unless `tensors` are exactly the adapters of `cfg` on this model, shaped as PEFT's."""
    want = adapter_shapes(model_cfg, cfg)
    missing, unexpected = sorted(want.keys() - tensors.keys()), sorted(tensors.keys() - want.keys())
    if missing or unexpected:
        raise LoraError(f"{source}: adapter tensors differ from rank-{cfg.rank} adapters on {list(cfg.targets)} of "
                        f"this {model_cfg.num_layers}-layer model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise LoraError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")


def merged_tensors(model_cfg: ModelConfig, cfg: LoraConfig, base: Mapping[str, np.ndarray],
                   adapters: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face tensors of the base model with the adapters merged in: W + scale * B @ A for
    every target, computed in float32 and cast back to W's dtype (PEFT's `merge_and_unload`)."""
    out = dict(base)
    for i in range(model_cfg.num_layers):
        for target in cfg.targets:
            module = f"model.layers.{i}.{BLOCKS[target]}.{target}"
            a = np.asarray(adapters[f"{PEFT_PREFIX}{module}.lora_A.weight"], np.float32)
            b = np.asarray(adapters[f"{PEFT_PREFIX}{module}.lora_B.weight"], np.float32)
            w = base[f"{module}.weight"]
            out[f"{module}.weight"] = (np.asarray(w, np.float32) + np.float32(cfg.scale) * (b @ a)).astype(w.dtype)
    return out


def with_adapters(model_cfg: ModelConfig, cfg: LoraConfig, tensors: Mapping[str, np.ndarray], like: nnx.State,
                  source: str) -> nnx.State:
    """New model state holding `like`'s base arrays (shared, not copied) and the adapters `tensors`
    (PEFT-named), each placed and typed like the adapter it replaces; `like` is left untouched (it
    may be in use). LoraError when they are not this model's adapters."""
    check_adapter_tensors(model_cfg, cfg, tensors, source)
    state = jax.tree.map(lambda x: x, like)  # new Variables over the same arrays
    factors = [(functools.reduce(operator.getitem, path, state), name) for name, path in peft_names(model_cfg, cfg)]
    host = [np.asarray(tensors[name], var[...].dtype).T for var, name in factors]
    placed = jax.device_put(host, [var[...].sharding for var, _ in factors])
    for (var, _), value in zip(factors, placed):
        var.set_value(value)
    return state
