"""Packed batches: every real token laid out once with its own positions and segment, the same
logprobs, gradients and metrics as the padded batch for every loss, and one compiled program
whatever the episodes' lengths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.learner import Learner
from jaxrl.logprobs import completion_logprobs, packed_logprobs
from jaxrl.losses import LossConfig
from jaxrl.models import Decoder
from jaxrl.models.decoder import packed_windows, prefix_window
from jaxrl.models.lora import LoraConfig
from jaxrl.optim import OptimizerConfig
from jaxrl.packing import max_micro_batches, pack
from jaxrl.sharding import MeshConfig, make_mesh, put_batch
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig, init_state, train_step

from batches import VOCAB

MODEL_CFG = tiny_config("qwen3", vocab_size=VOCAB, num_layers=2)


def episodes(seed=0, B=8, P=12, C=40, long_rows=(), shared=()):
    """Rows of random prompt and completion lengths (completions of `long_rows` fill C); the groups
    of four rows numbered in `shared` have one prompt."""
    rng = np.random.default_rng(seed)
    prompt_len, completion_len = rng.integers(1, P + 1, B), rng.integers(1, C // 2, B)
    completion_len[list(long_rows)] = C
    for g in shared:
        prompt_len[4 * g:4 * g + 4] = P  # long: laying it out once is the cheaper layout
    pmask = (np.arange(P)[None] >= P - prompt_len[:, None]).astype(np.int32)
    cmask = (np.arange(C)[None] < completion_len[:, None]).astype(np.int32)
    loss_mask = cmask * (rng.random((B, C)) < 0.8)  # tool results: context, not trained on
    rewards = rng.normal(size=(B, 1)).astype(np.float32)
    prompts = rng.integers(0, VOCAB, (B, P))
    for g in shared:
        prompts[4 * g:4 * g + 4] = prompts[4 * g]
    return {"prompt_BxP": (prompts * pmask).astype(np.int32), "prompt_mask_BxP": pmask,
            "completion_BxC": (rng.integers(0, VOCAB, (B, C)) * cmask).astype(np.int32),
            "completion_mask_BxC": cmask, "loss_mask_BxC": loss_mask.astype(np.int32), "rewards_BxR": rewards,
            "sampler_logp_BxC": (-3 + 0.3 * rng.normal(size=(B, C)) * cmask).astype(np.float32),
            "teacher_logp_BxC": (-4 + 0.5 * rng.normal(size=(B, C)) * cmask).astype(np.float32)}


def test_every_real_token_is_laid_out_once_with_its_own_positions_and_segment():
    batch = episodes(B=8, long_rows=(5,))
    batch["completion_mask_BxC"][2] = batch["loss_mask_BxC"][2] = 0  # a padding row: nothing to lay out
    packed = pack(batch, pack_tokens=128, rows=2)
    tokens, positions, segments, target = (packed[k].reshape(-1, 128) for k in
                                           ("tokens_MxRxL", "positions_MxRxL", "segments_MxRxL", "target_MxRxL"))
    assert packed["tokens_MxRxL"].shape == (max_micro_batches(8, 2), 2, 128)
    B, C = batch["completion_BxC"].shape
    for b in range(B):
        prompt = batch["prompt_BxP"][b][batch["prompt_mask_BxP"][b] == 1]
        completion = batch["completion_BxC"][b][batch["completion_mask_BxC"][b] == 1]
        where = np.argwhere((target >= b * C) & (target < (b + 1) * C))
        if b == 2:
            assert len(where) == 0
            continue
        r, first = where[0]
        assert (where[:, 0] == r).all() and (np.diff(where[:, 1]) == 1).all()
        start = first - len(prompt)
        segment = tokens[r, start:first + len(completion)]
        assert segment.tolist() == prompt.tolist() + completion.tolist()
        assert positions[r, start:first + len(completion)].tolist() == list(range(len(segment)))
        assert len(set(segments[r, start:first + len(completion)])) == 1 and segments[r, start] > 0
        assert (target[r, first:first + len(completion)] - b * C).tolist() == list(range(len(completion)))
    # The longest episode opens the first row: micro-batches run longest first.
    assert (target[0] // C == 5).any()
    real = sum(batch["prompt_mask_BxP"][b].sum() + batch["completion_mask_BxC"][b].sum() for b in range(B) if b != 2)
    assert (segments > 0).sum() == real
    assert packed["micro_batches"] == -(-len(np.unique(np.argwhere(segments > 0)[:, 0])) // 2)


def test_a_group_that_shares_its_prompt_lays_it_out_once_before_its_completions():
    batch = episodes(B=8, P=96, shared=(0,))  # rows 0-3 share a prompt; 4-7 have their own
    packed = pack(batch, pack_tokens=256, rows=1, group_size=4)
    tokens, positions, segments, prefix, target = (packed[k].reshape(-1, 256) for k in
                                                   ("tokens_MxRxL", "positions_MxRxL", "segments_MxRxL",
                                                    "prefix_MxRxL", "target_MxRxL"))
    B, C = batch["completion_BxC"].shape
    prompt = batch["prompt_BxP"][0][batch["prompt_mask_BxP"][0] == 1]
    p = len(prompt)
    heads = np.argwhere(positions == 0)  # where each unit starts: the shared prompt's first token
    for b in range(B):
        completion = batch["completion_BxC"][b][batch["completion_mask_BxC"][b] == 1]
        r, first = np.argwhere((target >= b * C) & (target < (b + 1) * C))[0]
        own = segments[r, first]
        if b < 4:  # the prompt's last token opens the completion's segment; the rest is the group's
            assert tokens[r, first - 1] == prompt[-1] and segments[r, first - 1] == own
            seen = prefix[r, first]
            assert seen != own and (prefix[r, segments[r] == own] == seen).all()
            [[_, start]] = [h for h in heads if h[0] == r and segments[r, h[1]] == seen]
            assert tokens[r, start:start + p - 1].tolist() == prompt[:-1].tolist()
            assert (segments[r, start:start + p - 1] == seen).all()
            assert positions[r, first - 1:first + len(completion)].tolist() == list(range(p - 1, p + len(completion)))
        else:
            assert (prefix[r, segments[r] == own] == own).all()
        assert tokens[r, first:first + len(completion)].tolist() == completion.tolist()
    real = sum(batch["prompt_mask_BxP"][b].sum() + batch["completion_mask_BxC"][b].sum() for b in range(B))
    assert (segments > 0).sum() == real - 3 * (p - 1)  # the prompt once for four episodes, less one token each


@pytest.mark.parametrize("group_size", [1, 4])
def test_an_moe_batchs_routes_go_where_their_tokens_go(group_size):
    batch = episodes(B=8, P=96, shared=(0,))

    def route_of(tokens):  # each token's route, a function of the token: where tokens go, so must routes
        return np.stack([tokens % 7, tokens % 5 + 1], -1).astype(np.uint8)

    batch["prompt_routes_BxPxU"] = np.where(batch["prompt_mask_BxP"][..., None] > 0, route_of(batch["prompt_BxP"]), 255)
    batch["completion_routes_BxCxU"] = np.where(batch["completion_mask_BxC"][..., None] > 0,
                                                route_of(batch["completion_BxC"]), 255).astype(np.uint8)
    last = batch["completion_mask_BxC"][6].sum() - 1
    batch["completion_routes_BxCxU"][6, last] = 255  # a token never fed: no recorded route
    packed = pack(batch, pack_tokens=256, rows=1, group_size=group_size)
    tokens, segments, target = (packed[k].reshape(-1, 256) for k in ("tokens_MxRxL", "segments_MxRxL", "target_MxRxL"))
    routes = packed["routes_MxRxLxU"].reshape(-1, 256, 2)
    assert routes.dtype == np.uint8
    C = batch["completion_BxC"].shape[1]
    never_fed = target == 6 * C + last
    real = (segments > 0) & ~never_fed
    np.testing.assert_array_equal(routes[real], route_of(tokens[real]))
    assert (routes[~real] == 255).all()


def test_a_group_too_long_for_a_row_is_split_each_part_with_its_prompt():
    batch = episodes(B=4, P=48, C=100, long_rows=(0, 1, 2, 3), shared=(0,))  # 4 x 100 completion tokens
    packed = pack(batch, pack_tokens=256, rows=1, group_size=4)
    segments, prefix = packed["segments_MxRxL"].reshape(-1, 256), packed["prefix_MxRxL"].reshape(-1, 256)
    p = int(batch["prompt_mask_BxP"][0].sum())
    assert packed["micro_batches"] == 2  # two completions (and the prompt) a row
    for r in range(2):
        assert len(set(prefix[r][segments[r] > 0])) == 1 and (segments[r] > 0).sum() == p - 1 + 2 * 101


def test_a_group_lays_its_prompt_out_once_only_where_that_is_the_cheaper_layout():
    def shared(batch, pack_tokens):
        packed = pack(batch, pack_tokens, rows=1, group_size=4)
        return bool((packed["prefix_MxRxL"] != packed["segments_MxRxL"]).any())

    # Long prompts, short completions: fewer rows at the same window.
    assert shared(episodes(B=8, P=48, shared=(0, 1)), 128)
    # Long completions: the same rows, but each block reads the group's prompt besides its window.
    assert not shared(episodes(B=8, P=12, C=100, long_rows=range(8), shared=(0, 1)), 512)


def test_each_micro_batch_attends_over_the_smallest_window_that_holds_its_longest_episode():
    batch = episodes(B=16, P=8, C=200, long_rows=(0,))
    packed = pack(batch, pack_tokens=512, rows=1)
    windows = packed_windows(512)
    assert windows == (128, 256, 512)
    lengths = batch["prompt_mask_BxP"].sum(1) + batch["completion_mask_BxC"].sum(1)
    assert windows[packed["window_M"][0]] >= lengths.max() + 63 > windows[packed["window_M"][0] - 1]
    last = packed["micro_batches"] - 1
    assert packed["window_M"][last] < packed["window_M"][0]


def test_an_episode_longer_than_a_packed_row_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"an episode of \d+ tokens .* learner.pack_tokens=128; raise it"):
        pack(episodes(P=12, C=200, long_rows=(1,)), pack_tokens=128, rows=1)


@pytest.mark.parametrize("pack_tokens,rows,group_size", [(128, 1, 1), (512, 2, 1), (128, 1, 4), (512, 2, 4)])
def test_packed_logprobs_equal_the_padded_ones(pack_tokens, rows, group_size):
    model = Decoder(MODEL_CFG, nnx.Rngs(0))
    batch = episodes(B=12, P=48, long_rows=(3,), shared=(0, 2))
    batch["prompt_mask_BxP"][4:8], batch["prompt_BxP"][4:8] = 0, 0  # group 1: one prompt token, shared
    batch["prompt_mask_BxP"][4:8, -1], batch["prompt_BxP"][4:8, -1] = 1, 7
    ref, _ = completion_logprobs(model, batch["prompt_BxP"], batch["prompt_mask_BxP"], batch["completion_BxC"],
                                 batch["completion_mask_BxC"])
    _assert_packed_logprobs_equal(model, batch, ref, pack(batch, pack_tokens, rows, group_size=group_size))


def _assert_packed_logprobs_equal(model, batch, ref, packed):
    B, C = batch["completion_BxC"].shape
    ours = np.zeros(B * C + 1)
    for m in range(int(packed["micro_batches"])):
        logp, _ = packed_logprobs(model, *(packed[k][m] for k in ("tokens_MxRxL", "positions_MxRxL",
                                                                   "segments_MxRxL", "prefix_MxRxL", "window_M")))
        np.add.at(ours, packed["target_MxRxL"][m][:, 1:].ravel(), np.asarray(logp).ravel())
    mask = batch["completion_mask_BxC"]
    np.testing.assert_allclose(ours[:B * C].reshape(B, C) * mask, np.asarray(ref) * mask, atol=2e-5)


def test_completions_beyond_their_window_still_see_their_whole_shared_prompt():
    model = Decoder(MODEL_CFG, nnx.Rngs(0))
    batch = episodes(B=8, P=48, C=100, long_rows=range(8), shared=(0, 1))  # groups of 47 + 4 x 101 tokens
    packed = pack(batch, pack_tokens=1024, rows=1, group_size=4)
    window = packed_windows(1024)[packed["window_M"][0]]
    assert (window, prefix_window(window, 1024)) == (256, 64)  # a group spans 451 tokens: not its window
    segments, prefix = packed["segments_MxRxL"][0, 0], packed["prefix_MxRxL"][0, 0]
    last = np.flatnonzero((prefix != segments) & (segments > 0))[-1]
    prompt = np.flatnonzero(segments == prefix[last])
    assert prompt[0] > (segments[:prompt[0]] > 0).sum()  # the second group, after the gap that aligns it
    assert (last // 64 + 1) * 64 - window > prompt[-1]  # its prompt lies before its last block's window
    ref, _ = completion_logprobs(model, batch["prompt_BxP"], batch["prompt_mask_BxP"], batch["completion_BxC"],
                                 batch["completion_mask_BxC"])
    _assert_packed_logprobs_equal(model, batch, ref, packed)


@pytest.mark.parametrize("pack_tokens,rows,group_size", [(1024, 1, 4), (512, 2, 1)])
def test_gpt_oss_packed_logprobs_equal_the_padded_ones(pack_tokens, rows, group_size):
    """Sinks, and a window of 40 keys counted in positions: a completion packed after its siblings sees
    the end of its group's shared prompt, and its own first tokens, as in its padded row."""
    model = Decoder(tiny_config("gpt_oss", vocab_size=VOCAB, sliding_window=40), nnx.Rngs(0))
    batch = episodes(B=8, P=48, C=100, long_rows=range(8), shared=(0, 1))
    ref, _ = completion_logprobs(model, batch["prompt_BxP"], batch["prompt_mask_BxP"], batch["completion_BxC"],
                                 batch["completion_mask_BxC"])
    _assert_packed_logprobs_equal(model, batch, ref, pack(batch, pack_tokens, rows, group_size=group_size))


