"""One run over several processes: start-up decisions, each process's share of a step, and `jaxrl
train` on 2 processes x 4 CPU devices against 1 process x 8 (the same warm start and steps, then a
resume on 1)."""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from object_store import s3_server
from jaxrl.run.collection import Share, StepRollouts
from jaxrl.run.config import DistributedConfig, load_config
from jaxrl.run.distributed import Exchange, cluster_processes, exchange_step, initialize, share_of
from jaxrl.run.services import StartupError
from jaxrl.run.tracking import read_metrics
from jaxrl.run.train import SNAPSHOTS_KEPT
from jaxrl.sharding import MeshConfig, make_mesh
from jaxrl.snapshots import snapshot_versions
from jaxrl.tiny import build_tiny_model

from xla_flags import xla_flags

ROOT = Path(__file__).parents[1]
BUCKET_SNAPSHOTS = "s3://snapshots/two"
SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


def test_the_cluster_environment_jax_detects_gives_the_process_count(monkeypatch):
    for key in SLURM:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("OMPI_MCA_orte_hnp_uri", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert cluster_processes() == 1
    assert initialize(DistributedConfig()) == 1 and not jax.distributed.is_initialized()
    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    assert cluster_processes() == 2
    assert initialize(DistributedConfig(auto=False)) == 1 and not jax.distributed.is_initialized()


@pytest.mark.parametrize("overrides, message", [
    (["distributed.num_processes=0"], "num_processes=0 must be >= 1"),
    (["distributed.num_processes=2", "distributed.process_id=2"], r"process_id=2 must be in \[0, num_processes=2\)"),
    (["distributed.coordinator=node001"], "must be host:port"),
])
def test_bad_distributed_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config({"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]}, overrides)


def test_refill_slots_of_shares_never_collide_and_one_share_counts_up():
    assert [Share(0, 4, 4).slot(i) for i in range(7)] == list(range(7))
    shares = [Share(first, 2, 8) for first in (0, 2, 4, 6)]
    slots = [[s.slot(i) for i in range(5)] for s in shares]
    assert slots[1] == [2, 3, 9, 13, 17]
    flat = [x for s in slots for x in s]
    assert len(set(flat)) == len(flat) and set(range(8)) <= set(flat)


def test_one_process_owns_every_group_and_exchanges_with_itself():
    cfg = load_config({"run_dir": "r", "model": {"dir": "m"}, "envs": [{"name": "echo", "bundled": "echo"}]},
                      ["rollout.groups_per_step=3"])
    assert share_of(make_mesh(MeshConfig()), cfg) == Share(0, 3, 3)
    result = StepRollouts([], collections.Counter(episodes=4), 1.0, 0.5, 0.5)
    step = exchange_step(Exchange(1.0), result, 70, False, {"env/echo/restarts": 1.0}, {"time/rollout_s": 1.0})
    assert (step.groups, step.counts["episodes"], step.prompt_len, step.stop) == ([], 4, 70, False)
    assert step.sums == {"env/echo/restarts": 1.0} and step.maxima == {"time/rollout_s": 1.0}


# --- jaxrl train on 2 processes x 4 devices against 1 x 8 --------------------------------------------------------

STEPS = 7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pod")
    model_dir = build_tiny_model(tmp / "model", "qwen3")
    config = tmp / "c.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp / "unused"), "model": {"dir": str(model_dir)},
        "envs": [{"name": "echo", "bundled": "echo", "max_concurrent_envs": 8}],
        "rewards": [{"fn": "tests.workers.rewards:even_length"}],  # about half: groups that learn
        "steps": STEPS,
        "rollout": {"groups_per_step": 2, "max_tokens": 12, "max_total_tokens": 24, "max_prompt_tokens": 64},
        "learner": {"group_size": 4, "optimizer": {"learning_rate": 1e-3}},
        # A warm start first: each process trains on its share of the same demonstrations. At the
        # default 3e-3, AdamW's first steps turned the rounding of a near-zero gradient (sums over 4
        # devices, not 8) into 5e-5 on one weight; a wrong share still moves many by ~2e-4.
        "sft": {"steps": 2, "batch_size": 8, "demonstrations": 16, "learning_rate": 1e-4},
        "eval": {"episodes": 0}, "checkpoint_every": 1, "keep_checkpoints": STEPS,
        "log": {"progress": False, "tensorboard": False},
    }))
    return tmp, config


