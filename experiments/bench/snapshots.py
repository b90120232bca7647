"""Weight snapshots: publish and load time against numpy.save / numpy.load of the same bytes.

    python -m experiments.bench.snapshots [--size-mb 512] [--repeats 7] [--tiny] [--dir DIR]

The model is a synthetic Qwen3-style decoder with float32 params on the device, sized to at least
--size-mb of bfloat16 serving weights (random values; nothing is initialised or trained).

What is timed (wall clock; each time is the median over --repeats rounds; ratios are medians of
the per-round ratios, ours against numpy's in the same round):
  publish        `SnapshotWriter.publish(params, v)` until the snapshot is committed: the cast to
                 bfloat16 and the Hugging Face transposes, the checksums, the write of the Orbax
                 checkpoint through TensorStore (every data file fsync'ed) and the commit rename.
  numpy_save     `numpy.save` of the finished serving tensors, already on the host (bfloat16
                 bytes saved as uint16), one .npy per tensor, each file fsync'ed: the same bytes
                 to disk the same way, without the conversion we are charged for.
  numpy_publish  the same conversion as ours, then numpy_save: a NumPy publisher doing our job
                 (`publish_same_work_ratio`).
  load           `SnapshotReader(dir).load(v)`: the manifest, the restore as NumPy arrays and the
                 checksum verification, against `numpy.load` of every .npy.
  cold / warm    after the writes every file of both is fsync'ed and dropped from the page cache
                 (POSIX_FADV_DONTNEED), so the first read of each comes from the disk (cold); the
                 same read again at once comes from the page cache (warm).
In each round the writers take turns going first and the readers alternate. Before each timed
write the disk is synced and left idle for a second (untimed). Old snapshots are deleted
between rounds (untimed). `load_average` (1 min, at the end) says how busy the machine was: on
a shared machine the figures move by tens of percent from run to run.

Headline: `round_trip_ratio`, (publish + load) / (numpy_save + numpy_load) per round, cold: a
weight sync against writing and reading the same bytes with NumPy (`round_trip_warm_ratio` with
the warm load). `load_ratio` is the cold-cache ratio: the same bytes read back from storage, as a
bridge on another host does, or after the pages were evicted. `load_warm_ratio` is the
same-host case (`jaxrl train` runs the bridge beside the trainer, which just wrote the files):
a memory-copy contest that numpy's one `readinto` per file into huge pages wins, while ours maps
the files, copies out of the mappings into freshly faulted arrays, checksums every byte and runs
Orbax's Python: about twice numpy's CPU, so on a busy machine it swings the most.
`publish_ratio` (and so `round_trip_ratio`) charges us for the cast and the transposes that
numpy's baseline is spared; `publish_same_work_ratio` is the like-for-like figure.
`orbax_*`: stock Orbax (`PyTreeCheckpointer`) saving and restoring the finished serving tensors,
the same job as numpy's (no conversion), timed beside it: what writing the snapshots through
Orbax's own API instead of TensorStore would cost (`orbax_round_trip_ratio` against numpy's).
`--dir /dev/shm` measures where `jaxrl train` puts the snapshots of a run that starts its own
bridges: tmpfs has no page cache to drop, so there cold and warm are the same memory reads. `convert_s` and `checksum_s` time those
two publish steps alone (the checksum is also the verification cost of a load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl.models import Decoder, ModelConfig
from jaxrl.snapshots import SnapshotReader, SnapshotWriter, host_checksum, serving_tensors

MB = 1 << 20
# Qwen3-0.6B-like widths; the layer count is chosen to reach --size-mb.
SHAPES = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_heads=16,
              num_kv_heads=8, head_dim=64)
TINY_SHAPES = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_heads=4,
                   num_kv_heads=2, head_dim=32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=None, help="bfloat16 weights, at least (default 512)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 7)")
    p.add_argument("--tiny", action="store_true", help="a few MB and 2 rounds (CI smoke run)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    args.size_mb = args.size_mb or (4 if args.tiny else 512)
    args.repeats = args.repeats or (2 if args.tiny else 7)
    args.settle_s = 0.1 if args.tiny else 1.0
    return args


def model_config(size_mb: float, shapes: dict) -> ModelConfig:
    """A Qwen3-style config whose bfloat16 params take at least `size_mb`."""
    base = ModelConfig(model_type="qwen3", qk_norm=True, num_layers=1, **shapes)
    one_layer = _num_params(base) - _num_params(base.replace(num_layers=0))
    fixed = _num_params(base.replace(num_layers=0))
    layers = max(1, math.ceil((size_mb * MB / 2 - fixed) / one_layer))
    return base.replace(num_layers=layers)


def _num_params(cfg: ModelConfig) -> int:
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def random_params(cfg: ModelConfig, seed: int = 0) -> nnx.State:
    """float32 params on the device, filled with NumPy random numbers (no model init)."""
    rng = np.random.default_rng(seed)
    abstract = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))), nnx.Param)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32) * 0.02), abstract)


def files(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, names in os.walk(root) for f in names]


def drop_from_page_cache(root: Path) -> None:
    for path in files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def numpy_save(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    directory.mkdir()
    for name, x in tensors.items():
        with open(directory / f"{name}.npy", "wb") as f:
            np.save(f, x.view(np.uint16))
            f.flush()
            os.fsync(f.fileno())


def numpy_publish(directory: Path, cfg: ModelConfig, params) -> None:
    """What a NumPy publisher does: the same conversion as ours, then `numpy_save`."""
    numpy_save(directory, {k: np.asarray(v) for k, v in serving_tensors(cfg, params, jnp.bfloat16).items()})


def numpy_load(directory: Path, names) -> dict[str, np.ndarray]:
    return {name: np.load(directory / f"{name}.npy").view(ml_dtypes.bfloat16) for name in names}


def convert(cfg, params):
    return jax.block_until_ready(serving_tensors(cfg, params, jnp.bfloat16))


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def settle(seconds: float) -> None:
    """Untimed: flush every dirty page (and pending discards) and let the disk go quiet, so no
    write pays for the one before it (with 0.2 s, the second writer of a pair was up to 2x slower)."""
    os.sync()
    time.sleep(seconds)


def run(args) -> dict:
    cfg = model_config(args.size_mb, TINY_SHAPES if args.tiny else SHAPES)
    params = random_params(cfg)
    host = {k: np.asarray(v) for k, v in serving_tensors(cfg, params, jnp.bfloat16).items()}
    size_mb = sum(x.nbytes for x in host.values()) / MB
    print(f"model: qwen3, {cfg.num_layers} layers, {len(host)} tensors, {size_mb:.0f} MB bfloat16 "
          f"(from float32 params)", flush=True)

    root = Path(tempfile.mkdtemp(prefix="bench-snapshots-", dir=args.dir))
    try:
        # keep: Orbax never prunes inside a timed publish; old versions go between rounds.
        writer = SnapshotWriter(root / "ours", cfg, dtype="bfloat16", keep=args.repeats + 2)
        writer.publish(params, 0)  # compiles the conversions
        times: dict[str, list[float]] = {}

        def record(key, seconds):
            times.setdefault(key, []).append(seconds)

        orbax = ocp.PyTreeCheckpointer()
        writes = {
            "publish": lambda v: writer.publish(params, v),
            "numpy_save": lambda v: numpy_save(root / f"numpy-{v}", host),
            "numpy_publish": lambda v: numpy_publish(root / f"numpy-publish-{v}", cfg, params),
            "orbax_save": lambda v: orbax.save(root / f"orbax-{v}", host),
        }
        for version in range(1, args.repeats + 1):
            np_dir, orbax_dir = root / f"numpy-{version}", root / f"orbax-{version}"
            names = list(writes)[version % 4:] + list(writes)[:version % 4]  # each goes first in turn
            for name in names:
                settle(args.settle_s)
                record(name, timed(writes[name], version)[0])
            shutil.rmtree(root / f"numpy-publish-{version}")
            for directory in (np_dir, orbax_dir, root / "ours" / str(version)):
                drop_from_page_cache(directory)
            readers = ["ours", "numpy", "orbax"]
            for cache in ("cold", "warm"):
                for reader in readers[version % 3:] + readers[:version % 3]:
                    if reader == "ours":
                        seconds, snapshot = timed(SnapshotReader(root / "ours").load, version)
                        record(f"load_{cache}", seconds)
                        if version == 1 and cache == "cold":
                            for name, x in host.items():
                                got = snapshot.tensors[name]
                                np.testing.assert_array_equal(got.view(np.uint16), x.view(np.uint16))
                        del snapshot
                    elif reader == "numpy":
                        record(f"numpy_load_{cache}", timed(numpy_load, np_dir, host)[0])
                    else:
                        record(f"orbax_load_{cache}", timed(orbax.restore, orbax_dir)[0])
            shutil.rmtree(np_dir)
            shutil.rmtree(orbax_dir)
            shutil.rmtree(root / "ours" / str(version - 1))
            print(f"round {version}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
        writer.close()

        # Where the publish time goes: its two compute steps alone.
        for _ in range(args.repeats):
            record("convert", timed(convert, cfg, params)[0])
            record("checksum", timed(lambda: [host_checksum(x) for x in host.values()])[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(ours, theirs):
        # Median of the per-round ratios: each pair ran back to back, under the same load.
        return statistics.median(a / b for a, b in zip(times[ours], times[theirs]))

    def round_trip(load, numpy_load, publish="publish"):
        return statistics.median((p + l) / (s + n) for p, l, s, n in zip(
            times[publish], times[load], times["numpy_save"], times[numpy_load]))

    return {
        "round_trip_ratio": round_trip("load_cold", "numpy_load_cold"),
        "round_trip_warm_ratio": round_trip("load_warm", "numpy_load_warm"),
        # Stock Orbax (PyTreeCheckpointer) saving and restoring the finished serving tensors: numpy's
        # job, so against numpy's figures; ours also converts (publish_same_work_ratio compares that).
        "orbax_round_trip_ratio": round_trip("orbax_load_cold", "numpy_load_cold", "orbax_save"),
        "orbax_save_s": med["orbax_save"],
        "orbax_load_s": med["orbax_load_cold"],
        "orbax_save_ratio": ratio("orbax_save", "numpy_save"),
        "orbax_load_ratio": ratio("orbax_load_cold", "numpy_load_cold"),
        "orbax_load_warm_ratio": ratio("orbax_load_warm", "numpy_load_warm"),
        "publish_s": med["publish"],
        "load_s": med["load_cold"],
        "publish_ratio": ratio("publish", "numpy_save"),
        "load_ratio": ratio("load_cold", "numpy_load_cold"),
        "publish_same_work_ratio": ratio("publish", "numpy_publish"),
        "load_warm_s": med["load_warm"],
        "load_warm_ratio": ratio("load_warm", "numpy_load_warm"),
        "numpy_save_s": med["numpy_save"],
        "numpy_publish_s": med["numpy_publish"],
        "numpy_load_s": med["numpy_load_cold"],
        "numpy_load_warm_s": med["numpy_load_warm"],
        "convert_s": med["convert"],
        "checksum_s": med["checksum"],
        "size_mb": round(size_mb, 1),
        "repeats": args.repeats,
        "load_average": round(os.getloadavg()[0], 1),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    figures = run(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
