"""Train checkpoints: bit-exact resume after SIGKILL, restore onto another mesh, shape mismatches."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.checkpoints import CheckpointMismatchError, TrainCheckpointer, abstract_like
from jaxrl.learner import Learner
from jaxrl.models import Decoder
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig

from batches import make_batch

WORKER = Path(__file__).parent / "workers" / "resumable_run.py"


def _start(run_dir, total, fsdp=2, tp=1, lora_rank=None):
    # With the persistent compilation cache conftest gives every child: the first process of a case compiles
    # the train step (none, once a session has), the other two load that executable.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(run_dir), str(total), str(fsdp), str(tp), *([str(lora_rank)] * bool(lora_rank))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _finish(proc):
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    return out


def _final(run_dir):
    with np.load(run_dir / "final.npz") as f:
        return [f[k] for k in f.files]


# With LoRA (adapter dropout on): checkpoints hold the adapters and their optimiser state, and the
# frozen base comes back from the model, bitwise as it was.
@pytest.mark.parametrize("lora_rank", [None, 4], ids=["full", "lora"])
def test_sigkilled_run_resumes_to_the_same_parameters_bit_exact(tmp_path, lora_rank):
    total, kill_after = 6, 3
    _finish(_start(tmp_path / "straight", total, lora_rank=lora_rank))

    proc = _start(tmp_path / "killed", total, lora_rank=lora_rank)
    for line in proc.stdout:
        if line.strip() == f"done {kill_after}":
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "final.npz").exists()

    out = _finish(_start(tmp_path / "killed", total, lora_rank=lora_rank))
    resumed_from = int(out.split("resumed ")[1].split()[0])
    assert 1 <= resumed_from <= kill_after
    straight, resumed = _final(tmp_path / "straight"), _final(tmp_path / "killed")
    assert len(straight) == len(resumed) > 10
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a, b)


def _learner(mesh_cfg, n_devices, model_cfg=None, beta=0.0):
    from jaxrl.losses import LossConfig

    cfg = LearnerConfig(group_size=4, loss=LossConfig(beta=beta))
    model = Decoder(model_cfg or tiny_config("qwen3", vocab_size=128), nnx.Rngs(0))
    return Learner(model, cfg, make_mesh(mesh_cfg, jax.devices()[:n_devices]))


def test_restore_onto_a_different_mesh(tmp_path):
    saver = _learner(MeshConfig(fsdp=8), 8, beta=0.01)
    saver.update(make_batch(seed=0, sampler=False))
    ckpt = TrainCheckpointer(tmp_path, async_save=True)
    ckpt.save(1, saver.state, {"data_position": 1}, force=True)
    ckpt.wait()

    for mesh_cfg, n in [(MeshConfig(fsdp=4, tp=2), 8), (MeshConfig(fsdp=1), 1)]:
        target = _learner(mesh_cfg, n, beta=0.01)
        state, meta = ckpt.restore(abstract_like(target.state, target.shardings))
        assert meta == {"data_position": 1}
        for a, b in zip(jax.tree.leaves(saver.state), jax.tree.leaves(state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        up = state.params["layers"][0]["mlp"]["up_proj"]["kernel"][...]
        assert up.sharding == target.shardings.params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
        target.state = state
        target.update(make_batch(seed=1, sampler=False))  # the restored state trains on the new mesh
        assert target.step == 2
    ckpt.close()


def test_saving_compiles_nothing(tmp_path):
    """A run's first checkpoint is saved mid-run, and a run compiles nothing after its first step. Arrays
    replicated on every device (LoRA adapters, norms) are what Orbax's replica-parallel save sliced, one
    program per replica and device: 24 in a tiny LoRA run on 8 devices, hidden when the persistent cache
    held them. Shapes of this test's own, so that no program an earlier test compiled is reused."""
    from jaxrl.compilation import programs
    from jaxrl.models.lora import LoraConfig

    model = Decoder(tiny_config("qwen3", vocab_size=96, hidden_size=48), nnx.Rngs(0))
    learner = Learner(model, LearnerConfig(group_size=4, lora=LoraConfig(rank=3)), make_mesh(MeshConfig(fsdp=8)))
    replicated = [x for x in jax.tree.leaves(learner.state) if x.ndim and x.sharding.is_fully_replicated]
    assert replicated  # what the save sliced
    ckpt = TrainCheckpointer(tmp_path, async_save=True)
    before = programs()
    ckpt.save(1, learner.state, {"step": 1}, force=True)
    ckpt.wait()
    assert programs() == before
    state, _ = ckpt.restore(abstract_like(learner.state, learner.shardings))
    for a, b in zip(jax.tree.leaves(learner.state), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()


def test_resuming_with_a_different_model_shape_names_the_differing_arrays(tmp_path):
    saver = _learner(MeshConfig(fsdp=1), 1)
    ckpt = TrainCheckpointer(tmp_path, async_save=False)
    ckpt.save(0, saver.state, {}, force=True)
    other = _learner(MeshConfig(fsdp=1), 1, tiny_config("qwen3", vocab_size=128, intermediate_size=96))
    with pytest.raises(CheckpointMismatchError, match=r"(?s)differing arrays.*params/layers/0/mlp/up_proj/kernel: checkpoint \(64, 128\), configured \(64, 96\)"):
        ckpt.restore(abstract_like(other.state, other.shardings))
    deeper = _learner(MeshConfig(fsdp=1), 1, tiny_config("qwen3", vocab_size=128, num_layers=3))
    with pytest.raises(CheckpointMismatchError, match="params/layers/2/.*missing from the checkpoint"):
        ckpt.restore(abstract_like(deeper.state, deeper.shardings))
    ckpt.close()


def test_no_checkpoint_is_a_clear_error(tmp_path):
    learner = _learner(MeshConfig(fsdp=1), 1)
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        TrainCheckpointer(tmp_path).restore(abstract_like(learner.state, learner.shardings))


def test_saves_every_n_steps_and_keeps_the_last_k(tmp_path):
    learner = _learner(MeshConfig(fsdp=1), 1)
    ckpt = TrainCheckpointer(tmp_path, keep=2, every=2, async_save=False)
    saved = [ckpt.save(step, learner.state, {"step": step}) for step in range(1, 7)]
    assert saved == [False, True, False, True, False, True]
    assert sorted(ckpt.manager.all_steps()) == [4, 6]
    ckpt.close()


def test_a_save_that_fails_in_the_background_is_raised_at_the_next_step_naming_its_step(tmp_path, monkeypatch):
    import errno
    import time

    import orbax.checkpoint as ocp

    from jaxrl.checkpoints import CheckpointFailed

    save_meta = ocp.JsonCheckpointHandler._save_fn

    async def full_disk_at_step_4(self, item, directory):
        if item["step"] == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await save_meta(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full_disk_at_step_4)
    learner = _learner(MeshConfig(fsdp=1), 1)
    ckpt = TrainCheckpointer(tmp_path, keep=2, every=2)
    assert [ckpt.save(step, learner.state, {"step": step}) for step in range(1, 5)] == [False, True, False, True]
    deadline = time.monotonic() + 60
    while ckpt.manager.is_saving_in_progress():  # the background write of step 4 fails meanwhile
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(CheckpointFailed, match="checkpoint of step 4 failed") as e:
        ckpt.save(5, learner.state, {"step": 5})  # not a saving step: found all the same
    assert "No space left on device" in str(e.value.__cause__)
    assert ckpt.latest_step() == 2
    ckpt.close()


def test_a_second_ctrl_c_while_a_save_runs_stops_the_wait_and_keeps_the_save(tmp_path, monkeypatch):
    # `jaxrl train`'s second Ctrl-C raises wherever the main thread is, here in the wait for a save.
    # The save goes on in the background; closing the checkpointer on the way out waits for it again,
    # and the step is kept (its directory removed under it, the save failed, and the run's error
    # named a checkpoint instead of the signal).
    import threading

    import orbax.checkpoint as ocp

    release = threading.Event()
    save_meta = ocp.JsonCheckpointHandler._save_fn

    async def held(self, item, directory):
        assert release.wait(timeout=120), "the test never let the save go on"
        return await save_meta(self, item, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", held)
    learner = _learner(MeshConfig(fsdp=1), 1)
    ckpt = TrainCheckpointer(tmp_path)
    ckpt.save(1, learner.state, {"step": 1})
    wait = ckpt.manager.wait_until_finished

    def interrupted():
        ckpt.manager.wait_until_finished = wait
        raise KeyboardInterrupt

    ckpt.manager.wait_until_finished = interrupted
    with pytest.raises(KeyboardInterrupt):
        ckpt.wait()
    release.set()
    ckpt.close()
    assert TrainCheckpointer(tmp_path).latest_step() == 1
