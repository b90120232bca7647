"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention; an MoE block in every `decoder_sparse_step`-th
layer but `mlp_only_layers` (a dense MLP of `intermediate_size` there): a bias-free softmax router
(`mlp.gate`) and `num_experts` SwiGLU experts of `moe_intermediate_size`.

Checkpoints hold one tensor per expert (`mlp.experts.{j}.gate_proj.weight`, ...); transformers' model and
jaxrl's names stack them per layer (`mlp.experts.gate_up_proj` (E, 2I, D), gate rows first, and
`mlp.experts.down_proj` (E, D, I))."""

from __future__ import annotations

from jaxrl.models.family import Family, require, stack_experts

_PIECES = ("gate_proj", "up_proj", "down_proj")


def _config_fields(hf, source):
    return dict(
        # transformers 5 writes num_local_experts; released checkpoints num_experts
        num_experts=require(hf, "num_experts", source, "num_local_experts"),
        num_experts_per_tok=require(hf, "num_experts_per_tok", source),
        moe_intermediate_size=require(hf, "moe_intermediate_size", source),
        decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def _hf_keys(cfg):
    return {"attention_bias": cfg.o_bias, "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
            "norm_topk_prob": cfg.norm_topk_prob}


def _moe_tensors(cfg, prefix):
    yield f"{prefix}.mlp.gate.weight", ("mlp", "router", "kernel"), True
    yield f"{prefix}.mlp.experts.gate_up_proj", ("mlp", "gate_up"), True
    yield f"{prefix}.mlp.experts.down_proj", ("mlp", "down"), True


def _from_checkpoint(cfg, tensors, source="checkpoint"):
    out = dict(tensors)
    for i in cfg.moe_layers:
        experts = f"model.layers.{i}.mlp.experts"
        if f"{experts}.gate_up_proj" in out:  # already stacked (transformers' in-memory names)
            continue
        out[f"{experts}.gate_up_proj"] = stack_experts(out, experts, cfg.num_experts, _PIECES[:2], source)
        out[f"{experts}.down_proj"] = stack_experts(out, experts, cfg.num_experts, _PIECES[2:], source)
        for j in range(cfg.num_experts):
            for piece in _PIECES:
                del out[f"{experts}.{j}.{piece}.weight"]
    return out


def _to_checkpoint(cfg, tensors):
    out = dict(tensors)
    f = cfg.moe_intermediate_size
    for i in cfg.moe_layers:
        experts = f"model.layers.{i}.mlp.experts"
        gate_up, down = out.pop(f"{experts}.gate_up_proj"), out.pop(f"{experts}.down_proj")
        for j in range(cfg.num_experts):
            out[f"{experts}.{j}.gate_proj.weight"] = gate_up[j, :f]
            out[f"{experts}.{j}.up_proj.weight"] = gate_up[j, f:]
            out[f"{experts}.{j}.down_proj.weight"] = down[j]
    return out


FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    qk_norm=True,
    config_fields=_config_fields,
    hf_keys=_hf_keys,
    moe_tensors=_moe_tensors,
    from_checkpoint=_from_checkpoint,
    to_checkpoint=_to_checkpoint,
)
