"""One process of a two-process snapshot publish, started by tests/test_snapshots.py.

Usage: snapshot_multihost.py COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID DIRECTORY
The params are sharded over the devices of every process; each process writes its own shards.
"""

import sys

import jax


address, num_processes, process_id, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(address, num_processes, process_id)

from flax import nnx  # noqa: E402

from jaxrl.models import Decoder  # noqa: E402
from jaxrl.sharding import MeshConfig, make_mesh, param_shardings  # noqa: E402
from jaxrl.snapshots import SnapshotWriter  # noqa: E402
from jaxrl.tiny import tiny_config  # noqa: E402

cfg = tiny_config("qwen2", tied=False, vocab_size=256)
params = nnx.state(Decoder(cfg, nnx.Rngs(3)), nnx.Param)
mesh = make_mesh(MeshConfig(fsdp=2, tp=-1))
params = jax.device_put(params, param_shardings(params, mesh))
writer = SnapshotWriter(directory, cfg, dtype="bfloat16")
writer.publish(params, 1)
writer.close()
jax.distributed.shutdown()
