"""The train step: the same update on every mesh, accumulation equal to one large batch,
`logp_old` fixed across `num_iterations`, and bad batches refused before compilation."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.learner import Learner
from jaxrl.losses import LossConfig
from jaxrl.models import Decoder
from jaxrl.optim import OptimizerConfig
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig, validate_train_batch

from batches import VOCAB, make_batch

MODEL_CFG = tiny_config("qwen3", tied=False, vocab_size=VOCAB)


BASE = LearnerConfig(
    group_size=4,
    loss=LossConfig(loss_type="dapo", eps_high=0.28, beta=0.02, is_level="token"),
    optimizer=OptimizerConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=1, total_steps=10),
)


def run(cfg, mesh_cfg, devices, steps=3, batches=None):
    learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(mesh_cfg, devices))
    metrics = [learner.update(b) for b in (batches or [make_batch(s) for s in range(steps)])]
    params = jax.tree.map(np.asarray, jax.device_get(learner.state.params))
    return params, metrics, learner


def max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def single_device():
    return run(BASE, MeshConfig(fsdp=1), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh_cfg", [MeshConfig(fsdp=8), MeshConfig(fsdp=4, tp=2), MeshConfig(data=2, fsdp=4)],
    ids=["fsdp8", "fsdp4-tp2", "data2-fsdp4"],
)
def test_sharded_steps_equal_one_device(single_device, mesh_cfg):
    assert len(jax.devices()) >= 8, "conftest.py must provide 8 CPU devices"
    ref_params, ref_metrics, _ = single_device
    params, metrics, learner = run(BASE, mesh_cfg, jax.devices()[:8])
    assert max_diff(params, ref_params) < 1e-5
    for ours, ref in zip(metrics, ref_metrics):
        assert ours["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    # Parameters really are split over the mesh, not replicated.
    kernel = learner.state.params["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    assert kernel.sharding.shard_shape(kernel.shape) != kernel.shape


# Every loss_type accumulates exactly in tests/test_losses.py; here the whole step, for the
# per-sequence (grpo) and the per-token whole-batch (dapo) normalisers.
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gradient_accumulation_equals_one_large_batch(loss_type):
    cfg = dataclasses.replace(BASE, loss=dataclasses.replace(BASE.loss, loss_type=loss_type))
    devices = jax.devices()[:2]
    one, m1, _ = run(cfg, MeshConfig(fsdp=2), devices, steps=2)
    four, m4, _ = run(dataclasses.replace(cfg, grad_accum=4), MeshConfig(fsdp=2), devices, steps=2)
    assert max_diff(one, four) < 1e-5
    for a, b in zip(m1, m4):
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "is_weight_mean", "is_weight_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


def test_num_iterations_keeps_logp_old_from_the_first_pass():
    cfg = dataclasses.replace(
        BASE, num_iterations=3, loss=LossConfig(eps_low=0.01, eps_high=0.01),
        optimizer=OptimizerConfig(learning_rate=3e-2),
    )
    _, metrics, learner = run(cfg, MeshConfig(fsdp=1), jax.devices()[:1], steps=1)
    assert learner.step == 3
    first = metrics[0]
    # The first pass is on-policy (ratio 1: nothing clipped); later passes see the policy move
    # away from the frozen logp_old, which a recomputed logp_old would hide.
    assert first["clip_frac_low"] == 0 and first["clip_frac_high"] == 0
    assert first["last_clip_frac_low"] + first["last_clip_frac_high"] > 0.1


def test_metrics_cover_the_promised_scalars(single_device):
    _, metrics, _ = single_device
    expected = {
        "loss", "policy_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high",
        "is_weight_raw_mean", "is_weight_raw_min", "is_weight_raw_max",
        "is_weight_mean", "is_weight_min", "is_weight_max", "frac_zero_std_groups",
        "grad_norm", "learning_rate", "tokens_per_s",
    }
    assert expected <= set(metrics[0])
    assert metrics[0]["learning_rate"] == 0.0 and metrics[1]["learning_rate"] == pytest.approx(1e-3)
    assert all(np.isfinite(v) for m in metrics for v in m.values())


def _shared_prompt_batch(seed: int) -> dict:
    """make_batch with each group's rows on one prompt, as a GRPO group's samples are."""
    batch = make_batch(seed)
    for key in ("prompt_BxP", "prompt_mask_BxP"):
        batch[key] = np.repeat(batch[key][::BASE.group_size], BASE.group_size, axis=0)
    return batch


def test_groups_sharing_prompts_run_each_prompt_once_to_the_same_step():
    # Against one prompt per row on one device: grouped micro-batches, over a mesh.
    batches = [_shared_prompt_batch(s) for s in range(2)]
    per_row, m_row, learner_row = run(dataclasses.replace(BASE, shared_prompts=False), MeshConfig(fsdp=1),
                                      jax.devices()[:1], batches=batches)
    shared, m_shared, learner = run(dataclasses.replace(BASE, grad_accum=2), MeshConfig(fsdp=2),
                                    jax.devices()[:2], batches=batches)
    assert {g for g, _ in learner_row._step_fns} == {1} and {g for g, _ in learner._step_fns} == {BASE.group_size}
    assert max_diff(shared, per_row) < 1e-5
    for a, b in zip(m_row, m_shared):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # A group whose rows start differently sends the batch down the per-row program.
    learner.update(make_batch(5))
    assert {g for g, _ in learner._step_fns} == {1, BASE.group_size}


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda b: b.update(loss_mask_BxC=b["loss_mask_BxC"][:, :-1]), r"loss_mask_BxC has shape \(16, 7\), expected \(16, 8\)"),
        (lambda b: b.pop("rewards_BxR"), "missing.*rewards_BxR"),
        (lambda b: b.pop("sampler_logp_BxC"), "sampler_logp_BxC.*is_level"),
        (lambda b: b.update(rewards_BxR=b["rewards_BxR"][:14]), r"rewards_BxR has shape \(14, 2\)"),
        (lambda b: b.update(prompt_BxP=b["prompt_BxP"].astype(np.float32)), "prompt_BxP has dtype float32"),
        (lambda b: b.update(completion_mask_BxC=np.zeros_like(b["completion_mask_BxC"])), "loss_mask_BxC is 1 on tokens"),
        (lambda b: b["prompt_mask_BxP"].__setitem__((0, -1), 0), "left-padded"),
        (lambda b: b["rewards_BxR"].__setitem__((3, 0), np.inf), r"infinite at rows \[3\]"),
        (lambda b: b.update(extra=np.zeros(16)), r"unknown keys \['extra'\]"),
    ],
)
def test_bad_batches_are_refused_before_compilation(change, message):
    learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), BASE, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    batch = make_batch()
    change(batch)
    with pytest.raises(ValueError, match=message):
        learner.update(batch)
    assert not learner._step_fns, "nothing may be compiled for a bad batch"


def test_distillation_needs_the_teachers_logprobs_in_the_batch():
    cfg = dataclasses.replace(BASE, loss=dataclasses.replace(BASE.loss, distill_weight=1.0))
    with pytest.raises(ValueError, match=r"teacher_logp_BxC \(needed by loss.distill_weight"):
        validate_train_batch(make_batch(), cfg)


def test_group_size_must_divide_the_batch():
    with pytest.raises(ValueError, match="group_size=3 does not divide the batch size 16"):
        validate_train_batch(make_batch(), dataclasses.replace(BASE, group_size=3))


def test_micro_batches_must_split_over_the_batch_shards():
    with pytest.raises(ValueError, match="grad_accum=4 micro-batches of rows divisible by the 8"):
        validate_train_batch(make_batch(), dataclasses.replace(BASE, grad_accum=4), num_batch_shards=8)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: LossConfig(loss_type="ppo"), "loss_type='ppo' is not one of"),
        (lambda: LearnerConfig(grad_accum=0), r"learner.grad_accum=0 must be an integer >= 1"),
        (lambda: OptimizerConfig(schedule="step"), "schedule='step' is not one of"),
    ],
)
def test_bad_configs_name_the_key(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sft_step_is_the_demonstration_log_likelihood_gradient(grad_accum):
    """No groups or advantages: the loss is -mean log p over loss-masked tokens, and so is its gradient."""
    import jax.numpy as jnp
    import optax

    from jaxrl.logprobs import completion_logprobs

    batch = make_batch(B=16, sampler=False)
    batch["rewards_BxR"] = np.zeros((16, 1), np.float32)  # 16 rows, group_size 3: groups do not apply
    model = Decoder(MODEL_CFG, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    keys = ("prompt_BxP", "prompt_mask_BxP", "completion_BxC", "completion_mask_BxC")

    def nll(params):
        logp, _ = completion_logprobs(nnx.merge(graphdef, params), *(jnp.asarray(batch[k]) for k in keys))
        mask = batch["loss_mask_BxC"]
        return -(logp * mask).sum() / mask.sum()

    want_loss, want_grad = jax.value_and_grad(nll)(params)
    want_loss, want_norm = float(want_loss), float(optax.tree.norm(want_grad))
    cfg = LearnerConfig(group_size=3, grad_accum=grad_accum, loss=LossConfig(loss_type="sft"),
                        optimizer=OptimizerConfig(learning_rate=1e-2))
    learner = Learner(model, cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    first = learner.update(batch)
    assert first["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert "reward_mean" not in first and "clip_frac_low" not in first
    assert learner.update(batch)["loss"] < first["loss"]


MOE_CFG = tiny_config("qwen3_moe", tied=False, vocab_size=VOCAB)
OSS_CFG = tiny_config("gpt_oss", tied=False, vocab_size=VOCAB)


def _moe_batch(model, seed=0):
    """A batch whose routes and sampler logprobs are `model`'s own, as its sampler would record them."""
    import jax.numpy as jnp

    from jaxrl.logprobs import completion_logprobs
    from jaxrl.models import moe, positions_from_mask

    batch = make_batch(seed)
    P = batch["prompt_BxP"].shape[1]
    tokens = jnp.concatenate([batch["prompt_BxP"], batch["completion_BxC"]], 1)
    mask = np.concatenate([batch["prompt_mask_BxP"], batch["completion_mask_BxC"]], 1)
    _, _, routed = model.hidden(tokens, positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask), routed=True)
    experts = model.cfg.num_experts
    routes = np.where(mask[..., None] > 0, np.asarray(routed.own_BxTxU), moe.no_route(experts))
    routes = routes.astype(moe.route_dtype(experts))
    batch["prompt_routes_BxPxU"], batch["completion_routes_BxCxU"] = routes[:, :P], routes[:, P:]
    batch["sampler_logp_BxC"] = np.asarray(completion_logprobs(
        model, batch["prompt_BxP"], batch["prompt_mask_BxP"], batch["completion_BxC"], batch["completion_mask_BxC"])[0])
    return batch


