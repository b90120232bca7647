"""Weight snapshots for the bridge: params only, serving dtype, keyed by Hugging Face names.

A snapshot is an Orbax checkpoint numbered by policy version with two items: `weights`, a flat
{HF tensor name: array} that every process writes for its own shards, and `manifest` (JSON):
the HF config and each tensor's shape, dtype and checksum. Orbax commits a snapshot by renaming
its temporary directory, so readers only ever list finished ones; the checksums catch the rest
(uncompressed zarr has no checksum of its own, so a damaged data file would read back silently).

Speed (measured by experiments/bench/snapshots.py on a 2-core CPU machine):
- zarr3 without compression: zstd costs more CPU than the disk time it saves.
- the cast and transposes run as one small XLA program per tensor, and the checksums are NumPy
  sums over each process's own shards, read as uint32 words (no conversion pass); one XLA
  program for all transposes and XLA:CPU reductions were each several times slower.
- OCDBT data files of at most `DATA_FILE_BYTES`, so several are written at once.
- the reader maps the data files (tensorstore's `memmap` file mode) instead of reading them into
  a buffer and copying that: one copy from the page cache instead of two. Committed files are
  never changed, only deleted by pruning, which leaves an open mapping valid.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import AnyPreservationPolicy, LatestN

from jaxrl.models import ModelConfig, hf_names
from jaxrl.models.config import DTYPES

FORMAT = "jaxrl-weights-v2"  # v2: checksums of 2-byte dtypes sum column pairs as uint32 words
# With Orbax's default (2 GiB) a 512 MB snapshot took ~1.5x as long to publish; 16-128 MB were
# measured and 64 MB was best.
DATA_FILE_BYTES = 64 << 20


class SnapshotError(ValueError):
    """A snapshot that must not be served: names the snapshot and what is wrong with it."""


@dataclasses.dataclass
class Snapshot:
    version: int
    hf_config: dict
    tensors: dict[str, np.ndarray]
    path: Path


@functools.partial(jax.jit, static_argnames=("transposed", "dtype"))
def _to_serving(x: jax.Array, transposed: bool, dtype) -> jax.Array:
    return (x.T if transposed else x).astype(dtype)


def serving_tensors(cfg: ModelConfig, params: nnx.State, dtype) -> dict[str, jax.Array]:
    """`to_hf_tensors(cfg, params, dtype)`, one small program per tensor.

    XLA:CPU ran a single program of all the transposes 2-3x slower than one per tensor.
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


def _checksums(tensors: dict[str, jax.Array]) -> dict[str, int]:
    """Checksum of every tensor without gathering it: this process's shards, then a sum over processes."""
    local = np.zeros(len(tensors), np.uint32)
    for i, x in enumerate(tensors.values()):
        # replica_id 0 only, so data replicated over devices or processes is counted once.
        local[i] = sum(
            host_checksum(np.asarray(s.data), (s.index[-1].start or 0) if s.index else 0)
            for s in x.addressable_shards
            if s.replica_id == 0
        ) % 2**32
    if jax.process_count() > 1:
        local = multihost_utils.process_allgather(local).sum(axis=0, dtype=np.uint32)
    return dict(zip(tensors, map(int, local)))


class _InUse:
    """Preservation policy: keeps the versions an engine still serves (set by the writer)."""

    def __init__(self):
        self.versions: frozenset[int] = frozenset()

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [c.step in self.versions for c in checkpoints]