def _train(config: Path, run_dir: Path, devices: int, *args) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices)}
    return subprocess.Popen([sys.executable, "-m", "jaxrl.run.cli", "train", str(config), "--set",
                             f"run_dir={run_dir}", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, code: int = 0) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(setup):
    """1 process x 8 devices, every step checkpointed."""
    tmp, config = setup
    run_dir = tmp / "one"
    assert _finish(_train(config, run_dir, 8))["steps"] == STEPS
    return run_dir


@pytest.fixture(scope="module")
def two_processes(setup):
    """2 processes x 4 devices with a bridge each, snapshots in an S3 bucket (as on a pod, where no
    file system is shared), process 1 sent SIGTERM once step 3 is logged: both stop after the same
    step (the run directory, that step, the bucket's snapshot versions)."""
    tmp, config = setup
    run_dir = tmp / "two"
    address = f"127.0.0.1:{_free_port()}"
    with s3_server() as s3, pytest.MonkeyPatch.context() as mp:
        for k, v in s3.items():
            mp.setenv(k, v)
        procs = [_train(config, run_dir, 4, "--coordinator", address, "--num-processes", "2", "--process-id", str(i),
                        "--set", f"snapshot_dir={BUCKET_SNAPSHOTS}")
                 for i in range(2)]
        summaries = _stop_after_step_3(procs, run_dir)
        bucket_versions = snapshot_versions(BUCKET_SNAPSHOTS)
    assert summaries[0]["steps"] == summaries[1]["steps"]
    assert [s["stopped"] for s in summaries] == ["SIGTERM", "SIGTERM"]
    assert [s["programs_after_first_step"] for s in summaries] == [0, 0]  # each process's, and its bridge's
    return run_dir, summaries[0]["steps"], bucket_versions


def _stop_after_step_3(procs: list[subprocess.Popen], run_dir: Path) -> list[dict]:
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 3:
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no third step logged"
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        return [_finish(p, 128 + signal.SIGTERM) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _params(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """The parameters of a run's checkpoint `step`, as NumPy arrays by path."""
    path = run_dir / "checkpoints" / str(step) / "state"
    with ocp.PyTreeCheckpointer() as ckpt:
        meta = ckpt.metadata(path).item_metadata.tree
        tree = ckpt.restore(path, args=ocp.args.PyTreeRestore(item=meta, restore_args=jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)))
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree["params"])}


def _assert_same_params(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """Within float32 rounding: AdamW turns the rounding of a near-zero gradient (summed over 4 devices,
    not 8) into up to a step's size on a weight here and there (1.2e-5 on one of 32,768 embedding
    weights at tests/xla_flags.py's -O0), while a wrong share moves many weights by ~2e-4."""
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=5e-5, rtol=0, err_msg=name)
        assert np.mean(np.abs(a[name] - b[name]) > 1e-5) < 1e-3, name


def _assert_same_steps(rows: list[dict], reference: list[dict]) -> None:
    by_step = {r["step"]: r for r in reference}
    for row in rows:
        for key in ("loss", "reward/mean", "grad_norm"):
            assert abs(row[key] - by_step[row["step"]][key]) <= 1e-5, (row["step"], key)


def test_two_processes_take_the_steps_one_process_takes(reference, two_processes):
    run_dir, steps, bucket_versions = two_processes
    assert 4 <= steps < STEPS
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # process 0's alone
    assert {r["rollout/episodes"] for r in rows} == {8.0}  # both processes' episodes, counted once each
    assert any(r["grad_norm"] > 0.1 for r in rows)  # the steps learnt something
    _assert_same_steps(rows, read_metrics(reference))
    _assert_same_params(_params(run_dir, steps), _params(reference, steps))
    assert (run_dir / "logs" / "process-1" / "bridge.log").is_file()  # process 1's children, apart
    record = json.loads((run_dir / "run.json").read_text())
    assert [s["processes"] for s in record["sessions"]] == [2]
    # The bridges served the bucket's snapshots; the last one served was copied into the run directory.
    assert bucket_versions[-1] == steps + 1 and len(bucket_versions) == SNAPSHOTS_KEPT
    assert snapshot_versions(run_dir / "snapshots") == [steps + 1]


def test_a_two_process_run_resumes_on_one_process_and_ends_as_an_unbroken_run(setup, reference, two_processes):
    _, config = setup
    run_dir, stopped_at, _ = two_processes
    summary = _finish(_train(config, run_dir, 8, "--resume"))
    assert summary["steps"] == STEPS and summary["programs_after_first_step"] == 0  # counted from its first step
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    _assert_same_steps(rows[stopped_at:], read_metrics(reference))
    _assert_same_params(_params(run_dir, STEPS), _params(reference, STEPS))
