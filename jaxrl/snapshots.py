"""Weight snapshots for the bridge: params only, serving dtype, keyed by Hugging Face names.

A snapshot is an Orbax checkpoint numbered by policy version with two items: `weights`, a flat
{HF tensor name: array} written by every process for its own shards, and `manifest` (JSON):
the HF config and each tensor's shape, dtype and checksum. Orbax commits a snapshot by renaming
its temporary directory, so readers only ever list finished ones; the checksums catch the rest
(a zarr chunk that went missing reads back as zeros rather than failing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl.models import ModelConfig, to_hf_tensors
from jaxrl.models.config import DTYPES

FORMAT = "jaxrl-weights-v1"


class SnapshotError(ValueError):
    """A snapshot that must not be served: names the snapshot and what is wrong with it."""


@dataclasses.dataclass
class Snapshot:
    version: int
    hf_config: dict
    tensors: dict[str, np.ndarray]
    path: Path


def _words(x):
    """The array's raw bits as unsigned words (uint16 or uint32), the same on host and device."""
    word = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, word)


@jax.jit
def _device_checksums(tensors: dict[str, jax.Array]) -> dict[str, jax.Array]:
    # Sum of raw words modulo 2**32: exact integer arithmetic, so a reader on any device (or
    # NumPy) reproduces it bit for bit; any changed word changes it.
    return {k: jnp.sum(_words(v).astype(jnp.uint32), dtype=jnp.uint32) for k, v in tensors.items()}


def host_checksum(x: np.ndarray) -> int:
    word = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    return int(np.ascontiguousarray(x).view(word).sum(dtype=np.uint32))


def _handlers():
    return {
        "weights": ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False),
        "manifest": ocp.JsonCheckpointHandler(),
    }


class SnapshotWriter:
    """Publishes snapshots of a model's params under `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | Path, model_cfg: ModelConfig, dtype: str | None = None, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.model_cfg = model_cfg
        self.dtype = dtype or model_cfg.dtype
        if self.dtype not in DTYPES:
            raise ValueError(f"snapshot dtype={self.dtype!r}; allowed: {sorted(DTYPES)}")
        if keep < 1:
            raise ValueError(f"snapshot keep={keep!r} must be >= 1")
        self.keep = keep
        self.manager = ocp.CheckpointManager(
            self.directory,
            item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(cleanup_tmp_directories=True),
        )
        self._to_serving = jax.jit(
            lambda params: to_hf_tensors(model_cfg, params, DTYPES[self.dtype])
        )

    def publish(self, params: nnx.State, version: int, wait: bool = True, in_use: Iterable[int] = ()) -> Path:
        """Writes snapshot `version`; with `wait`, returns once it is committed and visible."""
        tensors = self._to_serving(params)
        checksums = jax.device_get(_device_checksums(tensors))
        manifest = {
            "format": FORMAT,
            "version": version,
            "hf_config": {**self.model_cfg.to_hf(), "dtype": self.dtype},
            "tensors": {
                k: {"shape": list(v.shape), "dtype": str(v.dtype), "checksum": int(checksums[k])}
                for k, v in tensors.items()
            },
        }
        self.manager.save(
            version,
            args=ocp.args.Composite(
                weights=ocp.args.PyTreeSave(tensors), manifest=ocp.args.JsonSave(manifest)
            ),
            force=True,
        )
        if wait:
            self.manager.wait_until_finished()
        self.prune(in_use)
        return self.directory / str(version)

    def prune(self, in_use: Iterable[int] = ()) -> None:
        """Deletes all but the newest `keep` snapshots and those `in_use` by an engine."""
        self.manager.wait_until_finished()
        versions = sorted(self.manager.all_steps())
        protected = set(versions[-self.keep:]) | set(in_use)
        for version in versions:
            if version not in protected:
                self.manager.delete(version)

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
            item_handlers=_handlers(),
            options=ocp.CheckpointManagerOptions(read_only=True),
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
            tree = self.manager.item_metadata(version)["weights"].tree
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            tensors = self.manager.restore(
                version,
                args=ocp.args.Composite(weights=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)),
            )["weights"]
        except Exception as e:  # Orbax/tensorstore raise many types for damaged files
            raise SnapshotError(f"{path}: cannot be restored ({type(e).__name__}: {e})") from e
        _verify(path, manifest, tensors)
        return Snapshot(version, manifest["hf_config"], tensors, path)


def _verify(path: Path, manifest: dict, tensors: dict[str, np.ndarray]) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SnapshotError(f"{path}: manifest is not a {FORMAT} manifest")
    expected = manifest["tensors"]
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
