"""The learner shell: non-finite metrics stop the run, and a two-process jax.distributed run."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.compilation import programs
from jaxrl.learner import Learner, NonFiniteMetricError, check_finite, prompt_widths
from jaxrl.models import Decoder
from jaxrl.optim import OptimizerConfig
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.tiny import tiny_config
from jaxrl.train_step import LearnerConfig

from batches import VOCAB, make_batch
from xla_flags import xla_flags

WORKER = Path(__file__).parent / "workers" / "distributed_step.py"


def test_check_finite_names_step_and_metric():
    check_finite({"loss": 1.0, "kl": 0.0}, step=3)
    with pytest.raises(NonFiniteMetricError, match=r"step 7: metric\(s\) \['grad_norm', 'loss'\]"):
        check_finite({"loss": float("nan"), "grad_norm": float("inf"), "kl": 0.1}, step=7)


def test_diverging_run_stops_with_a_clear_error_instead_of_logging_nan():
    cfg = LearnerConfig(group_size=4, optimizer=OptimizerConfig(learning_rate=1e30, max_grad_norm=None))
    model = Decoder(tiny_config("qwen3", vocab_size=VOCAB), nnx.Rngs(0))
    learner = Learner(model, cfg, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    batch = make_batch(sampler=False)
    learner.update(batch)
    with pytest.raises(NonFiniteMetricError, match=r"step 1: metric\(s\) \[.*'grad_norm'"):
        learner.update(batch)


def test_prompt_widths_are_fractions_of_the_widest_in_pairs_of_query_blocks():
    assert prompt_widths(512, 4) == (128, 256, 384, 512) and prompt_widths(512, 1) == (512,)
    assert prompt_widths(300, 4) == (128, 256, 300) and prompt_widths(1024, 2) == (512, 1024)
    assert prompt_widths(64, 4) == (64,) and prompt_widths(128, 4) == (128,)


def _left_widened(batch: dict, width: int) -> dict:
    pad = width - batch["prompt_BxP"].shape[1]
    return {**batch, **{k: np.pad(batch[k], ((0, 0), (pad, 0))) for k in ("prompt_BxP", "prompt_mask_BxP")}}


def test_every_prompt_width_compiles_at_the_first_step_and_takes_the_same_step():
    # The same episodes left-padded to two widths: the narrow batch's step is the wide one's, and a
    # run whose steps change width compiles nothing after its first step.
    cfg = LearnerConfig(group_size=4)
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    cfg_model = tiny_config("qwen3", vocab_size=VOCAB)
    narrow = make_batch(sampler=False)
    wide = _left_widened(narrow, 128)
    one = Learner(Decoder(cfg_model, nnx.Rngs(0)), cfg, mesh, widths=(8, 128))
    other = Learner(Decoder(cfg_model, nnx.Rngs(0)), cfg, mesh)
    m_one = one.update(_left_widened(narrow, 8))
    before = programs()
    m_one2 = one.update(wide)
    assert programs() == before, "a width of the set compiled after the first step"
    m_other = other.update(wide)
    m_other2 = other.update(wide)
    for a, b in ((m_one, m_other), (m_one2, m_other2)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                                         one.state.params, other.state.params))
    assert max(diffs) < 1e-6
    assert {w for _, w in one._step_fns} == {8, 128}


def test_prepared_programs_serve_the_first_update_and_close_stops_preparing():
    # A run prepares its programs while its first rollout runs: the first update then waits for them,
    # compiles nothing more and takes the step an unprepared learner takes. One closed while preparing
    # starts no more programs once those under way are done; an update compiles the rest.
    cfg, widths = LearnerConfig(group_size=4), (8, 32, 64, 128)
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    cfg_model = tiny_config("qwen3", vocab_size=VOCAB)
    batch = _left_widened(make_batch(sampler=False), 32)
    plain = Learner(Decoder(cfg_model, nnx.Rngs(0)), cfg, mesh, widths=widths).update(batch)
    prepared = Learner(Decoder(cfg_model, nnx.Rngs(0)), cfg, mesh, widths=widths)
    before = programs()
    prepared.prepare(batch)
    prepared._prepared.result()
    assert programs() - before == len(widths)
    first = prepared.update(batch)
    assert programs() - before == len(widths), "the first update compiled what prepare had"
    closed = Learner(Decoder(cfg_model, nnx.Rngs(0)), cfg, mesh, widths=widths)
    closed.prepare(batch)
    closed.close()
    closed._prepared.result()
    assert len(closed._step_fns) < len(widths)
    resumed = closed.update(batch)
    assert {w for _, w in closed._step_fns} == set(widths)
    for m in (first, resumed):
        assert m["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert m["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(num_processes, out, *args):
    env = {**os.environ, "XLA_FLAGS": xla_flags(1),
           "PYTHONPATH": str(Path(__file__).parents[1])}
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), address, str(num_processes), str(pid), str(out), *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for pid in range(num_processes)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
    return np.load(out)


@pytest.mark.parametrize("way", ["full", "lora", "packed"])
def test_two_process_distributed_run_takes_the_same_step_as_one_process(tmp_path, way):
    lora = way == "lora"
    args = [] if way == "full" else [way]
    one = _run_workers(1, tmp_path / "one.npz", *args)
    two = _run_workers(2, tmp_path / "two.npz", *args)
    assert len(one.files) == len(two.files) > 10
    for name in one.files:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, rtol=0)
    if way == "full":  # the model, saved by both processes together (process 0 writes)
        from jaxrl.models.hf import read_safetensors

        a, b = (read_safetensors(f"{tmp_path / name}.model") for name in ("one.npz", "two.npz"))
        assert a.keys() == b.keys() and len(a) > 10
        for name in a:
            np.testing.assert_allclose(b[name], a[name], atol=1e-5, rtol=0)
    if lora:  # the adapters' snapshot, written by both processes together
        from jaxrl.snapshots import SnapshotReader

        a, b = (SnapshotReader(f"{tmp_path / name}.snapshots").load(1) for name in ("one.npz", "two.npz"))
        assert a.adapter_config == b.adapter_config and a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            np.testing.assert_allclose(b.tensors[name], a.tensors[name], atol=1e-5, rtol=0)