def _perturbed_routers(model, scale):
    """`model` with noise added to every router (what a few updates do between rollout and learning)."""
    rng = np.random.default_rng(1)
    for layer in model.layers:
        w = layer.mlp.router.kernel
        w.set_value(w[...] + scale * rng.normal(size=w.shape).astype(np.float32))
    return model


@pytest.mark.parametrize("pack_tokens", [None, 128], ids=["padded", "packed"])
def test_replay_keeps_the_rollouts_routes_where_a_changed_router_flips_them(pack_tokens):
    model = Decoder(MOE_CFG, nnx.Rngs(0))
    batch = _moe_batch(model)
    cfg = dataclasses.replace(BASE, routing_replay=True, pack_tokens=pack_tokens, loss=LossConfig(loss_type="dapo"))
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    same = Learner(model, cfg, mesh).update(batch)
    # Unchanged weights: the learner routes as the sampler did and computes its logprobs.
    assert same["moe/route_mismatch"] == 0
    assert same["moe/logp_gap_replay"] < 1e-5 and same["moe/logp_gap_own_routes"] < 1e-5

    changed = Learner(_perturbed_routers(Decoder(MOE_CFG, nnx.Rngs(0)), 0.05), cfg, mesh).update(batch)
    assert changed["moe/route_mismatch"] > 0.05  # its own routers would route otherwise...
    # ...and replaying the recorded routes keeps the learner's logprobs near the sampler's.
    assert changed["moe/logp_gap_replay"] < 0.5 * changed["moe/logp_gap_own_routes"]
    off = Learner(_perturbed_routers(Decoder(MOE_CFG, nnx.Rngs(0)), 0.05),
                  dataclasses.replace(cfg, routing_replay=False), mesh).update(batch)
    assert off["moe/route_mismatch"] == pytest.approx(changed["moe/route_mismatch"], abs=0.02)
    assert off["moe/logp_gap_own_routes"] == pytest.approx(changed["moe/logp_gap_own_routes"], rel=1e-4)


