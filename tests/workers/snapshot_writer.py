"""Publishes weight snapshots from a separate process, for tests/test_snapshots.py.

Usage: snapshot_writer.py DIRECTORY VERSION [VERSION ...]
Prints `published V` after each snapshot is committed. The model is big enough (~100 MB of
float32 serving weights) that a test can kill the process in the middle of writing one.
"""

import sys

from flax import nnx

from jaxrl.models import Decoder
from jaxrl.snapshots import SnapshotWriter
from jaxrl.tiny import tiny_config

CONFIG = dict(vocab_size=49152, hidden_size=256, tied=False)

directory, versions = sys.argv[1], [int(v) for v in sys.argv[2:]]
cfg = tiny_config("qwen3", **CONFIG)
writer = SnapshotWriter(directory, cfg, dtype="float32", keep=10)
for version in versions:
    writer.publish(nnx.state(Decoder(cfg, nnx.Rngs(version)), nnx.Param), version)
    print(f"published {version}", flush=True)
writer.close()
