"""Mesh shapes, logical-to-mesh axis rules, parameter shardings and batch placement on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models import Decoder, positions_from_mask
from jaxrl.sharding import (
    BATCH_AXES,
    MESH_AXES,
    MeshConfig,
    batch_sharding,
    logical_to_mesh,
    make_mesh,
    param_shardings,
    put_batch,
)
from jaxrl.tiny import tiny_config


def _devices(n=8):
    assert len(jax.devices()) >= 8, "tests/conftest.py must give 8 CPU devices (XLA_FLAGS)"
    return jax.devices()[:n]


# --- MeshConfig.shape -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, n, shape",
    [
        (MeshConfig(), 8, (1, 8, 1, 1)),
        (MeshConfig(), 1, (1, 1, 1, 1)),
        (MeshConfig(tp=2), 8, (1, 4, 1, 2)),
        (MeshConfig(data=2, fsdp=-1, tp=2), 8, (2, 2, 1, 2)),
        (MeshConfig(data=-1, fsdp=2, tp=1), 8, (4, 2, 1, 1)),
        (MeshConfig(data=1, fsdp=1, tp=-1), 4, (1, 1, 1, 4)),
        (MeshConfig(data=2, fsdp=4, tp=1), 8, (2, 4, 1, 1)),
        (MeshConfig(fsdp=2, expert=-1), 8, (1, 2, 4, 1)),
    ],
)
def test_mesh_shape(cfg, n, shape):
    assert cfg.shape(n) == shape


@pytest.mark.parametrize(
    "cfg, n, words",
    [
        (MeshConfig(data=-1, fsdp=-1), 8, "at most one -1"),
        (MeshConfig(data=-1, fsdp=-1, tp=-1), 8, "at most one -1"),
        (MeshConfig(data=0), 8, ">= 1"),
        (MeshConfig(tp=-2), 8, ">= 1"),
        (MeshConfig(data=3, fsdp=-1), 8, "does not divide 8 devices"),
        (MeshConfig(fsdp=-1, tp=16), 8, "does not divide 8 devices"),
        (MeshConfig(data=2, fsdp=2, tp=1), 8, "needs 4 devices, 8 are available"),
        (MeshConfig(data=2, fsdp=4, tp=2), 8, "needs 16 devices, 8 are available"),
    ],
)
def test_mesh_shape_errors_name_the_mesh(cfg, n, words):
    with pytest.raises(ValueError) as err:
        cfg.shape(n)
    message = str(err.value)
    assert "mesh=" in message and words in message, message
    for axis in MESH_AXES:  # the whole configured mesh is quoted
        assert f"'{axis}': {getattr(cfg, axis)}" in message, message


# --- make_mesh --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, sizes",
    [
        (MeshConfig(fsdp=8), {"data": 1, "fsdp": 8, "expert": 1, "tp": 1}),
        (MeshConfig(fsdp=4, tp=2), {"data": 1, "fsdp": 4, "expert": 1, "tp": 2}),
        (MeshConfig(data=2, fsdp=4), {"data": 2, "fsdp": 4, "expert": 1, "tp": 1}),
        (MeshConfig(data=2, fsdp=-1, tp=2), {"data": 2, "fsdp": 2, "expert": 1, "tp": 2}),
        (MeshConfig(fsdp=2, expert=4), {"data": 1, "fsdp": 2, "expert": 4, "tp": 1}),
    ],
)
def test_make_mesh(cfg, sizes):
    devices = _devices(8)
    mesh = make_mesh(cfg, devices)
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == sizes
    assert mesh.devices.shape == tuple(sizes[a] for a in MESH_AXES)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    # Auto axes: classic GSPMD propagation, not Explicit sharding-in-types.
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_on_a_subset_of_devices():
    devices = _devices(8)[:4]
    mesh = make_mesh(MeshConfig(), devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "expert": 1, "tp": 1}
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}
    with pytest.raises(ValueError, match="mesh="):
        make_mesh(MeshConfig(fsdp=8), devices)


# --- logical_to_mesh --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_fsdp4_tp2():
    return make_mesh(MeshConfig(fsdp=4, tp=2), _devices(8))


@pytest.mark.parametrize(
    "axes, shape, spec",
    [
        (("vocab", "embed"), (512, 64), ("tp", "fsdp")),
        (("embed", "vocab"), (64, 512), ("fsdp", "tp")),
        (("embed", "q_heads"), (64, 128), ("fsdp", "tp")),
        (("embed", "kv_heads"), (64, 64), ("fsdp", "tp")),
        (("q_heads", "embed"), (128, 64), ("tp", "fsdp")),
        (("embed", "mlp"), (64, 128), ("fsdp", "tp")),
        (("mlp", "embed"), (128, 64), ("tp", "fsdp")),
        (("q_heads",), (128,), ("tp",)),
        (("norm",), (64,), (None,)),
        ((None, None), (8, 8), (None, None)),
        (("unknown", "embed"), (8, 8), (None, "fsdp")),
        # Dimensions the mesh axis does not divide stay replicated.
        (("vocab", "embed"), (301, 64), (None, "fsdp")),
        (("embed", "vocab"), (6, 301), (None, None)),
        (("embed", "kv_heads"), (64, 3), ("fsdp", None)),
        (("mlp", "embed"), (2, 10), ("tp", None)),
    ],
)
def test_logical_to_mesh(mesh_fsdp4_tp2, axes, shape, spec):
    assert tuple(logical_to_mesh(axes, shape, mesh_fsdp4_tp2)) == spec


def test_logical_to_mesh_size_one_axes_divide_everything():
    mesh = make_mesh(MeshConfig(fsdp=8), _devices(8))
    assert tuple(logical_to_mesh(("vocab", "embed"), (301, 64), mesh)) == ("tp", "fsdp")
    assert tuple(logical_to_mesh(("vocab", "embed"), (301, 12), mesh)) == ("tp", None)


# --- param_shardings --------------------------------------------------------------------------

# Logical axes of each parameter, by the last names of its path.
LOGICAL = {
    ("embed_tokens",): ("vocab", "embed"),
    ("lm_head",): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "q_heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("q_heads", "embed"),
    ("q_proj", "bias"): ("q_heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("weight",): ("norm",),
}
TO_MESH = {"embed": "fsdp", "vocab": "tp", "q_heads": "tp", "kv_heads": "tp", "mlp": "tp", "norm": None}


def _logical(path):
    names = tuple(str(p) for p in path)
    for suffix, axes in LOGICAL.items():
        if names[-len(suffix) :] == suffix:
            return axes
    raise AssertionError(f"no logical axes known for {names}")


@pytest.mark.parametrize(
    "family, tied, vocab, replicated_vocab",
    [("qwen3", True, 512, False), ("qwen2", False, 301, True), ("llama", False, 512, False)],
)
def test_param_shardings(mesh_fsdp4_tp2, family, tied, vocab, replicated_vocab):
    mesh = mesh_fsdp4_tp2
    model = nnx.eval_shape(lambda: Decoder(tiny_config(family, tied=tied, vocab_size=vocab), nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    shardings = param_shardings(params, mesh)
    flat = dict(nnx.to_flat_state(shardings))
    flat_params = dict(nnx.to_flat_state(params))
    assert flat.keys() == flat_params.keys() and len(flat) > 10
    seen_bias = seen_lm_head = False
    for path, var in flat.items():
        sharding = var.get_value() if hasattr(var, "get_value") else var.value
        assert isinstance(sharding, NamedSharding), path
        assert sharding.mesh == mesh
        logical = _logical(path)
        assert tuple(var.get_metadata()["out_sharding"]) == logical, path
        want = [TO_MESH[a] for a in logical]
        if replicated_vocab:  # 301 is odd: tp=2 does not divide it
            want = [None if a == "vocab" else m for a, m in zip(logical, want)]
        assert tuple(sharding.spec) == tuple(want), (path, sharding.spec)
        seen_bias |= str(path[-1]) == "bias"
        seen_lm_head |= str(path[-1]) == "lm_head"
    assert seen_bias == (family == "qwen2")
    assert seen_lm_head == (not tied)


def test_sharded_forward_matches_single_device(mesh_fsdp4_tp2):
    """Parameters placed by param_shardings and a batch by put_batch give the same logits."""
    mesh = mesh_fsdp4_tp2
    model = Decoder(tiny_config("qwen3", tied=False, vocab_size=256, num_layers=1), nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shardings = param_shardings(params, mesh)
    placed = jax.device_put(params, shardings)
    # Every parameter really is split as annotated: the embedding over tp (rows) and fsdp (cols).
    embed = placed["embed_tokens"].get_value()
    assert embed.sharding.spec == PartitionSpec("tp", "fsdp")
    assert {s.data.shape for s in embed.addressable_shards} == {(128, 16)}
    np.testing.assert_array_equal(embed, params["embed_tokens"].get_value())

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 6)).astype(np.int32)
    mask = np.ones((8, 6), np.int32)
    mask[1, :3] = 0
    batch = put_batch({"tokens": tokens, "mask": mask}, mesh)

    @jax.jit
    def forward(p, tokens, mask):
        logits, _ = nnx.merge(graphdef, p, rest)(tokens, positions_from_mask(mask), mask)
        return logits

    want = forward(params, jnp.asarray(tokens), jnp.asarray(mask))
    got = forward(placed, batch["tokens"], batch["mask"])
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# --- put_batch --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg, rows_per_shard",
    [(MeshConfig(data=2, fsdp=4), 2), (MeshConfig(fsdp=4, tp=2), 4), (MeshConfig(fsdp=8), 2)],
)
def test_put_batch(cfg, rows_per_shard):
    mesh = make_mesh(cfg, _devices(8))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 100, (16, 5)).astype(np.int32),
        "mask": rng.integers(0, 2, (16, 5)).astype(bool),
        "rewards": rng.normal(size=16).astype(np.float32),
        "logprobs": rng.normal(size=(16, 5, 1)).astype(np.float32),
    }
    out = put_batch(batch, mesh)
    assert out.keys() == batch.keys()
    for k, v in batch.items():
        arr = out[k]
        assert isinstance(arr, jax.Array)
        assert arr.shape == v.shape and arr.dtype == v.dtype, k
        assert arr.sharding.is_equivalent_to(batch_sharding(mesh, v.ndim), v.ndim)
        assert tuple(arr.sharding.spec) == (("data", "fsdp", "expert"),) + (None,) * (v.ndim - 1)
        assert BATCH_AXES == ("data", "fsdp", "expert")
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            assert shard.data.shape == (rows_per_shard,) + v.shape[1:], k
            np.testing.assert_array_equal(shard.data, v[shard.index])
        np.testing.assert_array_equal(np.asarray(arr), v)
    # Rows are split over data x fsdp only: tp replicas hold the same rows.
    by_rows = {}
    for shard in out["tokens"].addressable_shards:
        by_rows.setdefault(shard.index[0].start, set()).add(shard.device.id)
    assert len(by_rows) == 16 // rows_per_shard
    assert all(len(devs) == mesh.shape["tp"] for devs in by_rows.values())
