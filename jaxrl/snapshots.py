"""Weight snapshots for the bridge: params only, serving dtype, keyed by Hugging Face names.

A LoRA run's snapshots hold its adapters alone (float32, PEFT's names and layout), with PEFT's
`adapter_config.json` in the manifest beside the base model's config: the bridge keeps the base it
loaded at start and swaps the adapters.

A snapshot is an Orbax checkpoint numbered by policy version with two items: `weights`, a flat
{HF tensor name: array} that every process writes for its own shards, and `manifest` (JSON):
the HF config and each tensor's shape, dtype, checksum and piece shape (`chunk`). Stock Orbax
lists and restores it (`ocp.CheckpointManager` with a `PyTreeCheckpointHandler` and a
`JsonCheckpointHandler`; tests/test_snapshots.py checks that). A snapshot is written as
`<version>.orbax-checkpoint-tmp` and renamed on commit, so readers only ever list finished ones;
the checksums catch the rest (uncompressed zarr has no checksum of its own, so a damaged data
file would read back silently). On an object store (`gs://`, `s3://`), where there is no rename,
`<version>/commit_success.txt` written last commits it instead (jaxrl.snapshot_store).

The bytes go through TensorStore directly, in Orbax's layout: each tensor a zarr3 array in one
OCDBT database (uncompressed, one chunk per shard: its bytes as they lie in memory),
`weights/_METADATA` the tree metadata, `manifest/metadata` the JSON, `_CHECKPOINT_METADATA` the
step's. Orbax's own save and restore (CheckpointManager, the pytree handler) spend threads, event
loops and metadata passes on every snapshot whatever its size, a fixed cost many times that of the
writes and reads here (docs/benchmarks.md). With several processes each writes its shards into
`weights/ocdbt.process_<i>`, and the primary merges those databases into the snapshot's (Orbax's
scheme) between barriers.

Speed (choices measured with experiments/bench/snapshots.py; figures in docs/benchmarks.md):
- zarr3 without compression: zstd costs more CPU than the disk time it saves.
- the cast and transposes run as one small XLA program per tensor, and the checksums are NumPy
  sums over each process's own shards, read as uint32 words (no conversion pass); one XLA
  program for all transposes and XLA:CPU reductions were each several times slower.
- small pieces are written and read as plain key-value pairs (opening a TensorStore array costs
  more than moving a small piece), large ones through the zarr driver (faster on big pieces);
  all of a snapshot's writes go in one OCDBT commit, all its reads are in flight at once.
- OCDBT data files of at most `DATA_FILE_BYTES`, so several are written at once.
- the reader maps the data files (tensorstore's `memmap` file mode) instead of reading them into
  a buffer and copying that: one copy from the page cache instead of two. Committed files are
  never changed, only deleted by pruning, which leaves an open mapping valid.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import operator
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl.models import ModelConfig, hf_names
from jaxrl.models.hf import hf_layout
from jaxrl.models.config import DTYPES
from jaxrl.models.lora import LoraConfig, adapter_config, adapter_tensors
from jaxrl.snapshot_store import DirectoryStore, ObjectStore, copy_keys, open_store

FORMAT = "jaxrl-weights-v2"  # v2: checksums of 2-byte dtypes sum column pairs as uint32 words
# Far below Orbax's default (2 GiB), so that a snapshot's data files are written at once; 64 MB
# was the best of the sizes measured (docs/benchmarks.md).
DATA_FILE_BYTES = 64 << 20
# Pieces smaller than this are written as key-value pairs, larger ones through the zarr driver.
_SMALL_BYTES = 1 << 20
_PROCESS_PREFIX = "ocdbt.process_"  # Orbax's per-process databases, merged on commit
_HANDLERS = {  # recorded in _CHECKPOINT_METADATA, as Orbax's CheckpointManager writes it
    "manifest": "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler",
    "weights": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
}


class SnapshotError(ValueError):
    """A snapshot that must not be served: names the snapshot and what is wrong with it."""


@dataclasses.dataclass
class Snapshot:
    version: int
    hf_config: dict
    tensors: dict[str, np.ndarray]
    path: Path | str  # a URL on an object store
    adapter_config: dict | None = None  # PEFT's adapter_config.json: `tensors` are LoRA adapters


@functools.partial(jax.jit, static_argnames=("transposed", "dtype"))
def _to_serving(x: jax.Array, transposed: bool, dtype) -> jax.Array:
    return hf_layout(x, transposed).astype(dtype)


def serving_tensors(cfg: ModelConfig, params: nnx.State, dtype) -> dict[str, jax.Array]:
    """`to_hf_tensors(cfg, params, dtype)`, one small program per tensor.

    XLA:CPU ran a single program of all the transposes slower than one per tensor.
    """
    return {
        name: _to_serving(functools.reduce(operator.getitem, path, params)[...], transposed, dtype)
        for name, path, transposed in hf_names(cfg)
    }


def host_checksum(x: np.ndarray, column_offset: int = 0) -> int:
    """The checksum of a tensor, or the share of one shard that starts at `column_offset` of the
    last axis: 32-bit words summed modulo 2**32.

    A word is one value of a 4-byte dtype, or for 2-byte dtypes columns 2k and 2k+1 of a row
    (little-endian; an odd last column pairs with zero), so that contiguous data sums as a
    uint32 view without a conversion pass. A sum, so shares of any split add up to the whole.
    """
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 4:
        return int(x.view(np.uint32).sum(dtype=np.uint32))
    rows = np.atleast_1d(x).view(np.uint16)
    rows = rows.reshape(-1, rows.shape[-1])
    if column_offset % 2 == 0 and rows.shape[1] % 2 == 0:
        return int(rows.view(np.uint32).sum(dtype=np.uint32))
    even = column_offset % 2  # the first local column that is even in the whole tensor
    low = int(rows[:, even::2].sum(dtype=np.uint32))
    high = int(rows[:, 1 - even::2].sum(dtype=np.uint32))
    return (low + (high << 16)) % 2**32


def _host_shards(tensors: dict[str, jax.Array]) -> dict[str, list[tuple[tuple, np.ndarray]]]:
    """This process's shards of each tensor as (index, host array), replica 0 only, so that data
    replicated over devices or processes is counted and written once. One transfer for all."""
    picked = [(name, s.index, s.data) for name, x in tensors.items()
              for s in x.addressable_shards if s.replica_id == 0]
    host = jax.device_get([data for _, _, data in picked])
    out: dict[str, list] = {name: [] for name in tensors}
    for (name, index, _), data in zip(picked, host):
        out[name].append((index, np.asarray(data)))
    return out


def _checksums(shards: dict[str, list[tuple[tuple, np.ndarray]]]) -> dict[str, int]:
    """Checksum of every tensor without gathering it: this process's shards, then a sum over processes."""
    local = np.zeros(len(shards), np.uint32)
    for i, pieces in enumerate(shards.values()):
        local[i] = sum(host_checksum(x, (index[-1].start or 0) if index else 0) for index, x in pieces) % 2**32
    if jax.process_count() > 1:
        local = multihost_utils.process_allgather(local).sum(axis=0, dtype=np.uint32)
    return dict(zip(shards, map(int, local)))


