"""A minimal training run that checkpoints every step and resumes from its run directory.

Usage: resumable_run.py RUN_DIR TOTAL_STEPS FSDP TP [LORA_RANK]
Started (and SIGKILLed) by tests/test_checkpoints.py; prints `done N` after each step and
writes the final parameters (with LORA_RANK: the adapters, then the frozen base) to RUN_DIR/final.npz.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from batches import make_batch  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.checkpoints import TrainCheckpointer, abstract_like  # noqa: E402
from jaxrl.learner import Learner  # noqa: E402
from jaxrl.losses import LossConfig  # noqa: E402
from jaxrl.models import Decoder  # noqa: E402
from jaxrl.models.lora import LoraConfig  # noqa: E402
from jaxrl.optim import OptimizerConfig  # noqa: E402
from jaxrl.sharding import MeshConfig, make_mesh  # noqa: E402
from jaxrl.tiny import tiny_config  # noqa: E402
from jaxrl.train_step import LearnerConfig  # noqa: E402

run_dir, total, fsdp, tp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lora = LoraConfig(rank=int(sys.argv[5]), dropout=0.1) if len(sys.argv) > 5 else None
model_cfg = tiny_config("qwen3", vocab_size=128)
cfg = LearnerConfig(
    group_size=4, grad_accum=2,
    loss=LossConfig(loss_type="dapo", beta=0.01, is_level="token"),
    optimizer=OptimizerConfig(learning_rate=1e-3, schedule="cosine", warmup_steps=2, total_steps=10), lora=lora,
)
mesh = make_mesh(MeshConfig(fsdp=fsdp, tp=tp), jax.devices()[: fsdp * tp])
learner = Learner(Decoder(model_cfg, nnx.Rngs(0)), cfg, mesh)
ckpt = TrainCheckpointer(run_dir / "checkpoints", keep=2)
start = 0
if ckpt.latest_step() is not None:
    learner.state, meta = ckpt.restore(abstract_like(learner.state, learner.shardings))
    start = meta["data_position"]
    print(f"resumed {start}", flush=True)
for step in range(start, total):
    learner.update(make_batch(seed=step))
    ckpt.save(step + 1, learner.state, {"data_position": step + 1, "model_config": model_cfg.to_hf()})
    print(f"done {step + 1}", flush=True)
ckpt.close()
np.savez(run_dir / "final.npz", *[np.asarray(x) for x in jax.tree.leaves((learner.state.params, learner.frozen))])
