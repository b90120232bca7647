"""One process of a jax.distributed learner run, started by tests/test_learner.py.

Usage: distributed_step.py COORDINATOR_ADDRESS NUM_PROCESSES PROCESS_ID OUT.npz [lora | packed]
Each process feeds its own rows of every batch; process 0 writes the final parameters. With `lora`
the learner trains adapters, and every process publishes them together as a snapshot in OUT.snapshots;
without, every process saves the model together as a Hugging Face model directory in OUT.model. With
`packed` each process packs its rows (learner.pack_tokens).
"""

import sys

import jax


address, num_processes, process_id, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(address, num_processes, process_id)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrl.learner import Learner  # noqa: E402
from jaxrl.losses import LossConfig  # noqa: E402
from jaxrl.models import Decoder, save_pretrained  # noqa: E402
from jaxrl.models.lora import LoraConfig  # noqa: E402
from jaxrl.optim import OptimizerConfig  # noqa: E402
from jaxrl.sharding import MeshConfig, make_mesh  # noqa: E402
from jaxrl.snapshots import SnapshotWriter  # noqa: E402
from jaxrl.tiny import tiny_config  # noqa: E402
from jaxrl.train_step import LearnerConfig  # noqa: E402

B, P, C, VOCAB = 8, 5, 6, 128
lora = LoraConfig(rank=4) if sys.argv[5:] == ["lora"] else None
cfg = LearnerConfig(group_size=4, loss=LossConfig(loss_type="dapo"), optimizer=OptimizerConfig(learning_rate=1e-3),
                    lora=lora, pack_tokens=128 if sys.argv[5:] == ["packed"] else None)
model_cfg = tiny_config("llama", vocab_size=VOCAB)
learner = Learner(Decoder(model_cfg, nnx.Rngs(0)), cfg, make_mesh(MeshConfig(fsdp=-1)))
rng = np.random.default_rng(0)
for step in range(2):
    completion_mask = (np.arange(C)[None] < rng.integers(1, C + 1, (B, 1))).astype(np.int32)
    batch = dict(
        prompt_BxP=rng.integers(0, VOCAB, (B, P)).astype(np.int32),
        prompt_mask_BxP=np.ones((B, P), np.int32),
        completion_BxC=(rng.integers(0, VOCAB, (B, C)) * completion_mask).astype(np.int32),
        completion_mask_BxC=completion_mask,
        loss_mask_BxC=completion_mask,
        rewards_BxR=rng.normal(size=(B, 1)).astype(np.float32),
    )
    rows = B // num_processes
    learner.update({k: v[process_id * rows:(process_id + 1) * rows] for k, v in batch.items()})
params = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(learner.state.params)]
if lora is not None:
    writer = SnapshotWriter(out + ".snapshots", model_cfg, lora=lora)
    writer.publish(learner.state.params, 1)
    writer.close()
else:  # as a warm start of every weight writes a LoRA run's base model
    save_pretrained(learner.model(), out + ".model")
if process_id == 0:
    np.savez(out, *params)
if num_processes > 1:
    jax.distributed.shutdown()