# --- the Orbax layout, through TensorStore -----------------------------------------------------


def _kvstore_spec(base: dict) -> dict:
    """The OCDBT database in the kvstore `base`, as Orbax opens it (single-file manifest, data
    files of at most DATA_FILE_BYTES, small values such as zarr.json inline in the tree)."""
    # In a directory data files are written once under fresh names: no locking. The manifest is renamed in.
    unlocked = {"file_io_locking": {"mode": "non_atomic"}} if base["driver"] == "file" else {}
    return {
        "driver": "ocdbt",
        "base": {**base, **unlocked},
        "manifest": base,
        "target_data_file_size": DATA_FILE_BYTES,
        "config": {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000,
                   "manifest_kind": "single"},
        "assume_config": True,
    }


def _zarr_metadata(shape: tuple, chunk: tuple, dtype) -> dict:
    """zarr3 metadata (`zarr.json`) of an uncompressed array stored in `chunk`-shaped pieces, as
    TensorStore writes it: one piece per shard, its bytes as they lie in memory (little-endian)."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": np.dtype(dtype).name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": 0.0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }


def _chunk_key(name: str, index: tuple, chunk: tuple) -> str:
    """The key of the piece of array `name` that starts where shard `index` does."""
    return "/".join([name, "c", *(str((s.start or 0) // n) for s, n in zip(index, chunk))])


def _tree_metadata(tensors: dict[str, jax.Array]) -> dict:
    """`weights/_METADATA`: the tree (a flat dict) as Orbax's PyTreeCheckpointHandler records it.
    Values are restored as NumPy arrays by default: a snapshot is a host-side artefact."""
    return {
        "tree_metadata": {
            str((name,)): {
                "key_metadata": [{"key": name, "key_type": 2}],  # 2: a dict key
                "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False,
                                   "write_shape": list(x.sharding.shard_shape(x.shape))},
            }
            for name, x in sorted(tensors.items())
        },
        "use_ocdbt": True,
        "use_zarr3": True,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


def _write_arrays(base: dict, tensors: dict[str, jax.Array], shards: dict[str, list]) -> None:
    """Writes this process's shards of every tensor into the OCDBT database in kvstore `base`, in
    one commit. Every process writes each array's zarr.json (the same everywhere), as Orbax does.

    Pieces under `_SMALL_BYTES` go in as plain key-value writes: opening a TensorStore array costs
    ~60 us, a few times the write of a small piece. Larger ones go through TensorStore's zarr3
    driver, which writes them from the array itself instead of a bytes copy (the same layout).
    """
    context = ts.Context()
    kvstore = ts.KvStore.open(_kvstore_spec(base), context=context).result()
    txn = ts.Transaction(atomic=False)
    staged = kvstore.with_transaction(txn)
    writes, opening = [], []
    for name, x in tensors.items():
        chunk = x.sharding.shard_shape(x.shape)
        metadata = _zarr_metadata(x.shape, chunk, x.dtype)
        if math.prod(chunk) * x.dtype.itemsize < _SMALL_BYTES:
            writes.append(staged.write(f"{name}/zarr.json", json.dumps(metadata)))
            for index, data in shards[name]:
                if data.shape != chunk:  # an uneven last shard: pieces are whole chunks
                    data = np.pad(data, [(0, n - m) for n, m in zip(chunk, data.shape)])
                writes.append(staged.write(_chunk_key(name, index, chunk), data.tobytes()))
        else:
            store = ts.open({"driver": "zarr3", "metadata": metadata, "store_data_equal_to_fill_value": True},
                            kvstore=kvstore / f"{name}/", create=True, context=context, transaction=txn)
            opening.append((store, shards[name]))
    for store, pieces in opening:
        store = store.result()
        writes += [store[index].write(data, can_reference_source_data_indefinitely=True) for index, data in pieces]
    for write in writes:
        write.result()
    txn.commit_async().result()


def _merge_process_databases(store: DirectoryStore | ObjectStore, key: str) -> None:
    """Makes the per-process databases under `key` one (Orbax's merge: the tree refers to their
    data files; nothing is copied)."""
    context = ts.Context()
    parent = ts.KvStore.open(_kvstore_spec(store.kvstore_base(key)), context=context).result()
    txn = ts.Transaction(atomic=True)
    for child_key in store.subdirectories(key, _PROCESS_PREFIX):
        child = ts.KvStore.open(_kvstore_spec(store.kvstore_base(child_key)), context=context).result()
        child.experimental_copy_range_to(parent.with_transaction(txn)).result()
    txn.commit_async().result()


def _read_arrays(base: dict, tensors: dict[str, dict]) -> dict[str, np.ndarray]:
    """The arrays `tensors` (name -> manifest entry) of the OCDBT database in kvstore `base`, as
    NumPy arrays, every read in flight at once.

    The manifest gives each array's shape, dtype and piece shape (`chunk`): pieces under
    `_SMALL_BYTES` are read as plain key-value pairs, without opening an array (the mirror of
    `_write_arrays`; read-only arrays over the bytes read). Larger ones, and every array of a
    snapshot whose manifest has no `chunk` (written through Orbax by earlier versions), are read
    through TensorStore's zarr driver, which reads big pieces faster than a key-value read.
    """
    # A fresh context per snapshot: no cache can serve another snapshot's bytes.
    context = ts.Context(ts.Context.Spec({"file_io_mode": {"mode": "memmap"}}))
    kvstore = ts.KvStore.open(_kvstore_spec(base), context=context).result()
    plans = {}
    for name, meta in tensors.items():
        dtype = np.dtype(DTYPES[meta["dtype"]])
        if "chunk" in meta and math.prod(meta["chunk"]) * dtype.itemsize < _SMALL_BYTES:
            shape, chunk = tuple(meta["shape"]), tuple(meta["chunk"])
            starts = itertools.product(*(range(0, n, c) for n, c in zip(shape, chunk)))
            index = [tuple(slice(s, min(s + c, n)) for s, c, n in zip(start, chunk, shape)) for start in starts]
            plans[name] = (shape, chunk, dtype, index, [kvstore.read(_chunk_key(name, i, chunk)) for i in index])
        else:
            plans[name] = ts.open({"driver": "zarr3", "recheck_cached_data": False}, kvstore=kvstore / f"{name}/",
                                  open=True, read=True, context=context)
    reading = {name: plan.result().read() for name, plan in plans.items() if not isinstance(plan, tuple)}
    out = {}
    for name, plan in plans.items():
        out[name] = reading[name].result() if name in reading else _assemble(name, *plan)
    return out


def _assemble(name: str, shape: tuple, chunk: tuple, dtype: np.dtype, index: list, reads: list) -> np.ndarray:
    """An array from its pieces' key-value reads."""
    pieces = []
    for i, read in zip(index, reads):
        read = read.result()
        if read.state != "value":
            raise ValueError(f"tensor {name!r}: its piece {_chunk_key(name, i, chunk)} is missing")
        piece = np.frombuffer(read.value, dtype)
        if piece.size != math.prod(chunk):
            raise ValueError(f"tensor {name!r}: piece {_chunk_key(name, i, chunk)} holds {piece.size} "
                             f"values, not {math.prod(chunk)}")
        pieces.append(piece.reshape(chunk))
    if len(pieces) == 1 and chunk == shape:
        return pieces[0]
    x = np.empty(shape, dtype)
    for i, piece in zip(index, pieces):
        x[i] = piece[tuple(slice(0, s.stop - s.start) for s in i)]
    return x