def _gradients(cfg: LearnerConfig, batch: dict, mesh) -> tuple[dict, dict]:
    """One train step with SGD at rate 1: the parameters move by minus the gradient."""
    model = Decoder(MODEL_CFG, nnx.Rngs(0))
    if cfg.lora is not None:
        from jaxrl.models.lora import add_lora
        graphdef, params, frozen = nnx.split(add_lora(model, cfg.lora), nnx.LoRAParam, ...)
    else:
        (graphdef, params), frozen = nnx.split(model), None
    tx = optax.sgd(1.0)
    if cfg.pack_tokens is not None:
        batch = {**batch, **pack(batch, cfg.pack_tokens, cfg.pack_rows or 1,
                                 group_size=cfg.group_size if cfg.shared_prompts else 1)}
    with jax.set_mesh(mesh):
        state, metrics = jax.jit(lambda s, b: train_step(s, b, graphdef, cfg, tx, 1, frozen))(
            init_state(params, cfg, tx), put_batch(batch, mesh))
    grads = jax.tree.map(lambda new, old: old - new, state.params, params)
    return grads, jax.device_get(metrics)


# Each aggregation's normaliser, a per-sequence objective, supervised tokens, and the corrections that
# read sampler logprobs: the rest of losses.py sees the same (B, C) arrays whatever the layout.
LOSSES = [LossConfig(loss_type=t) for t in ("grpo", "dr_grpo", "gspo", "sft")] + [
    LossConfig(loss_type="dapo", beta=0.05, is_level="sequence", token_mask=(0.5, 5.0), opsm_threshold=0.1,
               dual_clip=3.0, distill_weight=0.5),
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda l: f"{l.loss_type}-{l.beta}-{l.is_level}")
def test_packed_gradients_and_metrics_equal_the_padded_ones(loss):
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    batch = episodes(B=8, P=48, long_rows=(6,), shared=(1,))  # packed: one group's prompt laid out once
    cfg = LearnerConfig(group_size=4, num_iterations=2, loss=loss, optimizer=OptimizerConfig(learning_rate=1e-2))
    padded_grads, padded = _gradients(cfg, batch, mesh)
    packed_grads, packed = _gradients(dataclasses.replace(cfg, pack_tokens=128), batch, mesh)
    for a, b in zip(jax.tree.leaves(padded_grads), jax.tree.leaves(packed_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=2e-4)
    assert set(packed) == set(padded)
    for key, value in padded.items():
        assert float(packed[key]) == pytest.approx(float(value), rel=1e-4, abs=1e-6), key


def test_packed_lora_gradients_over_a_mesh_equal_the_padded_ones_on_one_device():
    lora = LoraConfig(rank=4, alpha=8.0)
    cfg = LearnerConfig(group_size=4, lora=lora, loss=LossConfig(loss_type="dapo"))
    batch = episodes(B=8, P=48, shared=(0,))
    padded, _ = _gradients(cfg, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    packed, _ = _gradients(dataclasses.replace(cfg, pack_tokens=128, pack_rows=2), batch,
                           make_mesh(MeshConfig(fsdp=2), jax.devices()[:2]))
    for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(packed)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=2e-4)


def test_a_packed_learner_compiles_once_whatever_the_episodes_lengths():
    from jaxrl.compilation import programs

    cfg = LearnerConfig(group_size=4, pack_tokens=256, loss=LossConfig(loss_type="dapo"))
    learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    learner.prepare(episodes(0, B=8, C=120))  # packed shapes follow the episodes: nothing to prepare
    assert learner._prepared is None
    learner.update(episodes(0, B=8, C=120))
    before = programs()
    # Every episode as long as the batch allows (8 rows, the longest window), then one, then none.
    for seed, long_rows in enumerate([tuple(range(8)), (3,), ()], start=1):
        metrics = learner.update(episodes(seed, B=8, C=120, long_rows=long_rows))
        assert np.isfinite(metrics["loss"])
    assert programs() == before


@pytest.mark.parametrize("change,message", [
    (dict(pack_tokens=100), r"pack_tokens=100 must be a multiple of 64 and at least 128"),
    (dict(pack_tokens=128, grad_accum=2), r"grad_accum=2 with learner.pack_tokens"),
    (dict(pack_tokens=128, pack_rows=0), r"pack_rows=0 must be an integer >= 1"),
])
def test_bad_packing_settings_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig(group_size=4, **change)


def test_packed_rows_must_split_over_the_batch_shards():
    cfg = LearnerConfig(group_size=4, pack_tokens=128, pack_rows=3)
    with pytest.raises(ValueError, match=r"pack_rows=3 must be a multiple of the mesh's 2 batch shards"):
        Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=2), jax.devices()[:2]))