def test_the_load_balancing_loss_is_a_weighted_term_of_the_loss():
    model = Decoder(MOE_CFG, nnx.Rngs(0))
    batch = _moe_batch(model)
    mesh = make_mesh(MeshConfig(fsdp=2), jax.devices()[:2])

    def step(coef):
        cfg = dataclasses.replace(BASE, grad_accum=2, router_aux_loss_coef=coef)
        return Learner(Decoder(MOE_CFG, nnx.Rngs(0)), cfg, mesh).update(batch)

    m0, m1 = step(0.0), step(0.5)
    assert m0["loss/router_aux"] > 1.9  # top_k (2) for perfectly balanced routing, more otherwise
    assert m1["loss"] - m0["loss"] == pytest.approx(0.5 * m0["loss/router_aux"], rel=1e-4)
    assert m1["grad_norm"] != m0["grad_norm"]  # the term has a gradient (small: routing is near balanced)


def test_routing_replay_needs_the_rollouts_routes():
    with pytest.raises(ValueError, match="learner.routing_replay needs the rollouts' routes"):
        validate_train_batch(make_batch(0), dataclasses.replace(BASE, routing_replay=True))


@pytest.mark.parametrize("model_cfg, mesh_cfg", [
    (MOE_CFG, MeshConfig(fsdp=1, expert=8)), (MOE_CFG, MeshConfig(fsdp=2, expert=4)),
    (MOE_CFG, MeshConfig(data=2, expert=2, tp=2)),
    (OSS_CFG, MeshConfig(fsdp=2, expert=4)),  # the experts' biases split with them; sinks over tp
], ids=["ep8", "fsdp2-ep4", "data2-ep2-tp2", "gpt-oss-fsdp2-ep4"])
def test_an_expert_sharded_step_equals_the_one_device_step(model_cfg, mesh_cfg):
    model = Decoder(model_cfg, nnx.Rngs(0))
    batches = [_moe_batch(model, seed) for seed in range(2)]
    cfg = dataclasses.replace(BASE, routing_replay=True, router_aux_loss_coef=0.01)

    def run_moe(mesh_cfg, devices):
        learner = Learner(Decoder(model_cfg, nnx.Rngs(0)), cfg, make_mesh(mesh_cfg, devices))
        metrics = [learner.update(b) for b in batches]
        return jax.tree.map(np.asarray, jax.device_get(learner.state.params)), metrics, learner

    ref_params, ref_metrics, _ = run_moe(MeshConfig(fsdp=1), jax.devices()[:1])
    params, metrics, learner = run_moe(mesh_cfg, jax.devices()[:8])
    assert max_diff(params, ref_params) < 1e-5
    for ours, ref in zip(metrics, ref_metrics):
        for key in ("loss", "grad_norm", "loss/router_aux", "moe/route_mismatch", "moe/logp_gap_own_routes"):
            assert ours[key] == pytest.approx(ref[key], abs=1e-5), key
    gate_up = learner.state.params["layers"][0]["mlp"]["gate_up"][...]
    assert gate_up.sharding.shard_shape(gate_up.shape)[0] == model_cfg.num_experts // mesh_cfg.expert