def _json(value) -> bytes:
    return json.dumps(value).encode()


def snapshot_versions(directory: str | Path) -> list[int]:
    """The finished snapshots under `directory` (a path or a gs:// or s3:// URL), oldest first
    ([] if there is none)."""
    return open_store(directory).versions()


def _prune(store: DirectoryStore | ObjectStore, keep: int, in_use: Iterable[int] = ()) -> list:
    """Unlists every snapshot but the newest `keep` and `in_use`; returns what to delete."""
    versions = store.versions()
    kept = set(versions[-keep:]) | set(in_use)
    return [doomed for old in versions if old not in kept for doomed in [store.unlist(old)] if doomed is not None]


def delete_snapshot(directory: str | Path, version: int) -> None:
    """Removes snapshot `version` under `directory` (one process; see SnapshotWriter.delete)."""
    store = open_store(directory)
    store.delete(store.unlist(version))


def copy_snapshot(source: str | Path, version: int, directory: str | Path, keep: int | None = None) -> Path | str:
    """Copies finished snapshot `version` from the snapshots directory `source` into `directory`
    (either may be an object store's URL), committed as a publish is (an existing `version` there
    is replaced); then keeps the newest `keep` there, if given. One process. Returns the copy's
    location."""
    src, dst = open_store(source), open_store(directory)
    if version not in src.versions():
        raise SnapshotError(f"{src.location(str(version))}: no finished snapshot with version {version} "
                            f"(have {src.versions()})")
    dst.open_for_writing()
    dst.begin(version)
    try:
        copy_keys(src, str(version), dst, dst.staging(version))
    except BaseException:
        dst.discard(version)  # nothing half-copied stays visible (a full disk)
        raise
    dst.commit(version)
    for doomed in _prune(dst, keep) if keep is not None else ():
        dst.delete(doomed)
    return dst.location(str(version))


