"""Weight snapshots: exact round trips that stock Orbax reads too, snapshots Orbax wrote read back,
atomic publication under SIGKILL, damaged files refused, pruning, replacing, copying, multi-process
writes, and clear errors for snapshots that are not there."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, from_hf_tensors, hf_names, to_hf_tensors
from jaxrl.models.config import DTYPES
from jaxrl.sharding import MeshConfig, make_mesh, param_shardings
from jaxrl.snapshots import (
    FORMAT,
    SnapshotError,
    SnapshotReader,
    SnapshotWriter,
    copy_snapshot,
    delete_snapshot,
    host_checksum,
    snapshot_versions,
)
from jaxrl.tiny import tiny_config

from xla_flags import xla_flags

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).parents[1]
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _params(cfg, seed=0):
    return nnx.state(Decoder(cfg, nnx.Rngs(seed)), nnx.Param)


def _expected(cfg, seed, dtype=None):
    """What a snapshot of Decoder(cfg, Rngs(seed)) must hold."""
    return {k: np.asarray(v) for k, v in to_hf_tensors(cfg, _params(cfg, seed), dtype).items()}


def _logits(model):
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % model.cfg.vocab_size)
    mask = jnp.ones_like(tokens)
    return np.asarray(model(tokens, jnp.cumsum(mask, -1) - 1, mask)[0], np.float32)


def _assert_exact(tensors, expected):
    assert list(tensors) == list(expected)
    for name, want in expected.items():
        got = tensors[name]
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)


def _orbax_manager(directory, **options):
    """A stock Orbax CheckpointManager for snapshots: what any Orbax user would open."""
    return ocp.CheckpointManager(
        directory,
        item_handlers={"weights": ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False),
                       "manifest": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(**options),
    )


@pytest.mark.parametrize("family, dtype, sharded", [
    ("qwen3", "float32", False),
    ("qwen2", "bfloat16", False),  # qkv biases
    ("llama", "bfloat16", True),  # rope scaling; params split over an fsdp x tp mesh
    ("qwen3_moe", "bfloat16", True),  # stacked experts, split over the mesh too
    ("gpt_oss", "bfloat16", True),  # sinks, biased router and experts, YaRN and sliding layers in the manifest
])
def test_round_trip_is_exact_and_rebuilds_the_model(tmp_path, family, dtype, sharded):
    cfg = tiny_config(family, tied=False, vocab_size=256)
    params = _params(cfg)
    expected = _expected(cfg, 0, DTYPES[dtype])
    if sharded:
        mesh = make_mesh(MeshConfig(fsdp=4, tp=2))
        params = jax.device_put(params, param_shardings(params, mesh))
        mlp = params["layers"][0]["mlp"]
        split = mlp["gate_up"] if cfg.num_experts else mlp["up_proj"]["kernel"]
        assert len(split.get_value().sharding.device_set) == 8
    writer = SnapshotWriter(tmp_path, cfg, dtype=dtype)
    assert writer.publish(params, 7) == tmp_path / "7"
    writer.close()

    snapshot = SnapshotReader(tmp_path).load()
    assert (snapshot.version, snapshot.path) == (7, tmp_path / "7")
    assert snapshot.hf_config == {**cfg.to_hf(), "dtype": dtype}
    assert set(snapshot.tensors) == {name for name, _, _ in hf_names(cfg)}
    _assert_exact(snapshot.tensors, expected)

    # The snapshot alone rebuilds the model (what the bridge does): the same logits, up to the
    # serving dtype's rounding (another seed's logits differ by ~0.85).
    served_cfg = ModelConfig.from_hf(snapshot.hf_config)
    assert served_cfg.param_dtype == served_cfg.dtype == dtype
    rebuilt = _logits(from_hf_tensors(served_cfg, snapshot.tensors))
    original = _logits(Decoder(cfg, nnx.Rngs(0)))
    np.testing.assert_allclose(rebuilt, original, rtol=0, atol=0 if dtype == "float32" else 0.02)

    # It is an Orbax checkpoint: stock Orbax lists it and restores both items, shards included.
    manager = _orbax_manager(tmp_path, read_only=True, save_interval_steps=0, create=False)
    assert manager.all_steps() == [7]
    restored = manager.restore(7, args=ocp.args.Composite(weights=ocp.args.PyTreeRestore(),
                                                          manifest=ocp.args.JsonRestore()))
    _assert_exact({name: restored.weights[name] for name in expected}, expected)
    assert restored.manifest["format"] == FORMAT and list(restored.manifest["tensors"]) == list(expected)
    manager.close()


def test_snapshots_that_orbax_wrote_are_read(tmp_path):
    """What earlier versions of jaxrl published (Orbax's own save, no piece shapes in the manifest),
    or any Orbax user writes, still loads and is still verified."""
    cfg = tiny_config("qwen2", tied=False, vocab_size=256)
    expected = _expected(cfg, 0, jnp.bfloat16)
    manifest = {"format": FORMAT, "version": 4, "hf_config": {**cfg.to_hf(), "dtype": "bfloat16"},
                "tensors": {name: {"shape": list(x.shape), "dtype": str(x.dtype), "checksum": host_checksum(x)}
                            for name, x in expected.items()}}
    manager = _orbax_manager(tmp_path)
    manager.save(4, args=ocp.args.Composite(weights=ocp.args.PyTreeSave(expected),
                                            manifest=ocp.args.JsonSave(manifest)))
    manager.wait_until_finished()
    manager.close()
    snapshot = SnapshotReader(tmp_path).load()
    assert snapshot.version == 4
    _assert_exact(snapshot.tensors, expected)

    name = "model.layers.1.mlp.up_proj.weight"
    manifest["tensors"][name]["checksum"] ^= 1
    (tmp_path / "4" / "manifest" / "metadata").write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=f"tensor '{name}' fails its checksum"):
        SnapshotReader(tmp_path).load(4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checksum_shares_of_any_split_add_up_and_it_sees_a_changed_value(dtype):
    rng = np.random.default_rng(0)
    x = np.asarray(rng.standard_normal((6, 7)), DTYPES[dtype])  # odd row length
    whole = host_checksum(x)
    for rows, cols in [(3, 2), (2, 3), (6, 5), (1, 1)]:
        shares = sum(
            host_checksum(x[r:r + rows, c:c + cols], column_offset=c)
            for r in range(0, 6, rows) for c in range(0, 7, cols)
        )
        assert shares % 2**32 == whole, (rows, cols)
    assert host_checksum(x[:, :6]) == host_checksum(x[:, :6].copy(order="F"))
    y = x.copy()
    y[4, 5] = -y[4, 5]
    assert host_checksum(y) != whole


def _tmp_dirs(directory):
    return [p.name for p in Path(directory).iterdir() if TMP_SUFFIX in p.name]


def _tmp_bytes(directory):
    tmp_files = (f for d in _tmp_dirs(directory) for f in (Path(directory) / d).rglob("*"))
    return sum(f.stat().st_size for f in tmp_files if f.is_file())


def test_writer_killed_mid_write_leaves_only_finished_snapshots(tmp_path):
    directory = tmp_path / "snapshots"
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(WORKERS / "snapshot_writer.py"), str(directory), "1", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "published 1", proc.stderr.read()[-3000:]
        # Kill once version 2's temporary directory holds tensor bytes: its write is under way.
        deadline = time.monotonic() + 60
        while not _tmp_bytes(directory) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert _tmp_dirs(directory) == [f"2{TMP_SUFFIX}"], "the writer finished before it was killed"
    assert _tmp_bytes(directory) > 0

    reader = SnapshotReader(directory)
    assert reader.versions() == [1]
    with pytest.raises(SnapshotError, match=r"no finished snapshot with version 2 \(have \[1\]\)"):
        reader.load(2)
    snapshot = reader.load()
    assert snapshot.version == 1
    cfg = ModelConfig.from_hf(snapshot.hf_config)
    _assert_exact(snapshot.tensors, _expected(cfg, 1))

    # A new writer on the same directory cleans the leftover up and publishes.
    writer = SnapshotWriter(directory, cfg, dtype="float32")
    writer.publish(_params(cfg, 2), 2)
    writer.close()
    assert _tmp_dirs(directory) == []
    assert reader.versions() == [1, 2] and reader.load().version == 2


def _largest_data_file(snapshot: Path) -> Path:
    return max((p for p in (snapshot / "weights").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _corrupt(path: Path):
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        data = f.read(64)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


def _truncate(path: Path):
    os.truncate(path, path.stat().st_size // 2)


# A failed Orbax restore leaves tensorstore reads in flight whose callbacks find its event loop closed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage, message", [
    (_corrupt, "fails its checksum"),
    (_truncate, "cannot be restored"),
    (Path.unlink, "cannot be restored"),
])
def test_damaged_snapshot_is_refused_and_the_previous_one_still_loads(tmp_path, damage, message):
    cfg = tiny_config("qwen3", tied=False, vocab_size=2048)
    writer = SnapshotWriter(tmp_path, cfg)
    for version in (1, 2):
        writer.publish(_params(cfg, version), version)
    writer.close()
    data_file = _largest_data_file(tmp_path / "2")
    assert data_file.stat().st_size > 256 << 10  # mostly tensor bytes
    damage(data_file)

    reader = SnapshotReader(tmp_path)
    for version in (2, None):  # asked for, and as the newest
        with pytest.raises(SnapshotError, match=message) as error:
            reader.load(version)
        assert str(tmp_path / "2") in str(error.value)
    previous = reader.load(1)
    _assert_exact(previous.tensors, _expected(cfg, 1))


def _published_manifest(directory: Path) -> tuple[Path, dict]:
    """Snapshot 1 of a tiny model published in `directory`: its manifest file and contents."""
    cfg = tiny_config("qwen3")
    writer = SnapshotWriter(directory, cfg)
    writer.publish(_params(cfg), 1)
    writer.close()
    manifest_file = directory / "1" / "manifest" / "metadata"
    return manifest_file, json.loads(manifest_file.read_text())


def test_manifest_of_another_format_is_refused(tmp_path):
    manifest_file, manifest = _published_manifest(tmp_path)
    manifest_file.write_text(json.dumps({**manifest, "format": "jaxrl-weights-v1"}))
    with pytest.raises(SnapshotError, match=f"{tmp_path / '1'}: manifest format is 'jaxrl-weights-v1'"):
        SnapshotReader(tmp_path).load()


def test_pruning_keeps_the_newest_and_those_in_use(tmp_path):
    cfg = tiny_config("qwen3")
    params = _params(cfg)
    writer = SnapshotWriter(tmp_path, cfg, keep=2)
    reader = SnapshotReader(tmp_path)
    for version, in_use, kept in [
        (1, [], [1]),
        (2, [], [1, 2]),
        (3, [1], [1, 2, 3]),
        (4, [1, 2], [1, 2, 3, 4]),
        (5, [2], [2, 4, 5]),
        (6, [], [5, 6]),
    ]:
        writer.publish(params, version, in_use=in_use)
        assert reader.versions() == writer.versions() == kept, version
        # Pruned ones are out of every listing at once (renamed), their files deleted in the background.
        assert sorted(int(p.name) for p in tmp_path.iterdir() if TMP_SUFFIX not in p.name) == kept
    # Without waiting, the snapshot becomes visible (and old ones go) once the write finishes.
    writer.publish(params, 7, wait=False)
    writer.wait()
    assert reader.versions() == [6, 7]
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]  # nothing left behind
    with pytest.raises(ValueError, match="keep=0"):
        SnapshotWriter(tmp_path, cfg, keep=0)


def test_a_version_published_again_replaces_it_and_delete_removes_it(tmp_path):
    cfg = tiny_config("qwen3")
    writer = SnapshotWriter(tmp_path, cfg, keep=5)
    for version, seed in [(1, 1), (2, 2), (2, 3)]:
        writer.publish(_params(cfg, seed), version)
    assert writer.versions() == [1, 2]
    _assert_exact(SnapshotReader(tmp_path).load(2).tensors, _expected(cfg, 3))
    writer.delete(1)
    assert writer.versions() == [2]
    delete_snapshot(tmp_path, 2)
    delete_snapshot(tmp_path, 9)  # not there: nothing to do
    writer.close()
    assert snapshot_versions(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_copy_commits_a_finished_snapshot_elsewhere_and_keeps_the_newest(tmp_path):
    cfg = tiny_config("qwen3")
    writer = SnapshotWriter(tmp_path / "shm", cfg)
    for version in (1, 2, 3):
        writer.publish(_params(cfg, version), version)
    writer.close()
    assert copy_snapshot(tmp_path / "shm", 3, tmp_path / "run" / "snapshots") == tmp_path / "run" / "snapshots" / "3"
    for version in (1, 2):
        copy_snapshot(tmp_path / "shm", version, tmp_path / "run" / "snapshots", keep=2)
    assert snapshot_versions(tmp_path / "run" / "snapshots") == [2, 3]
    assert not [p for p in (tmp_path / "run" / "snapshots").iterdir() if TMP_SUFFIX in p.name]
    _assert_exact(SnapshotReader(tmp_path / "run" / "snapshots").load(3).tensors, _expected(cfg, 3))
    with pytest.raises(SnapshotError, match=r"no finished snapshot with version 4 \(have \[1, 2, 3\]\)"):
        copy_snapshot(tmp_path / "shm", 4, tmp_path / "run" / "snapshots")


def test_a_piece_the_manifest_names_but_the_files_lack_is_refused(tmp_path):
    manifest_file, manifest = _published_manifest(tmp_path)
    manifest["tensors"]["model.extra.weight"] = {"shape": [4], "dtype": "float32", "checksum": 0, "chunk": [4]}
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match=r"1: cannot be restored \(ValueError: tensor 'model.extra.weight': "
                                            r"its piece model.extra.weight/c/0 is missing\)"):
        SnapshotReader(tmp_path).load()


def test_missing_snapshots_are_clear_errors(tmp_path):
    with pytest.raises(SnapshotError, match=f"{tmp_path / 'nope'}: snapshot directory does not exist"):
        SnapshotReader(tmp_path / "nope")
    reader = SnapshotReader(tmp_path)
    assert reader.versions() == [] and reader.latest_version() is None
    with pytest.raises(SnapshotError, match="no finished snapshot yet"):
        reader.load()
    cfg = tiny_config("qwen3")
    writer = SnapshotWriter(tmp_path, cfg)
    writer.publish(_params(cfg), 3)
    writer.close()
    missing = rf"{tmp_path / '4'}: no finished snapshot with version 4 \(have \[3\]\)"
    with pytest.raises(SnapshotError, match=missing):
        reader.load(4)
    assert reader.latest_version() == 3


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_write_their_own_shards(tmp_path):
    env = {**os.environ, "XLA_FLAGS": xla_flags(4), "PYTHONPATH": str(ROOT)}
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / "snapshot_multihost.py"), address, "2", str(pid), str(tmp_path)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for pid in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
    # Each process wrote the shards it holds into its own files.
    for pid in range(2):
        data = [f for f in (tmp_path / "1" / "weights" / f"ocdbt.process_{pid}").rglob("*") if f.is_file()]
        assert sum(f.stat().st_size for f in data) > 10_000, pid
    cfg = tiny_config("qwen2", tied=False, vocab_size=256)
    snapshot = SnapshotReader(tmp_path).load(1)
    _assert_exact(snapshot.tensors, _expected(cfg, 3, jnp.bfloat16))


def test_a_lora_snapshot_holds_the_adapters_alone_in_peft_layout_sharded_or_not(tmp_path):
    from jaxrl.models.lora import LoraConfig, adapter_config, adapter_tensors, add_lora

    cfg = tiny_config("qwen3", tied=False, vocab_size=256)
    lora = LoraConfig(rank=4, alpha=8.0)
    model = add_lora(Decoder(cfg, nnx.Rngs(0)), lora)
    adapters = jax.tree.map(lambda x: x + 0.5, nnx.state(model, nnx.LoRAParam))
    expected = {k: np.asarray(v) for k, v in adapter_tensors(cfg, lora, adapters).items()}
    mesh = make_mesh(MeshConfig(fsdp=4, tp=2))
    for version, params in ((1, adapters), (2, jax.device_put(adapters, param_shardings(adapters, mesh)))):
        writer = SnapshotWriter(tmp_path / "lora", cfg, lora=lora, base_model="/models/base")
        writer.publish(params, version)
        writer.close()
        snapshot = SnapshotReader(tmp_path / "lora").load(version)
        assert snapshot.adapter_config == adapter_config(lora, "/models/base")
        assert snapshot.hf_config["hidden_size"] == cfg.hidden_size  # the base's shape, for the bridge's checks
        _assert_exact(snapshot.tensors, expected)
    assert SnapshotReader(tmp_path / "lora").load(1).tensors.keys() == expected.keys()
    full = SnapshotWriter(tmp_path / "full", cfg)
    full.publish(_params(cfg), 1)
    full.close()
    assert SnapshotReader(tmp_path / "full").load(1).adapter_config is None

    def size(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    assert size(tmp_path / "lora" / "1") < size(tmp_path / "full" / "1") / 3