class _MappedNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Restores through mmap: one copy from the page cache into the array instead of two."""

    async def deserialize(self, infos: Sequence, args=None) -> list[np.ndarray]:
        if infos:
            context = ts.Context(
                ts.Context.Spec({"file_io_mode": {"mode": "memmap"}}), parent=infos[0].ts_context
            )
            for info in infos:
                info.ts_context = context
        return await super().deserialize(infos, args)


def _weights_handler(reader: bool = False) -> ocp.PyTreeCheckpointHandler:
    kwargs = {}
    if reader:
        kwargs["type_handler_registry"] = ocp.type_handlers.create_type_handler_registry(
            (np.ndarray, _MappedNumpyHandler()), (jax.Array, ocp.type_handlers.ArrayHandler())
        )
    return ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False, **kwargs)


class SnapshotWriter:
    """Publishes snapshots of a model's params under `directory`, keeping the newest `keep`.

    Every process of a multi-host run calls `publish` with the same arguments.
    """

    def __init__(self, directory: str | Path, model_cfg: ModelConfig, dtype: str | None = None, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.model_cfg = model_cfg
        self.dtype = dtype or model_cfg.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"snapshot dtype={self.dtype!r}; allowed: {sorted(DTYPES)}")
        if keep < 1:
            raise ValueError(f"snapshot keep={keep!r} must be >= 1")
        self.keep = keep
        self._in_use = _InUse()
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"weights": _weights_handler(), "manifest": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                cleanup_tmp_directories=True,
                preservation_policy=AnyPreservationPolicy([LatestN(keep), self._in_use]),
            ),
        )

    def publish(self, params: nnx.State, version: int, wait: bool = True, in_use: Iterable[int] = ()) -> Path:
        """Writes snapshot `version`; with `wait`, returns once it is committed and visible.

        Once it is committed, snapshots beyond the newest `keep` are deleted, except `in_use`.
        """
        tensors = serving_tensors(self.model_cfg, params, DTYPES[self.dtype])
        checksums = _checksums(tensors)
        manifest = {
            "format": FORMAT,
            "version": version,
            "hf_config": {**self.model_cfg.to_hf(), "dtype": self.dtype},
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype), "checksum": checksums[k]}
                for k, v in tensors.items()
            },
        }
        self._in_use.versions = frozenset(in_use)
        self.manager.save(
            version,
            args=ocp.args.Composite(
                weights=ocp.args.PyTreeSave(tensors, ocdbt_target_data_file_size=DATA_FILE_BYTES),
                manifest=ocp.args.JsonSave(manifest),
            ),
            force=True,
        )
        if wait:
            self.manager.wait_until_finished()
        return self.directory / str(version)

    def wait(self) -> None:
        """Blocks until a `publish(..., wait=False)` is committed (and old snapshots pruned)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class SnapshotReader:
    """Finds and restores finished snapshots as NumPy arrays, without knowing jaxrl's tree."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        if not self.directory.is_dir():
            raise SnapshotError(f"{self.directory}: snapshot directory does not exist")
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"weights": _weights_handler(reader=True), "manifest": ocp.JsonCheckpointHandler()},
            # What read_only implies anyway; Orbax warns about each one left at its default.
            options=ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False),
        )

    def versions(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_version(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def load(self, version: int | None = None) -> Snapshot:
        """Restores and verifies `version` (default: newest); raises SnapshotError if unusable."""
        versions = self.versions()
        if version is None:
            if not versions:
                raise SnapshotError(f"{self.directory}: no finished snapshot yet")
            version = versions[-1]
        path = self.directory / str(version)
        if version not in versions:
            raise SnapshotError(f"{path}: no finished snapshot with version {version} (have {versions})")
        try:
            manifest = self.manager.restore(
                version, args=ocp.args.Composite(manifest=ocp.args.JsonRestore())
            )["manifest"]
        except Exception as e:  # Orbax raises many types for missing or damaged items
            raise SnapshotError(f"{path}: manifest cannot be read ({type(e).__name__}: {e})") from e
        found = manifest.get("format") if isinstance(manifest, dict) else None
        if found != FORMAT or "tensors" not in manifest:
            raise SnapshotError(
                f"{path}: manifest format is {found!r}, this reader needs {FORMAT!r}; publish the "
                f"weights again with this version of jaxrl"
            )
        # The manifest names the tensors, so the weights need no metadata pass of their own.
        restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in manifest["tensors"]}
        try:
            tensors = self.manager.restore(
                version, args=ocp.args.Composite(weights=ocp.args.PyTreeRestore(restore_args=restore_args))
            )["weights"]
        except Exception as e:  # Orbax/tensorstore raise many types for damaged files
            raise SnapshotError(f"{path}: cannot be restored ({type(e).__name__}: {e})") from e
        _verify(path, manifest["tensors"], tensors)
        # In the manifest's (Hugging Face) order; Orbax returns them sorted.
        tensors = {name: tensors[name] for name in manifest["tensors"]}
        return Snapshot(version, manifest["hf_config"], tensors, path)


def _verify(path: Path, expected: dict, tensors: dict[str, np.ndarray]) -> None:
    if set(expected) != set(tensors):
        missing = sorted(set(expected) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(expected))[:5]
        raise SnapshotError(f"{path}: tensors differ from the manifest (missing {missing}, extra {extra})")
    for name, meta in expected.items():
        x = tensors[name]
        if list(x.shape) != meta["shape"] or str(x.dtype) != meta["dtype"]:
            raise SnapshotError(
                f"{path}: tensor {name!r} is {x.dtype}{list(x.shape)}, manifest says "
                f"{meta['dtype']}{meta['shape']}"
            )
        if host_checksum(x) != meta["checksum"]:
            raise SnapshotError(f"{path}: tensor {name!r} fails its checksum: the files are damaged")