class SnapshotWriter:
    """Publishes snapshots of a model's params under `directory`, keeping the newest `keep`.

    `directory` is a path, or a `gs://` or `s3://` URL (see jaxrl.snapshot_store). Every process
    of a multi-host run calls `publish` with the same arguments. With `lora`, `publish` takes the
    adapters' state and writes them alone, float32, PEFT-named (`base_model` names the base in
    their adapter_config).
    """

    def __init__(self, directory: str | Path, model_cfg: ModelConfig, dtype: str | None = None, keep: int = 3,
                 lora: LoraConfig | None = None, base_model: str | None = None):
        self.store = open_store(directory)
        self.model_cfg, self.lora = model_cfg, lora
        self.adapter_config = None if lora is None else adapter_config(lora, base_model)
        self.dtype = dtype or model_cfg.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"snapshot dtype={self.dtype!r}; allowed: {sorted(DTYPES)}")
        if keep < 1:
            raise ValueError(f"snapshot keep={keep!r} must be >= 1")
        self.keep = keep
        self._primary = jax.process_index() == 0
        self._barriers = itertools.count()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        if self._primary:
            try:
                self.store.open_for_writing()
            except ValueError as e:  # TensorStore's errors, as in `_write`
                raise SnapshotError(f"{self.store}: cannot be opened for writing ({_one_line(e)})") from e
        self._sync("open")

    def versions(self) -> list[int]:
        """The finished snapshots, oldest first."""
        return self.store.versions()

    def delete(self, version: int) -> None:
        """Removes snapshot `version` (the primary process does; every process calls this)."""
        self.wait()
        if self._primary:
            self.store.delete(self.store.unlist(version))
        self._sync(f"delete-{version}")

    def publish(self, params: nnx.State, version: int, wait: bool = True, in_use: Iterable[int] = ()) -> Path | str:
        """Writes snapshot `version`; with `wait`, returns once it is committed and visible.

        Once it is committed, snapshots beyond the newest `keep` are deleted, except `in_use`.
        An existing snapshot `version` is replaced.
        """
        self.wait()
        if self.lora is None:
            tensors = serving_tensors(self.model_cfg, params, DTYPES[self.dtype])
        else:
            tensors = adapter_tensors(self.model_cfg, self.lora, params, np.float32)
        shards = _host_shards(tensors)
        checksums = _checksums(shards)
        manifest = {
            "format": FORMAT,
            "version": version,
            "hf_config": {**self.model_cfg.to_hf(), "dtype": self.dtype},
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype), "checksum": checksums[k],
                    "chunk": list(v.sharding.shard_shape(v.shape))}  # how its pieces lie (see _write_arrays)
                for k, v in tensors.items()
            },
        }
        if self.adapter_config is not None:
            manifest["adapter_config"] = self.adapter_config
        write = functools.partial(self._write, version, tensors, shards, manifest, frozenset(in_use))
        if wait:
            write()
        else:
            self._pending = self._background().submit(write)
        return self.store.location(str(version))

    def _background(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread for writes that do not wait and for deleting pruned snapshots, in order."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")
        return self._executor

    def _write(self, version: int, tensors, shards, manifest: dict, in_use: frozenset[int]) -> None:
        try:
            self._write_and_commit(version, tensors, shards, manifest, in_use)
        except ValueError as e:  # TensorStore's errors: a store that does not answer, refused credentials
            raise SnapshotError(f"{self.store.location(str(version))}: cannot be written "
                                f"({type(e).__name__}: {_one_line(e)})") from e

    def _write_and_commit(self, version: int, tensors, shards, manifest: dict, in_use: frozenset[int]) -> None:
        store, tmp = self.store, self.store.staging(version)
        start_ns = time.time_ns()
        if self._primary:
            store.begin(version)
        self._sync(f"start-{version}")
        multiprocess = jax.process_count() > 1
        weights = f"{tmp}/weights"
        _write_arrays(store.kvstore_base(f"{weights}/{_PROCESS_PREFIX}{jax.process_index()}" if multiprocess
                                         else weights), tensors, shards)
        self._sync(f"written-{version}")
        if self._primary:
            if multiprocess:
                _merge_process_databases(store, weights)
            store.write(f"{weights}/_METADATA", _json(_tree_metadata(tensors)))
            store.write(f"{tmp}/manifest/metadata", _json(manifest))
            store.write(f"{tmp}/_CHECKPOINT_METADATA", _json({
                "item_handlers": _HANDLERS, "metrics": {}, "performance_metrics": {},
                "init_timestamp_nsecs": start_ns, "commit_timestamp_nsecs": time.time_ns(), "custom_metadata": {}}))
            store.commit(version)
            doomed = _prune(store, self.keep, in_use)
            if doomed:  # deleted off the critical path: already out of the listings
                self._background().submit(lambda: [store.delete(d) for d in doomed])
        self._sync(f"committed-{version}")

    def _sync(self, what: str) -> None:
        """A barrier over the processes of a multi-host run (no-op in one process)."""
        if jax.process_count() > 1:
            from orbax.checkpoint import multihost

            multihost.sync_global_processes(f"jaxrl-snapshots:{self.store}:{next(self._barriers)}:{what}")

    def wait(self) -> None:
        """Blocks until a `publish(..., wait=False)` is committed (and old snapshots pruned)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


class SnapshotReader:
    """Finds and restores finished snapshots as NumPy arrays, without knowing jaxrl's tree."""

    def __init__(self, directory: str | Path):
        try:
            self.store = open_store(directory)
        except ValueError as e:
            raise SnapshotError(str(e)) from None
        if not self.store.exists():
            raise SnapshotError(f"{self.store}: snapshot directory does not exist")

    def versions(self) -> list[int]:
        return self.store.versions()

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> Snapshot:
        """Restores and verifies `version` (default: newest); raises SnapshotError if unusable."""
        if version is None:
            version = self.latest_version()
            if version is None:
                raise SnapshotError(f"{self.store}: no finished snapshot yet")
        path = self.store.location(str(version))
        try:
            committed = self.store.committed(version)
        except ValueError as e:  # TensorStore's errors: a store that does not answer, refused credentials
            raise SnapshotError(f"{path}: cannot be read ({_one_line(e)})") from e
        if not committed:
            raise SnapshotError(f"{path}: no finished snapshot with version {version} (have {self.versions()})")
        try:
            data = self.store.read(f"{version}/manifest/metadata")
            if data is None:
                raise FileNotFoundError("manifest/metadata is missing")
            manifest = json.loads(data)
        except (OSError, ValueError) as e:
            raise SnapshotError(f"{path}: manifest cannot be read ({type(e).__name__}: {_one_line(e)})") from e
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if found != FORMAT or not isinstance(manifest.get("tensors"), dict):
            raise SnapshotError(
                f"{path}: manifest format is {found!r}, this reader needs {FORMAT!r}; publish the "
                f"weights again with this version of jaxrl"
            )
        # The manifest names the tensors, so the weights need no metadata pass of their own.
        try:
            tensors = _read_arrays(self.store.kvstore_base(f"{version}/weights"), manifest["tensors"])
        except Exception as e:  # tensorstore raises ValueError/OSError and more for damaged files
            raise SnapshotError(f"{path}: cannot be restored ({type(e).__name__}: {_one_line(e)})") from e
        _verify(path, manifest["tensors"], tensors)
        return Snapshot(version, manifest["hf_config"], tensors, path, manifest.get("adapter_config"))


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _verify(path: Path | str, expected: dict, tensors: dict[str, np.ndarray]) -> None:
    for name, meta in expected.items():
        x = tensors[name]
        if list(x.shape) != meta["shape"] or str(x.dtype) != meta["dtype"]:
            raise SnapshotError(
                f"{path}: tensor {name!r} is {x.dtype}{list(x.shape)}, manifest says "
                f"{meta['dtype']}{meta['shape']}"
            )
        if host_checksum(x) != meta["checksum"]:
            raise SnapshotError(f"{path}: tensor {name!r} fails its checksum: the files are damaged")