def test_packed_attention_is_finite_on_padding_and_sees_only_its_segment():
    # Two segments in one row: changing the first one's tokens leaves the second's logprobs as they are.
    model = Decoder(MODEL_CFG, nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 128)), jnp.int32)
    segments = jnp.asarray([[1] * 40 + [2] * 50 + [0] * 38], jnp.int32)
    positions = jnp.asarray([list(range(40)) + list(range(50)) + [0] * 38], jnp.int32)
    logp, _ = packed_logprobs(model, tokens, positions, segments, segments, 0)
    changed, _ = packed_logprobs(model, tokens.at[0, :40].set(3), positions, segments, segments, 0)
    assert np.isfinite(np.asarray(logp)).all()
    np.testing.assert_allclose(np.asarray(changed)[0, 40:89], np.asarray(logp)[0, 40:89], atol=1e-6)
    assert not np.allclose(np.asarray(changed)[0, :39], np.asarray(logp)[0, :39])


def test_an_episode_longer_than_the_rows_widens_them_instead_of_failing_the_step():
    # A prompt longer than rollout.max_prompt_tokens widens its step's padded batch; the packed rows follow.
    cfg = LearnerConfig(group_size=4, pack_tokens=128, loss=LossConfig(loss_type="dapo"))
    learner = Learner(Decoder(MODEL_CFG, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    metrics = learner.update(episodes(B=8, P=12, C=150, long_rows=(2,)))
    assert np.isfinite(metrics["loss"])
